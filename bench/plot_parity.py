"""Per-depth success curves of one or more runs from their metrics.jsonl: the learning-parity figure that a change
to GC-DQN's numerics must pass (runs with the same seed and protocol overlaid), and the learning curves
of long runs beside the paper's final values (--paper).

    python bench/plot_parity.py --runs runs/old/metrics.jsonl runs/new/metrics.jsonl --labels before after \
        --out docs/figures/gcdqn_parity.png

With --depths 5 only depth 5 is drawn and each run gets its own colour: many runs of one setting side by side.
GC-IQL runs log one success per depth over the dataset's five tasks (eval/success_depth_<k>), drawn in one panel:

    python bench/plot_parity.py --runs tf32/metrics.jsonl bf16/metrics.jsonl --labels TF32 bf16 --updates-per-step 1 \
        --episodes 250 --out docs/figures/gciql_bf16_parity.png
"""

import argparse
import itertools
import json
import math
import textwrap

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


SPLIT_PREFIXES = {"train": "eval/train/success_depth_", "unseen": "eval/unseen/success_depth_"}  # GC-DQN, GC-PPO
ALL_TASKS_PREFIX = {"all": "eval/success_depth_"}  # GC-IQL: the mean over the dataset's tasks


def read_records(path):
    """Every record of a metrics.jsonl; a killed run may leave its last line cut short, which is skipped."""
    records = []
    for line in open(path):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def evaluations(records):
    """The records that hold an evaluation, each at the step it evaluated."""
    evals = []
    for record in records:
        if any(key.startswith(prefix) for key in record
               for prefix in (*SPLIT_PREFIXES.values(), *ALL_TASKS_PREFIX.values())):
            if "charts/evaluated_step" in record:  # GC-IQL's --eval-in-background: logged after the step it
                record = {**record, "global_step": record["charts/evaluated_step"]}  # evaluated
            evals.append(record)
    return evals


def eval_records(path):
    return evaluations(read_records(path))


def panels_of(runs):
    """{panel title: the success key's prefix}: the train and unseen splits, or GC-IQL's one mean over tasks."""
    first = next(iter(runs.values()))[0]
    return SPLIT_PREFIXES if any(key.startswith(SPLIT_PREFIXES["train"]) for key in first) else ALL_TASKS_PREFIX


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", required=True, help="metrics.jsonl of each run")
    parser.add_argument("--labels", nargs="+", required=True)
    parser.add_argument("--updates-per-step", type=float, default=1000 / (1024 * 100),
                        help="updates per global_step (env step); GC-DQN's default: 1,000 updates per 102,400 steps")
    parser.add_argument("--env-steps", action="store_true",
                        help="x axis in millions of env steps (GC-PPO runs) instead of thousands of updates")
    parser.add_argument("--episodes", default="1,024", help="episodes per split of the runs' evaluations (y label)")
    parser.add_argument("--paper", type=float, nargs=2, metavar=("TRAIN", "UNSEEN"),
                        help="the paper's full-depth success on each split, drawn as dashed lines")
    parser.add_argument("--depths", type=int, nargs="+", help="draw only these depths (default: all)")
    parser.add_argument("--title", default="")
    parser.add_argument("--out", required=True)
    cli = parser.parse_args()
    if len(cli.labels) != len(cli.runs):
        parser.error(f"give one --labels entry per --runs file: {len(cli.runs)} runs, {len(cli.labels)} labels")
    runs = {label: eval_records(path) for label, path in zip(cli.labels, cli.runs)}
    for label, path in zip(cli.labels, cli.runs):
        if not runs[label]:
            parser.error(f"{path} holds no evaluation yet (no success_depth_<k> record)")
    panels = panels_of(runs)
    depth = max(int(key.rsplit("_", 1)[1]) for records in runs.values() for key in records[0]
                if any(key.startswith(prefix) for prefix in panels.values()))
    figure, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels) + 0.5 * (len(panels) == 1), 4),
                                sharey=True, squeeze=False)
    axes = axes[0]
    styles = ["-", "--", ":", "-."]
    markers = ["o", "s", "^", "v", "D", "P"]  # with the line styles, up to 12 runs look different
    depths = cli.depths or range(1, depth + 1)
    one_depth = len(depths) == 1  # then colour tells the runs apart, not the depths
    colours = plt.cm.viridis([k / max(1, depth - 1) for k in range(depth)])
    for axis, (split, prefix) in zip(axes, panels.items()):
        for run, ((label, records), style, marker) in enumerate(zip(runs.items(), itertools.cycle(styles),
                                                                    itertools.cycle(markers))):
            x = [r["global_step"] / 1e6 if cli.env_steps else r["global_step"] * cli.updates_per_step / 1000
                 for r in records]
            for k in depths:
                labelled = one_depth or cli.depths or k in (depth - 1, depth)  # default: label the top two
                axis.plot(x, [r[f"{prefix}{k}"] for r in records], style, marker=marker,
                          markersize=3, color=plt.cm.tab10(run % 10) if one_depth else colours[k - 1],
                          label=f"{label}, depth {k}" if labelled else None)
        if cli.paper:
            axis.axhline(cli.paper[split == "unseen"], color="black", linestyle="--", linewidth=1,
                         label="paper, full depth" if axis is axes[-1] else None)
        axis.set_xlabel("env steps (millions)" if cli.env_steps else "updates (thousands)")
        axis.set_title(f"{split} tasks")
        axis.grid(alpha=0.3)
    axes[0].set_ylabel(f"success ({cli.episodes} episodes)")
    # Below the axes, not inside one: long runs fill every corner of the unseen panel.
    handles, labels = axes[-1].get_legend_handles_labels()
    legend_rows = math.ceil(len(labels) / 3)
    figure.set_figheight(4 + 0.2 * legend_rows)
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False, handlelength=4,
                  markerscale=1.8)  # long handles and large markers: line style and marker tell the runs apart
    title = cli.title or "per-depth success, same seed and protocol (colour: depth, line style and marker: run)"
    figure.suptitle(textwrap.fill(title, 60 * len(panels)))  # one panel: two lines, not cut off
    figure.tight_layout(rect=(0, 0.2 * legend_rows / figure.get_figheight() + 0.01, 1, 1))
    figure.savefig(cli.out, dpi=120)
    print(json.dumps({"out": cli.out, "runs": {label: len(records) for label, records in runs.items()}}))


if __name__ == "__main__":
    main()
