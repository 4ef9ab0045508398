"""Mean depth and success at one ε against the length of the FlexLoop phase: one eval_adaptive.py results.json per
seed, each holding the IRU-K and the FlexLoop checkpoints of different lengths evaluated on the same episodes. Mean
over seeds with the standard deviation as error bars, and the paper's train values as dashed lines.

    python bench/plot_flexloop_length.py \
        --results docs/results/data/eval_adaptive_lightsout_seed{1,2,3}_flexloop_length.results.json \
        --steps 0 50 150 --eps 0.05 --paper 0.747 2.84 --out docs/figures/lightsout_flexloop_length.png

--steps gives the FlexLoop env steps (millions) of each checkpoint in the files' order (0: the IRU-K itself).
"""

import argparse
import json

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def at_eps(checkpoint, split, eps):
    return next(row for row in checkpoint["adaptive"][split] if abs(row["eps"] - eps) < 1e-9)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", nargs="+", required=True, help="one results.json per seed")
    parser.add_argument("--steps", type=float, nargs="+", required=True, help="FlexLoop env steps (M) per checkpoint")
    parser.add_argument("--eps", type=float, default=0.05)
    parser.add_argument("--paper", type=float, nargs=2, metavar=("SUCCESS", "DEPTH"), help="the paper's train point")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    results = [json.load(open(path)) for path in cli.results]
    if any(len(r["checkpoints"]) != len(cli.steps) for r in results):
        raise SystemExit(f"--steps gives {len(cli.steps)} lengths, but a results file holds another number of "
                         "checkpoints: give one length per checkpoint, in the files' order")

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    summary = {}
    for split, marker in [("train", "o"), ("unseen", "s")]:
        rows = np.array([[[at_eps(c, split, cli.eps)[key] for key in ("mean_depth", "success")]
                          for c in r["checkpoints"]] for r in results])  # (seeds, checkpoints, 2)
        mean, std = rows.mean(0), rows.std(0, ddof=1) if len(results) > 1 else np.zeros(rows.shape[1:])
        for ax, column, name in [(axes[0], 0, "mean depth"), (axes[1], 1, "success")]:
            ax.errorbar(cli.steps, mean[:, column], std[:, column], marker=marker, capsize=3, label=split)
            ax.set(xlabel="FlexLoop env steps (millions)", ylabel=f"{name} at ε = {cli.eps}")
        summary[split] = {"mean_depth": mean[:, 0].round(3).tolist(), "success": mean[:, 1].round(3).tolist()}
    if cli.paper:
        axes[0].axhline(cli.paper[1], color="grey", ls="--", lw=1, label="paper, train (length not stated)")
        axes[1].axhline(cli.paper[0], color="grey", ls="--", lw=1, label="paper, train")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"FlexLoop phase length: {len(results)} seeds, mean ± std")
    fig.tight_layout()
    fig.savefig(cli.out, dpi=130)
    print(json.dumps({"out": cli.out, "steps": cli.steps, "eps": cli.eps, **summary}))


if __name__ == "__main__":
    main()
