"""BoxPick at the paper's protocol: Table 4's rows over seeds, Table 2's BoxPick rows, the Pareto figures and the
delta_k analysis of the paper's Figure 3, from eval_adaptive.py's results.json files and the runs' metrics.jsonl.

    python bench/plot_protocol.py --results docs/results/data/*.results.json \
        --metrics checkpoints/BoxPick-*__ref__*/metrics.jsonl checkpoints/BoxPick-*__gen-flax__*/metrics.jsonl \
        --out docs/figures

Each results.json holds one or more evaluated checkpoints, labelled as eval_adaptive.py was told (--labels):
IRU-5 at the end of pretraining, FlexLoop after post-training and, where it ran, the Self-TD-Only control. A seed
is one results.json entry; rows are mean +- std over seeds (the sample std, ddof 1, as the paper's tables; 0 for
one seed). Prints JSON.
"""
import argparse
import json
from collections import defaultdict
from pathlib import Path

import numpy as np

VARIANTS = ("BoxPick-Exact-3-v0", "BoxPick-Exact-4-v0", "BoxPick-Generalize-4-1-v0", "BoxPick-Generalize-4-2-v0")
SPLITS = ("train", "unseen")
IRU, FLEXLOOP, CONTROL = "IRU-5", "FlexLoop", "Self-TD-Only"
# The paper's appendix table (adaptive results): FlexLoop depth, FlexLoop success, IRU-5 success, each (mean, std).
PAPER_TABLE4 = {
    ("BoxPick-Exact-3-v0", "train"): ((4.47, 0.02), (0.992, 0.004), (0.992, 0.003)),
    ("BoxPick-Exact-3-v0", "unseen"): ((4.45, 0.05), (0.768, 0.101), (0.766, 0.091)),
    ("BoxPick-Exact-4-v0", "train"): ((4.21, 0.04), (0.993, 0.002), (0.994, 0.003)),
    ("BoxPick-Exact-4-v0", "unseen"): ((4.25, 0.04), (0.567, 0.098), (0.506, 0.077)),
    ("BoxPick-Generalize-4-1-v0", "train"): ((4.68, 0.03), (0.982, 0.007), (0.980, 0.007)),
    ("BoxPick-Generalize-4-1-v0", "unseen"): ((4.57, 0.02), (0.820, 0.033), (0.820, 0.022)),
    ("BoxPick-Generalize-4-2-v0", "train"): ((4.66, 0.01), (0.991, 0.004), (0.989, 0.004)),
    ("BoxPick-Generalize-4-2-v0", "unseen"): ((4.57, 0.01), (0.956, 0.017), (0.948, 0.019)),
}
PAPER_TABLE2 = {"train": (4.50, 0.989, 0.989), "unseen": (4.46, 0.778, 0.760)}  # depth, FlexLoop, IRU-5


def model_of(label):
    """IRU-5, FlexLoop or Self-TD-Only, from a label such as 'FlexLoop-5M+1M'."""
    for model in (IRU, FLEXLOOP, CONTROL):
        if label.startswith(model):
            return model
    raise ValueError(f"label {label!r} names none of {IRU}, {FLEXLOOP}, {CONTROL}; relabel with eval_adaptive.py "
                     "--labels")


def load_evaluations(paths):
    """{(env_id, model): [checkpoint entry per seed]}, the seeds in the order the files were given."""
    evaluations = defaultdict(list)
    for path in paths:
        for entry in json.loads(Path(path).read_text())["checkpoints"]:
            evaluations[entry["env_id"], model_of(entry["label"])].append(entry)
    return evaluations


def per_split_calibration(entry, split, retain):
    """The adaptive point of least mean depth that keeps `retain` of this split's own full-depth success: the
    stopping threshold as if it were chosen on this split rather than on train tasks."""
    floor = retain * entry["elasticity"][split][-1]
    kept = [point for point in entry["adaptive"][split] if point["success"] >= floor]
    return min(kept, key=lambda point: point["mean_depth"])


def mean_std(values):
    return float(np.mean(values)), float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def table4(evaluations, retain):
    """One row per variant and split: FlexLoop's depth and success at the threshold calibrated on train tasks
    (eval_adaptive.py's choice), IRU-5's full-depth success, and what explains the unseen gap: FlexLoop's full
    depth, the control's full depth, and FlexLoop at a threshold calibrated on the split itself."""
    rows = []
    for env_id in VARIANTS:
        flexloop, iru, control = (evaluations.get((env_id, model), []) for model in (FLEXLOOP, IRU, CONTROL))
        if not flexloop or not iru:
            continue
        for split in SPLITS:
            calibrated = [entry["calibration"]["results"][split] for entry in flexloop]
            own = [per_split_calibration(entry, split, retain) for entry in flexloop]
            rows.append({
                "env_id": env_id, "split": split, "seeds": len(flexloop),
                "flexloop_depth": mean_std([point["mean_depth"] for point in calibrated]),
                "flexloop_success": mean_std([point["success"] for point in calibrated]),
                "flexloop_eps": [entry["calibration"]["eps"] for entry in flexloop],
                "iru_success": mean_std([entry["elasticity"][split][-1] for entry in iru]),
                "flexloop_full_depth": mean_std([entry["elasticity"][split][-1] for entry in flexloop]),
                "control_full_depth": mean_std([entry["elasticity"][split][-1] for entry in control])
                if control else None,
                "own_split_depth": mean_std([point["mean_depth"] for point in own]),
                "own_split_success": mean_std([point["success"] for point in own]),
                "paper": PAPER_TABLE4[env_id, split],
            })
    return rows


def table2(rows):
    """The paper's Table 2 BoxPick rows: per split, the mean over the four variants of each variant's mean over
    seeds. None until all four variants are in."""
    result = {}
    for split in SPLITS:
        split_rows = [row for row in rows if row["split"] == split]
        if len(split_rows) < len(VARIANTS):
            result[split] = None
            continue
        result[split] = {key: float(np.mean([row[key][0] for row in split_rows]))
                         for key in ("flexloop_depth", "flexloop_success", "iru_success")}
        result[split]["paper"] = PAPER_TABLE2[split]
    return result


def pyplot():
    """matplotlib's pyplot, drawing to files only (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def pareto_figure(evaluations, out):
    """Success against mean depth over the epsilon grid, per variant and split, mean over seeds."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(VARIANTS), figsize=(4 * len(VARIANTS), 7), squeeze=False)
    for column, env_id in enumerate(VARIANTS):
        for row, split in enumerate(SPLITS):
            ax = axes[row, column]
            for model, color in ((IRU, "tab:gray"), (FLEXLOOP, "tab:blue"), (CONTROL, "tab:orange")):
                entries = evaluations.get((env_id, model), [])
                if not entries:
                    continue
                depth = np.mean([[p["mean_depth"] for p in e["adaptive"][split]] for e in entries], axis=0)
                success = np.mean([[p["success"] for p in e["adaptive"][split]] for e in entries], axis=0)
                ax.plot(depth, success, "o-", color=color, label=f"{model} ({len(entries)} seed{'s' if len(entries) > 1 else ''})")
            ax.set_title(f"{env_id.removeprefix('BoxPick-').removesuffix('-v0')}, {split}")
            ax.set_xlabel("mean depth")
            ax.set_ylabel("success")
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def delta_figure(evaluations, depth_kl_curves, out):
    """The paper's Figure 3: the adjacent-depth KL (losses/depth_kl) during training, and delta_k against
    KL(pi_K || pi_k) in quantile bins of delta_k, before (IRU-5) and after FlexLoop, on Exact-4."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, (updates, kl) in sorted(depth_kl_curves.items()):
        axes[0].plot(updates, kl, label=name, lw=1)
    axes[0].set_xlabel("updates")
    axes[0].set_ylabel("mean adjacent KL (losses/depth_kl)")
    axes[0].legend(fontsize=7)
    for ax, split in zip(axes[1:], SPLITS):
        for model, color in ((IRU, "tab:gray"), (FLEXLOOP, "tab:blue")):
            entries = evaluations.get(("BoxPick-Exact-4-v0", model), [])
            if not entries:
                continue
            delta = np.mean([[b["delta_mean"] for b in e["analysis"]["bins"][split]] for e in entries], axis=0)
            endpoint = np.mean([[b["endpoint_mean"] for b in e["analysis"]["bins"][split]] for e in entries], axis=0)
            ax.plot(delta, endpoint, "o-", color=color, label=model)
        ax.set_xscale("log")
        ax.set_xlabel("delta_k (bin mean)")
        ax.set_ylabel("KL(pi_K || pi_k) (bin mean)")
        ax.set_title(f"Exact-4, {split}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def depth_kl_curve(path):
    """(updates, losses/depth_kl) of one run's metrics.jsonl; the name is the run's env and seed."""
    records = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    logged = [r for r in records if "losses/depth_kl" in r and "charts/updates" in r]
    name = Path(path).parent.name.split("__")
    return f"{name[0].removeprefix('BoxPick-').removesuffix('-v0')} s{name[2]}", (
        [r["charts/updates"] for r in logged], [r["losses/depth_kl"] for r in logged])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", required=True, help="eval_adaptive.py results.json files")
    parser.add_argument("--metrics", nargs="*", default=[], help="metrics.jsonl of runs for the depth-KL curves")
    parser.add_argument("--retain", type=float, default=0.99, help="share of full-depth success a threshold keeps")
    parser.add_argument("--out", default=None, help="folder for the figures (none drawn when not given)")
    args = parser.parse_args()
    evaluations = load_evaluations(args.results)
    rows = table4(evaluations, args.retain)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        pareto_figure(evaluations, Path(args.out) / "boxpick_pareto.png")
        curves = dict(depth_kl_curve(path) for path in args.metrics)
        delta_figure(evaluations, curves, Path(args.out) / "boxpick_delta.png")
    print(json.dumps({"table4": rows, "table2": table2(rows)}, indent=1))


if __name__ == "__main__":
    main()
