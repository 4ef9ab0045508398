"""How far further training moved each depth's actions, and how often GC-IQL's actor means leave the action box.

    python bench/action_drift.py --env-name pointmaze-large-stitch-v0 --dataset-dir data \
        --pairs checkpoints/<IRU-5>/final.pt checkpoints/<FlexLoop>/final.pt \
                checkpoints/<IRU-5>/final.pt checkpoints/<control>/final.pt

All checkpoints act on one batch of dataset states with goals drawn as the actor's are in training (the dataset's
own mixture, the same seed for every checkpoint). Prints JSON: for each checkpoint and depth, the median |mean| and
the fraction of mean entries outside [-1, 1] (the actor acts with the mean clipped to the box, so beyond it the
DDPG term has no gradient); for each pair (before, after) and depth, the mean L2 distance between the two clipped
mean actions. A pair of a FlexLoop run and its Self-TD Only control, each against their common IRU-K, tells how much
of the movement at full depth comes with the depth loss and how much with the further updates alone.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flexloop_gciql  # noqa: E402
import flexloop_run  # noqa: E402
from envs import ogbench_data  # noqa: E402


def load_actor(path):
    actor, _ = flexloop_gciql.network_from_checkpoint(flexloop_run.load_checkpoint(path, flexloop_gciql.ALGORITHM))
    return actor.eval()


@torch.no_grad()
def depth_means(actor, batch):
    """The mean of pi_k at each depth k = 1..K, (K, rows, action_dim)."""
    return actor.all_depths(batch["observations"], batch["actor_goals"])[:, :, 0, :]


def saturation(means):
    return {"median_abs_mean": [round(v, 4) for v in means.abs().flatten(1).median(1).values.tolist()],
            "outside_box": [round(v, 4) for v in (means.abs() > 1).float().flatten(1).mean(1).tolist()]}


def action_change(before, after):
    """Mean L2 distance between the clipped mean actions, per depth."""
    distance = (before.clamp(-1, 1) - after.clamp(-1, 1)).norm(dim=-1).mean(-1)
    return [round(v, 4) for v in distance.tolist()]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env-name", required=True)
    parser.add_argument("--dataset-dir", required=True)
    parser.add_argument("--pairs", nargs="+", required=True, help="checkpoints in pairs: before after [before after]")
    parser.add_argument("--states", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if len(args.pairs) % 2:
        parser.error(f"--pairs takes checkpoints two by two (before after), got {len(args.pairs)}")

    goals = flexloop_gciql.DATASET_HYPERPARAMETERS[args.env_name].actor_goals
    dataset = ogbench_data.load_dataset(args.env_name, dataset_dir=args.dataset_dir, download=False,
                                        actor_goals=goals)
    batch = dataset.sample(args.states, generator=torch.Generator().manual_seed(args.seed))
    means = {path: depth_means(load_actor(path), batch) for path in dict.fromkeys(args.pairs)}
    pairs = list(zip(args.pairs[::2], args.pairs[1::2]))
    report = {"env_name": args.env_name, "states": args.states, "seed": args.seed,
              "checkpoints": {path: saturation(m) for path, m in means.items()},
              "pairs": [{"before": b, "after": a, "mean_action_change": action_change(means[b], means[a])}
                        for b, a in pairs]}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
