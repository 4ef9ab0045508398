"""Full-depth success against env steps for a screen of LightsOut variants (sweeps/lightsout_screen.sh): the mean
over seeds as a line, each seed as a faint line, the paper's IRU-5 value as a dashed line.

    python bench/plot_screen.py --evals docs/results/data/lightsout_screen_evals.jsonl --out lightsout_screen.png

--evals is a JSON-lines file with one record per evaluation: variant, seed, global_step and the run's
eval/<split>/success_depth_<k> values (docs/results/data/lightsout_screen_evals.jsonl was made from the screen's
metrics.jsonl files).
"""

import argparse
import json
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PAPER_FULL_DEPTH = {"train": 0.732, "unseen": 0.013}  # the paper's Table 2, IRU-5 on LightsOut


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--evals", required=True)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    curves = defaultdict(lambda: defaultdict(list))  # variant -> seed -> [record]
    for line in open(cli.evals):
        record = json.loads(line)
        curves[record["variant"]][record["seed"]].append(record)
    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.cm.tab10.colors
    for axis, split in zip(axes, ["train", "unseen"]):
        key = f"eval/{split}/success_depth_{cli.depth}"
        for colour, (variant, seeds) in zip(colours, sorted(curves.items())):
            runs = [sorted(records, key=lambda r: r["global_step"]) for records in seeds.values()]
            for records in runs:
                axis.plot([r["global_step"] / 1e6 for r in records], [r[key] for r in records], color=colour,
                          alpha=0.2, linewidth=0.8)
            length = min(len(records) for records in runs)
            steps = [runs[0][i]["global_step"] / 1e6 for i in range(length)]
            mean = [sum(records[i][key] for records in runs) / len(runs) for i in range(length)]
            axis.plot(steps, mean, color=colour, linewidth=2, label=f"{variant} ({len(runs)} seeds)")
        axis.axhline(PAPER_FULL_DEPTH[split], color="black", linestyle="--", linewidth=1, label="paper, IRU-5")
        axis.set_xlabel("env steps (millions)")
        axis.set_ylabel(f"success at depth {cli.depth}")
        axis.set_title(f"{split} tasks")
        axis.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="upper left")
    figure.suptitle("LightsOut-4x5, IRU-5 GC-PPO pretraining: one of the authors' PPO choices per variant")
    figure.tight_layout()
    figure.savefig(cli.out, dpi=120)
    print(json.dumps({"out": cli.out, "variants": {v: len(s) for v, s in curves.items()}}))


if __name__ == "__main__":
    main()
