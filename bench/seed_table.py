"""Mean ± std over seeds of eval_adaptive.py results, as the markdown tables of docs/results/: success at each
fixed depth, then adaptive success and mean depth at the calibrated eps (and at --eps, if given), per checkpoint
label and split, and each seed's mean depth at matched success (the first label's full-depth success less one
standard error).

    python bench/seed_table.py results/exact4_ref_s{1,2,3}/results.json
    python bench/seed_table.py results/exact4_ref_s{1,2,3}/results.json --eps 0.05
    # a checkpoint evaluated later beside the ones evaluated before, per seed: join the files with +
    D=docs/results/data/eval_adaptive_exact4_ref_5m
    python bench/seed_table.py ${D}_seed1.results.json+${D}_lambda0_1m_seed1.results.json ...
    # also draw the mean ± std success at each fixed depth of some labels, in that order
    python bench/seed_table.py ... --plot elasticity.png --plot-labels IRU-5 Self-TD-Only-1M FlexLoop-1M

Each argument is one seed's `eval_adaptive.py --checkpoints A B C --labels ...` run, or several runs of one seed
joined with + when they evaluated the same episodes (the same --seed, env, envs per split and eps grid); the seeds
must share the labels. The std is the sample standard deviation (n - 1), as in the paper's tables.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from eval_adaptive import matched_success  # noqa: E402

SAME_EPISODES = ("env_id", "depth", "k_min", "eps_grid", "episodes")  # what joined runs of one seed must share


def mean_std(values):
    values = list(values)
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def seed_checkpoints(spec):
    """The checkpoint entries of one seed: one results.json, or several joined with + (in that order), which must
    have evaluated the same episodes, so that their numbers compare as if one command had made them."""
    checkpoints, first = [], None
    for path in str(spec).split("+"):
        with open(path) as file:
            results = json.load(file)
        for checkpoint in results["checkpoints"]:
            episodes = (results.get("args", {}).get("seed"), *(checkpoint.get(key) for key in SAME_EPISODES))
            first = first or (path, episodes)
            if episodes != first[1]:
                raise SystemExit(f"{path} ({checkpoint['label']}) did not evaluate the episodes {first[0]} did (eval "
                                 f"seed, {', '.join(SAME_EPISODES)}: {episodes} against {first[1]}); join only "
                                 "eval_adaptive.py runs of one seed with the same --seed, env and --num-eval-envs")
            checkpoints.append(checkpoint)
    labels = [c["label"] for c in checkpoints]
    if len(set(labels)) < len(labels):
        raise SystemExit(f"{spec} joins checkpoints with the same label ({labels}); give them distinct --labels")
    return checkpoints


def load(paths):
    """{label: [that label's checkpoint entry from each seed]}, in the first seed's order."""
    by_label = {}
    for path in paths:
        checkpoints = seed_checkpoints(path)
        labels = [c["label"] for c in checkpoints]
        if by_label and labels != list(by_label):
            raise SystemExit(f"{path} has the labels {labels}, the first file {list(by_label)}: pass results of the "
                             "same eval_adaptive.py command, one per seed")
        for checkpoint in checkpoints:
            by_label.setdefault(checkpoint["label"], []).append(checkpoint)
    return by_label


def at_eps(checkpoint, split, eps):
    for point in checkpoint["adaptive"][split]:
        if abs(point["eps"] - eps) < 1e-12:
            return point
    raise SystemExit(f"eps {eps} is not in the grid of {checkpoint['label']} "
                     f"({[p['eps'] for p in checkpoint['adaptive'][split]]}); pick one of those")


def matched_depths(by_label):
    """{(label, split): "d1 / d2 / ..."}: per seed, the mean depth at matched success against the first label."""
    labels = list(by_label)
    num_seeds = len(by_label[labels[0]])
    per_seed = [matched_success([by_label[label][seed] for label in labels]) for seed in range(num_seeds)]
    cells = {}
    for rows in per_seed:
        for row in rows:
            depth = "not reached" if row["mean_depth"] is None else f"{row['mean_depth']:.2f}"
            cells.setdefault((row["label"], row["split"]), []).append(depth)
    return {key: " / ".join(depths) for key, depths in cells.items()}


def table(by_label, eps=None):
    depth = len(next(iter(by_label.values()))[0]["elasticity"]["train"])
    header = ["model", "split"] + [f"depth {k}" for k in range(1, depth + 1)] + ["adaptive at calibrated eps"]
    if eps is not None:
        header.append(f"adaptive at eps = {eps}")
    header.append(f"mean depth at matched success ({next(iter(by_label))}), per seed")
    matched = matched_depths(by_label)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for split in ["train", "unseen"]:
        for label, runs in by_label.items():
            cells = [label, split]
            cells += [mean_std(run["elasticity"][split][k] for run in runs) for k in range(depth)]
            calibrated = [run["calibration"]["results"][split] for run in runs]
            eps_values = sorted({c["eps"] for c in calibrated})
            cells.append(f"{mean_std(c['success'] for c in calibrated)} at "
                         f"{mean_std(c['mean_depth'] for c in calibrated)} (eps {', '.join(map(str, eps_values))})")
            if eps is not None:
                points = [at_eps(run, split, eps) for run in runs]
                cells.append(f"{mean_std(p['success'] for p in points)} at {mean_std(p['mean_depth'] for p in points)}")
            cells.append(matched[(label, split)])
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_elasticity(by_label, labels, out, title=None):
    """Success at each fixed depth, mean over seeds with sample-std error bars, one panel per split."""
    unknown = [label for label in labels if label not in by_label]
    if unknown:
        raise SystemExit(f"--plot-labels {unknown} are not in the results; the labels are {list(by_label)}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.3))
    for ax, split in zip(axes, ["train", "unseen"]):
        for label in labels:
            per_depth = list(zip(*(run["elasticity"][split] for run in by_label[label])))  # (K, seeds)
            means = [statistics.fmean(values) for values in per_depth]
            stds = [statistics.stdev(values) if len(values) > 1 else 0.0 for values in per_depth]
            ax.errorbar(range(1, len(means) + 1), means, yerr=stds, marker="o", capsize=3, label=label)
        ax.set(title=f"{split} tasks", xlabel="depth k", ylabel="success", ylim=(-0.03, 1.03))
        ax.set_xticks(range(1, len(means) + 1))
        ax.grid(alpha=0.3)
    num_seeds = len(by_label[labels[0]])
    # Long labels wrap onto two columns rather than run off the figure's edges.
    columns = len(labels) if sum(len(label) for label in labels) <= 70 else 2
    rows = -(-len(labels) // columns)
    fig.set_figheight(3.3 + 0.25 * (rows - 1))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=columns, frameon=False)
    over = f"mean ± std of {num_seeds} seeds" if num_seeds > 1 else "one seed"
    fig.suptitle(title or f"{by_label[labels[0]][0]['env_id']}: success at each fixed depth, {over}")
    fig.tight_layout(rect=(0, 0.08 * rows, 1, 1))
    fig.savefig(out, dpi=150)
    return fig


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of eval_adaptive.py, one per seed (several runs of "
                        "one seed joined with +)")
    parser.add_argument("--eps", type=float, help="also report adaptive success at this eps of the grid")
    parser.add_argument("--plot", help="also draw the success at each fixed depth (mean ± std) to this image")
    parser.add_argument("--plot-labels", nargs="+", help="the labels to draw, in this order (default: all)")
    parser.add_argument("--plot-title", help="the figure's title (default: the env and the number of seeds)")
    cli = parser.parse_args()
    print(f"{len(cli.results)} seeds: " + ", ".join(cli.results))
    by_label = load(cli.results)
    print(table(by_label, cli.eps))
    if cli.plot:
        plot_elasticity(by_label, cli.plot_labels or list(by_label), cli.plot, cli.plot_title)
        print(f"wrote {cli.plot}")
