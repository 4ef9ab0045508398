"""The evaluations a run logged during training, as a markdown table: success at each depth at each evaluated step
(GC-IQL: the mean over the dataset's tasks; GC-DQN and GC-PPO: the train and unseen splits), and optionally one
task's successes and a loss logged at that step. The in-training tables of docs/results/ are printed this way.

    python bench/training_evals.py checkpoints/<run>/metrics.jsonl
    python bench/training_evals.py checkpoints/<run>/metrics.jsonl --task 3 --loss losses/critic_loss

A row's step is the run's global_step: updates for GC-IQL, env steps for GC-DQN and GC-PPO. A background
evaluation (GC-IQL's --eval-in-background) is logged after the step it evaluated; its row is that step, and so is
the loss it is shown with (the logged value nearest to it).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plot_parity import evaluations, panels_of, read_records  # noqa: E402


def step_label(step):
    if step % 1_000_000 == 0:
        return f"{step // 1_000_000}M"
    if step % 1_000 == 0:
        return f"{step // 1_000}k"
    return f"{step:,}"


def depths_of(record, prefix):
    return sorted(int(key[len(prefix):]) for key in record if key.startswith(prefix) and key[len(prefix):].isdigit())


def successes(record, prefix):
    return " / ".join(f"{record[prefix + str(k)]:.3f}" for k in depths_of(record, prefix))


def nearest_logged(records, key, step):
    """The value of `key` in the record, of those that log it, whose global_step is nearest to `step`."""
    return min((r for r in records if key in r), key=lambda r: abs(r["global_step"] - step))[key]


def table(path, task=None, loss=None):
    records = read_records(path)
    evals = evaluations(records)
    if not evals:
        raise SystemExit(f"{path} holds no evaluation yet (no success_depth_<k> record)")
    panels = panels_of({path: evals})
    task_prefix = f"eval/task_{task}/success_depth_"
    if task is not None and not depths_of(evals[0], task_prefix):
        raise SystemExit(f"{path} logs no success for task {task}: GC-IQL runs log eval/task_<t>/success_depth_<k> "
                         f"for t = 1..5; drop --task for other runs")
    if loss is not None and not any(loss in r for r in records):
        raise SystemExit(f"{path} logs no {loss}; its losses: "
                         f"{sorted({key for r in records for key in r if key.startswith('losses/')})}")
    header = ["step"] + [f"{name}, depths 1-K" if name != "all" else "depths 1-K" for name in panels]
    header += [f"task {task}, depths 1-K"] if task is not None else []
    header += [loss] if loss is not None else []
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for record in evals:
        row = [step_label(record["global_step"])] + [successes(record, prefix) for prefix in panels.values()]
        row += [successes(record, task_prefix)] if task is not None else []
        row += [f"{nearest_logged(records, loss, record['global_step']):.3g}"] if loss is not None else []
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", help="a run's metrics.jsonl")
    parser.add_argument("--task", type=int, help="also one task's success at each depth (GC-IQL runs)")
    parser.add_argument("--loss", help="also this logged value at each evaluated step, e.g. losses/critic_loss")
    cli = parser.parse_args()
    print(table(cli.metrics, cli.task, cli.loss))


if __name__ == "__main__":
    main()
