"""bench/plot_parity.py: every run is drawn however many are given, and a run's cut last line is skipped."""

import importlib.util
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parent.parent


def load_bench(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_run(path, successes, cut_last_line=False):
    with open(path, "w") as f:
        for i, success in enumerate(successes):
            record = {"global_step": (i + 1) * 102400, "phase": "pretrain"}
            for split in ("train", "unseen"):
                record.update({f"eval/{split}/success_depth_{k}": success * k / 3 for k in (1, 2, 3)})
            f.write(json.dumps(record) + "\n")
            f.write(json.dumps({"global_step": (i + 1) * 102400, "losses/td_loss": 1.0}) + "\n")  # not an eval
        if cut_last_line:
            f.write('{"global_step": 999, "eval/train/succ')


def test_plot_parity_draws_every_run_and_skips_a_cut_line(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    plot_parity = load_bench("plot_parity")
    paths = []
    for run in range(6):  # more runs than line styles
        paths.append(tmp_path / f"run{run}.jsonl")
        write_run(paths[-1], [0.1 * run, 0.2 * run], cut_last_line=run == 5)
    assert len(plot_parity.eval_records(paths[5])) == 2
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda figure, out, **kwargs: saved.update(figure=figure, out=out))
    monkeypatch.setattr(sys, "argv", ["plot_parity.py", "--runs", *map(str, paths), "--labels",
                                      *[f"run {i}" for i in range(6)], "--paper", "0.9", "0.5",
                                      "--out", str(tmp_path / "parity.png")])
    plot_parity.main()
    train, unseen = saved["figure"].axes
    assert len(train.lines) == 6 * 3 + 1 and len(unseen.lines) == 6 * 3 + 1  # 6 runs x 3 depths, the paper's line
    assert list(train.lines[-2].get_ydata()) == [0.5, 1.0]  # run 5, depth 3: both evaluations, the cut line skipped
    plt.close("all")


def test_plot_parity_draws_only_the_depths_asked_for_one_colour_per_run(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt
    plot_parity = load_bench("plot_parity")
    paths = [tmp_path / f"run{run}.jsonl" for run in range(2)]
    for run, path in enumerate(paths):
        write_run(path, [0.3 * (run + 1), 0.6])
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda figure, out, **kwargs: saved.update(figure=figure, out=out))
    monkeypatch.setattr(sys, "argv", ["plot_parity.py", "--runs", *map(str, paths), "--labels", "a", "b",
                                      "--depths", "3", "--out", str(tmp_path / "full_depth.png")])
    plot_parity.main()
    train, _ = saved["figure"].axes
    assert [list(line.get_ydata()) for line in train.lines] == [[0.3, 0.6], [0.6, 0.6]]  # depth 3 of each run
    assert train.lines[0].get_color() != train.lines[1].get_color()
    plt.close("all")
