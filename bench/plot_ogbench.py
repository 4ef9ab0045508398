"""OGBench at the paper's protocol: Table 4's five OGBench rows over seeds, Table 2's OGBench row, and per dataset
the elasticity and Pareto figures and the paper's Figure 6 (the depth FlexLoop stops at, step by step, in
successful episodes), from eval_adaptive.py's results.json files.

    python bench/plot_ogbench.py --results runs/ogbench-*/eval*/seed*/results.json --out docs/figures

Each results.json holds the checkpoints of one seed on one dataset, labelled as eval_adaptive.py was told
(--labels, as reproduce.py gives them): IRU-5 after pretraining, FlexLoop after post-training and, where it ran,
the Self-TD-Only control (reproduce.py evaluates seed 1's apart, in eval-control/seed1). On OGBench
eval_adaptive.py reports each of the 5 tasks and their mean, and calibrates epsilon on that mean; the rows here
are those means, mean +- std over seeds (the sample std, as the paper's tables). Prints JSON.
"""
import argparse
import importlib.util
import json
from pathlib import Path

import numpy as np

spec = importlib.util.spec_from_file_location("plot_protocol", Path(__file__).resolve().parent / "plot_protocol.py")
plot_protocol = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_protocol)
IRU, FLEXLOOP, CONTROL = plot_protocol.IRU, plot_protocol.FLEXLOOP, plot_protocol.CONTROL
mean_std, pyplot = plot_protocol.mean_std, plot_protocol.pyplot

DATASETS = ("scene-play-v0", "cube-double-play-v0", "puzzle-4x4-play-v0", "antmaze-medium-stitch-v0",
            "pointmaze-large-stitch-v0")
TASKS = ("task1", "task2", "task3", "task4", "task5")
# The paper's appendix table (adaptive results): FlexLoop depth, FlexLoop success, IRU-5 success, each (mean, std).
PAPER_TABLE4 = {
    "scene-play-v0": ((4.66, 0.06), (0.496, 0.064), (0.489, 0.087)),
    "cube-double-play-v0": ((4.75, 0.03), (0.569, 0.056), (0.492, 0.114)),
    "puzzle-4x4-play-v0": ((3.45, 0.03), (0.296, 0.029), (0.293, 0.01)),
    "antmaze-medium-stitch-v0": ((4.80, 0.03), (0.292, 0.059), (0.253, 0.034)),
    "pointmaze-large-stitch-v0": ((3.28, 0.30), (0.395, 0.004), (0.396, 0.003)),
}
PAPER_TABLE2 = ((4.19, 0.08), (0.410, 0.020), (0.385, 0.029))  # the OGBench row: depth, FlexLoop, IRU-5
# OGBench's own GC-IQL (Park et al., ICLR 2025, Table 2; 8 seeds, plain MLPs and OGBench's hyperparameters).
OGBENCH_GCIQL = {"scene-play-v0": (0.51, 0.04), "cube-double-play-v0": (0.40, 0.05),
                 "puzzle-4x4-play-v0": (0.26, 0.03), "antmaze-medium-stitch-v0": (0.29, 0.06),
                 "pointmaze-large-stitch-v0": (0.31, 0.02)}


def load_evaluations(paths):
    """{(dataset, model): [checkpoint entry per seed]}; a dataset outside the paper's five names the fix."""
    evaluations = plot_protocol.load_evaluations(paths)
    for dataset, _ in evaluations:
        if dataset not in DATASETS:
            raise ValueError(f"{dataset} is not one of the paper's OGBench datasets {DATASETS}; "
                             "bench/plot_protocol.py reads BoxPick evaluations")
    return evaluations


def table4(evaluations):
    """One row per dataset: FlexLoop's depth and success at its calibrated threshold (the mean over the 5 tasks),
    IRU-5's and the control's full-depth success, FlexLoop's own full depth, and IRU-5 and FlexLoop per task."""
    rows = []
    for dataset in DATASETS:
        flexloop, iru, control = (evaluations.get((dataset, model), []) for model in (FLEXLOOP, IRU, CONTROL))
        if not flexloop or not iru:
            continue
        calibrated = [entry["calibration"]["results"]["mean"] for entry in flexloop]
        rows.append({
            "dataset": dataset, "seeds": len(flexloop),
            "flexloop_depth": mean_std([point["mean_depth"] for point in calibrated]),
            "flexloop_success": mean_std([point["success"] for point in calibrated]),
            "flexloop_eps": [entry["calibration"]["eps"] for entry in flexloop],
            "iru_success": mean_std([entry["elasticity"]["mean"][-1] for entry in iru]),
            "flexloop_full_depth": mean_std([entry["elasticity"]["mean"][-1] for entry in flexloop]),
            "control_full_depth": mean_std([entry["elasticity"]["mean"][-1] for entry in control]) if control else None,
            "per_task": {task: {"iru_success": mean_std([entry["elasticity"][task][-1] for entry in iru]),
                                "flexloop_success": mean_std([entry["calibration"]["results"][task]["success"]
                                                              for entry in flexloop])} for task in TASKS},
            "paper": PAPER_TABLE4[dataset], "ogbench_gciql": OGBENCH_GCIQL[dataset],
        })
    return rows


def table2(rows):
    """The paper's Table 2 OGBench row: the mean over the five datasets of each dataset's mean over seeds. None
    until all five are in."""
    if len(rows) < len(DATASETS):
        return None
    result = {key: float(np.mean([row[key][0] for row in rows]))
              for key in ("flexloop_depth", "flexloop_success", "iru_success")}
    return {**result, "paper": PAPER_TABLE2}


def short(dataset):
    return dataset.removesuffix("-v0")


MODELS = ((IRU, "tab:gray"), (FLEXLOOP, "tab:blue"), (CONTROL, "tab:orange"))


def dataset_panels(evaluations, datasets, out, draw, xlabel):
    """One panel per dataset, and in it draw(ax, model, entries, color, label) for each model evaluated on it."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(datasets), figsize=(3.6 * len(datasets), 3.4), squeeze=False)
    for ax, dataset in zip(axes[0], datasets):
        for model, color in MODELS:
            entries = evaluations.get((dataset, model), [])
            if entries:
                seeds = f"{len(entries)} seed" + ("s" if len(entries) > 1 else "")
                draw(ax, model, entries, color, f"{model} ({seeds})")
        # success on [0, 1] in every panel, so that panels compare and the legend finds room above the curves
        ax.set(title=short(dataset), xlabel=xlabel, ylabel="success", ylim=(-0.02, 1.02))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def elasticity_figure(evaluations, datasets, out):
    """Success at each fixed depth (the mean over tasks), per dataset and model, mean +- std over seeds."""
    def draw(ax, model, entries, color, label):
        success = np.array([entry["elasticity"]["mean"] for entry in entries])
        ax.errorbar(np.arange(1, success.shape[1] + 1), success.mean(0), marker="o", capsize=3, color=color,
                    yerr=success.std(0, ddof=1) if len(entries) > 1 else None, label=label)
    dataset_panels(evaluations, datasets, out, draw, "depth")


def pareto_figure(evaluations, datasets, out):
    """Success against mean depth over the epsilon grid (the mean over tasks), per dataset, mean over seeds, with
    the paper's FlexLoop point."""
    def draw(ax, model, entries, color, label):
        depth = np.mean([[point["mean_depth"] for point in entry["adaptive"]["mean"]] for entry in entries], 0)
        success = np.mean([[point["success"] for point in entry["adaptive"]["mean"]] for entry in entries], 0)
        ax.plot(depth, success, "o-", color=color, label=label)
        if model == FLEXLOOP:  # the paper's point beside ours
            (paper_depth, _), (paper_success, _), _ = PAPER_TABLE4[entries[0]["env_id"]]
            ax.plot(paper_depth, paper_success, "k*", markersize=10, label="paper: FlexLoop")
    dataset_panels(evaluations, datasets, out, draw, "mean depth")


def traces(evaluations, dataset):
    """FlexLoop's traced episodes on a dataset that succeeded: [(seed index, task, depths per step)]."""
    found = []
    for seed, entry in enumerate(evaluations.get((dataset, FLEXLOOP), [])):
        for task in TASKS:
            trace = entry.get("trace", {}).get(task)
            if trace and trace["episode_success"] > 0:
                found.append((seed, task, trace["depths"]))
    return found


def depth_trace_figure(evaluations, datasets, out):
    """The paper's Figure 6: the depth FlexLoop stops at, at each step of successful episodes (the first seed's),
    one line per task whose traced episode succeeded."""
    plt = pyplot()
    fig, axes = plt.subplots(len(datasets), 1, figsize=(9, 2.2 * len(datasets)), squeeze=False)
    for ax, dataset in zip(axes[:, 0], datasets):
        episodes = [(task, depths) for seed, task, depths in traces(evaluations, dataset) if seed == 0]
        for task, depths in episodes:
            ax.step(range(len(depths)), depths, where="post", lw=1, label=task)
        ax.set(title=f"{short(dataset)}: FlexLoop's depth per step, successful episodes", xlabel="env step",
               ylabel="depth")
        if not episodes:
            ax.text(0.5, 0.5, "no successful traced episode", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", nargs="+", required=True, help="eval_adaptive.py results.json files")
    parser.add_argument("--out", default=None, help="folder for the figures (none drawn when not given)")
    args = parser.parse_args()
    evaluations = load_evaluations(args.results)
    rows = table4(evaluations)
    if args.out:
        datasets = [row["dataset"] for row in rows]
        if not datasets:
            raise ValueError("no dataset has both an IRU-5 and a FlexLoop evaluation; label them with "
                             "eval_adaptive.py --labels IRU-5 FlexLoop")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        elasticity_figure(evaluations, datasets, Path(args.out) / "ogbench_elasticity.png")
        pareto_figure(evaluations, datasets, Path(args.out) / "ogbench_pareto.png")
        depth_trace_figure(evaluations, datasets, Path(args.out) / "ogbench_depth_traces.png")
    print(json.dumps({"table4": rows, "table2": table2(rows)}, indent=1))


if __name__ == "__main__":
    main()
