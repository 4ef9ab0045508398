"""Mean ± std over seeds of eval_adaptive.py results, as the README's markdown tables: success at each fixed depth,
then adaptive success and mean depth at the calibrated eps (and at --eps, if given), per checkpoint label and split.

    python bench/seed_table.py results/exact4_ref_s{1,2,3}/results.json
    python bench/seed_table.py results/exact4_ref_s{1,2,3}/results.json --eps 0.05

Each file is one seed's `eval_adaptive.py --checkpoints A B C --labels ...` run; the files must share the labels.
The std is the sample standard deviation (n - 1), as in the README's tables.
"""

import argparse
import json
import statistics


def mean_std(values):
    values = list(values)
    mean = statistics.fmean(values)
    return f"{mean:.3f} ± {statistics.stdev(values):.3f}" if len(values) > 1 else f"{mean:.3f}"


def load(paths):
    """{label: [that label's checkpoint entry from each file]}, in the first file's order."""
    by_label = {}
    for path in paths:
        with open(path) as file:
            checkpoints = json.load(file)["checkpoints"]
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


def table(by_label, eps=None):
    depth = len(next(iter(by_label.values()))[0]["elasticity"]["train"])
    header = ["model", "split"] + [f"depth {k}" for k in range(1, depth + 1)] + ["adaptive at calibrated eps"]
    if eps is not None:
        header.append(f"adaptive at eps = {eps}")
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
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", help="results.json of eval_adaptive.py, one per seed")
    parser.add_argument("--eps", type=float, help="also report adaptive success at this eps of the grid")
    cli = parser.parse_args()
    print(f"{len(cli.results)} seeds: " + ", ".join(cli.results))
    print(table(load(cli.results), cli.eps))
