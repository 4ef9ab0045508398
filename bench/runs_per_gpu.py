"""Several copies of one bench at once on one GPU: each copy's rate and their sum, against one copy alone in the
same run. It answers how many runs of a script a GPU should hold (under CUDA MPS when its daemon is up).

    nvidia-cuda-mps-control -d      # optional: with MPS the copies' kernels run side by side
    python bench/runs_per_gpu.py --copies 1 2 3 --key updates_per_second -- \\
        python bench/iql_throughput.py --modes compile-streams-graph --eval-episodes 0 --updates 10000

For each N in --copies, N copies start together and wait for each other to finish. From each copy, the values of
--key in its JSON lines, in order (a bench may print several measurements); the copies' values are summed line
by line. The copies compile at the same time, so their timed parts overlap; make those long (--updates, say) so
that the few seconds where they do not matter little. Prints one JSON line per N.
"""

import argparse
import json
import subprocess
import sys


def values_of(stdout, key):
    """The values of `key` in a bench's JSON lines, in order; other lines are skipped."""
    values = []
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and key in record:
            values.append(record[key])
    return values


def run_copies(command, copies, key):
    """The values of `key` from each of `copies` copies of `command`, started together."""
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(copies)]
    outputs = [process.communicate() for process in processes]
    per_copy = []
    for process, (stdout, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            raise SystemExit(f"error: a copy of {' '.join(command)} exited with {process.returncode}:\n"
                             f"{stderr[-2000:]}")
        values = values_of(stdout, key)
        if not values:
            raise SystemExit(f"error: a copy of {' '.join(command)} printed no JSON line with {key!r}; pass the "
                             f"--key of its rate (its output began: {stdout[:300]!r})")
        per_copy.append(values)
    if len({len(values) for values in per_copy}) > 1:
        raise SystemExit(f"error: the copies printed different numbers of {key!r} lines: {per_copy}")
    return per_copy


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--copies", type=int, nargs="+", default=[1, 2, 3], help="how many copies at once, in turn")
    parser.add_argument("--key", required=True, help="the rate in the bench's JSON lines, e.g. updates_per_second")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the bench's command line")
    cli = parser.parse_args()
    command = cli.command[1:] if cli.command[:1] == ["--"] else cli.command
    if not command:
        parser.error("give the bench's command after --")
    if any(n < 1 for n in cli.copies):
        parser.error(f"--copies must be >= 1, got {cli.copies}")

    alone = None
    for copies in cli.copies:
        per_copy = run_copies(command, copies, cli.key)
        total = [sum(values) for values in zip(*per_copy)]
        if copies == 1:
            alone = total
        print(json.dumps({"copies": copies, "key": cli.key, "per_copy": per_copy, "total": total,
                          "of_one_alone": [round(t / a, 3) for t, a in zip(total, alone)] if alone else None,
                          "command": " ".join(command)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
