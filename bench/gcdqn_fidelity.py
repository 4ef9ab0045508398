"""GC-DQN differences from the reference's code, measured on CPU (docs/reference.md, "Where GC-DQN departs"):

    python bench/gcdqn_fidelity.py alpha checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/pretrained.pt
    python bench/gcdqn_fidelity.py horizon
    python bench/gcdqn_fidelity.py init
    python bench/gcdqn_fidelity.py depth-q checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/pretrained.pt

alpha: the temperature at which each form of the temperature loss is stationary, for a trained critic held fixed,
on relabelled batches of its own episodes. per-state (the reference's) averages (H(s) - 1.1)^2 over states;
batch-mean (this script's loss before) squares the batch's mean entropy minus 1.1.

horizon: future-goal offsets, simulated. Ours: t uniform in 0..99, offset ~ 0.99^j on 1..100 - t. The reference's
replay (rb.py): a window of 100 stored steps s_0..s_99 (no s_100) at a uniform phase, the state at a window place p
in 0..98, the offset inside both its episode and the window (none left: the goal is the state itself).

init: the untrained IRU-5's full-depth Q on Generalize-4-1 start states, with PyTorch's init and with flax's (the
reference's), 3 network seeds each: how much Q varies across the 6 actions, and the entropy of softmax(Q / alpha) at
the initial alpha = 1 (uniform: ln 6 = 1.792).

depth-q: a checkpoint's mean Q at each depth (over critics and actions) on 256 start states of its env's train
split: the scale of the targets that AnyK-TD shares across depths (docs/results/ablations.md).
"""

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import flexloop_gcdqn as gcdqn  # noqa: E402
import flexloop_run  # noqa: E402


def stationary_alpha(checkpoint_path, num_envs=256, batches=8, target_entropy=-1.1):
    checkpoint = flexloop_run.load_checkpoint(checkpoint_path, gcdqn.ALGORITHM)
    network, args = gcdqn.network_from_checkpoint(checkpoint)
    env = envs.make_vec(args.env_id, num_envs, device="cpu", seed=123, check_actions=False).unwrapped
    generator = torch.Generator().manual_seed(0)
    replay = gcdqn.TrajectoryReplay(num_envs, 1, args.episode_length, "cpu")
    with torch.no_grad():
        replay.add(*gcdqn.run_episode(network, env, args.depth, generator)[:3])
        q = torch.cat([network.full_depth(b["obs"], b["goal"]).mean(0)
                       for b in (replay.sample(num_envs, generator) for _ in range(batches))])  # (states, actions)
    log_alphas = torch.linspace(math.log(0.05), math.log(2.0), 400)
    log_policy = torch.log_softmax(q[None] / log_alphas.exp()[:, None, None], -1)
    entropy = -(log_policy.exp() * log_policy).sum(-1)  # (alphas, states)
    slope = torch.gradient(entropy, spacing=(log_alphas,), dim=0)[0]  # dH / dlog(alpha)
    gradients = {"per-state": ((entropy + target_entropy) * slope).mean(1),  # of each loss, up to a factor 2
                 "batch-mean": (entropy.mean(1) + target_entropy) * slope.mean(1)}
    result = {"what": "stationary alpha", "checkpoint": str(checkpoint_path), "updates": checkpoint["updates"],
              "alpha_in_checkpoint": round(network.log_alpha.exp().item(), 3), "states": q.shape[0]}
    for form, gradient in gradients.items():
        i = int(torch.nonzero(gradient[1:].sign() != gradient[:-1].sign())[0])
        result[form] = {"alpha": round(log_alphas[i].exp().item(), 3),
                        "mean_entropy": round(entropy[i].mean().item(), 3)}
    return result


def future_offsets(samples=400_000, length=100, discount=0.99):
    rng = np.random.default_rng(0)

    def truncated_geometric(horizon):
        u = rng.random(len(horizon))
        return np.minimum(1 + np.floor(np.log1p(-u * (1 - discount ** horizon)) / np.log(discount)), horizon)

    t = rng.integers(0, length, samples)
    ours = truncated_geometric(length - t)
    phase, place = rng.integers(0, length, samples), rng.integers(0, length - 1, samples)
    step = (phase + place) % length  # the state's step in its episode
    horizon = np.minimum(length - 1 - step, length - 1 - place)
    reference = np.where(horizon > 0, truncated_geometric(np.maximum(horizon, 1)), 0)
    return {"what": "future-goal offsets", **{name: {"mean": round(float(o.mean()), 1),
                                                      "share_at_least_50": round(float((o >= 50).mean()), 3),
                                                      "share_1": round(float((o == 1).mean()), 3),
                                                      "share_self": round(float((o == 0).mean()), 3)}
                                              for name, o in [("ours", ours), ("reference", reference)]}}


def initial_q_spread(num_envs=1024, seeds=(0, 1, 2)):
    env = envs.make_vec("BoxPick-Generalize-4-1-v0", num_envs, device="cpu", seed=0, check_actions=False).unwrapped
    obs, _ = env.reset(seed=0)
    result = {"what": "untrained full-depth Q across the 6 actions, Generalize-4-1 start states"}
    for init in ("pytorch", "flax"):
        spread, entropy = [], []
        for seed in seeds:
            torch.manual_seed(seed)
            network = gcdqn.build_network(gcdqn.Args(init=init, cuda=False), "cpu")
            with torch.no_grad():
                q = network.full_depth(obs["observation"], obs["desired_goal"]).mean(0)  # (states, actions)
            spread.append(round(q.std(-1).median().item(), 3))
            policy = torch.softmax(q, -1)
            entropy.append(round(-(policy * policy.log()).sum(-1).mean().item(), 3))
        result[init] = {"median_std_across_actions": spread, "entropy_at_alpha_1": entropy}
    return result


def q_by_depth(checkpoint_path, num_envs=256):
    checkpoint = flexloop_run.load_checkpoint(checkpoint_path, gcdqn.ALGORITHM)
    network, args = gcdqn.network_from_checkpoint(checkpoint)
    env = envs.make_vec(args.env_id, num_envs, device="cpu", split="train", seed=0, check_actions=False).unwrapped
    obs, _ = env.reset()
    with torch.no_grad():
        q = network.all_depths(obs["observation"], obs["desired_goal"])  # (K, critics, states, actions)
    return {"what": "mean Q at each depth, train start states", "checkpoint": str(checkpoint_path),
            "updates": checkpoint["updates"], "states": num_envs,
            "mean_q_by_depth": [round(q[k].mean().item(), 1) for k in range(len(q))]}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=["alpha", "horizon", "init", "depth-q"])
    parser.add_argument("checkpoint", nargs="?", help="a GC-DQN checkpoint (alpha, depth-q)")
    cli = parser.parse_args()
    if cli.what in ("alpha", "depth-q") and not cli.checkpoint:
        parser.error(f"{cli.what} needs a checkpoint, e.g. "
                     "checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/pretrained.pt")
    torch.manual_seed(0)
    measure = {"alpha": lambda: stationary_alpha(cli.checkpoint), "horizon": future_offsets, "init": initial_q_spread,
               "depth-q": lambda: q_by_depth(cli.checkpoint)}
    print(json.dumps(measure[cli.what]()))
