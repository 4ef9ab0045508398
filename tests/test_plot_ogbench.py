"""bench/plot_ogbench.py: the aggregation behind the OGBench results page (Table 4's rows, Table 2's row, Figure 6)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_ogbench", ROOT / "bench" / "plot_ogbench.py")
plot_ogbench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_ogbench)

EPS = [0.0, 0.01, 0.02]
TASKS = plot_ogbench.TASKS


def entry(label, dataset, task_success, calibrated=(0.4, 3.5), traced_success=1.0):
    """One evaluated checkpoint as eval_adaptive.py writes it on OGBench: every task, their mean, calibration on
    the mean. task_success: full-depth success per task; calibrated: (success, mean depth) of the mean at eps 0.01."""
    mean_full = sum(task_success) / len(task_success)
    elasticity = {task: [0.0, 0.0, 0.1, 0.2, s] for task, s in zip(TASKS, task_success)}
    elasticity["mean"] = [0.0, 0.0, 0.1, 0.2, mean_full]
    points = [{"eps": 0.0, "success": mean_full, "mean_depth": 5.0},
              {"eps": 0.01, "success": calibrated[0], "mean_depth": calibrated[1]},
              {"eps": 0.02, "success": 0.1, "mean_depth": 2.0}]
    adaptive = {group: points for group in (*TASKS, "mean")}
    results = {task: {"eps": 0.01, "success": s / 2, "mean_depth": 4.0} for task, s in zip(TASKS, task_success)}
    results["mean"] = points[1]
    trace = {task: {"eps": 0.01, "depths": [5, 4, 3, 3, 2], "episode_success": traced_success} for task in TASKS}
    return {"label": label, "env_id": dataset, "eps_grid": EPS, "elasticity": elasticity, "adaptive": adaptive,
            "calibration": {"eps": 0.01, "results": results}, "trace": trace}


def write(tmp_path, name, entries):
    path = tmp_path / f"{name}.results.json"
    path.write_text(json.dumps({"checkpoints": entries}))
    return path


def dataset_files(tmp_path, dataset, flexloop_success=(0.4, 0.5)):
    return [write(tmp_path, f"{dataset}-{seed}", [
        entry("IRU-5", dataset, [0.2, 0.4, 0.6, 0.0, 1.0]),
        entry("FlexLoop", dataset, [0.2, 0.4, 0.6, 0.2, 1.0], calibrated=(success, 3.0 + seed)),
        entry("Self-TD-Only", dataset, [0.0, 0.4, 0.6, 0.0, 1.0])]) for seed, success in enumerate(flexloop_success)]


def test_table4_reads_the_mean_over_tasks_at_the_calibrated_threshold_and_averages_seeds(tmp_path):
    evaluations = plot_ogbench.load_evaluations(dataset_files(tmp_path, "scene-play-v0"))
    [row] = plot_ogbench.table4(evaluations)
    assert row["seeds"] == 2
    assert row["flexloop_success"] == pytest.approx((0.45, 0.0707107), abs=1e-6)  # sample std over 2 seeds
    assert row["flexloop_depth"] == pytest.approx((3.5, 0.7071068), abs=1e-6)
    assert row["iru_success"] == pytest.approx((0.44, 0.0))  # full depth, mean over the 5 tasks
    assert row["flexloop_full_depth"][0] == pytest.approx(0.48)
    assert row["control_full_depth"][0] == pytest.approx(0.4)  # the lambda = 0 control
    assert row["per_task"]["task4"]["iru_success"][0] == 0.0
    assert row["per_task"]["task4"]["flexloop_success"][0] == pytest.approx(0.1)
    assert row["paper"] == plot_ogbench.PAPER_TABLE4["scene-play-v0"]


def test_table2_is_the_mean_over_the_five_datasets_and_waits_for_all_five(tmp_path):
    files = [path for dataset in plot_ogbench.DATASETS[:4] for path in dataset_files(tmp_path, dataset)]
    rows = plot_ogbench.table4(plot_ogbench.load_evaluations(files))
    assert len(rows) == 4 and plot_ogbench.table2(rows) is None
    files += dataset_files(tmp_path, plot_ogbench.DATASETS[4], flexloop_success=(0.9, 0.9))
    table2 = plot_ogbench.table2(plot_ogbench.table4(plot_ogbench.load_evaluations(files)))
    assert table2["flexloop_success"] == pytest.approx((4 * 0.45 + 0.9) / 5)
    assert table2["iru_success"] == pytest.approx(0.44)
    assert table2["paper"] == plot_ogbench.PAPER_TABLE2


def test_a_dataset_outside_the_papers_five_names_the_fix(tmp_path):
    path = write(tmp_path, "giant", [entry("IRU-5", "pointmaze-giant-stitch-v0", [0.1] * 5)])
    with pytest.raises(ValueError, match="plot_protocol.py reads BoxPick"):
        plot_ogbench.load_evaluations([path])


def test_figure_6_draws_only_episodes_that_succeeded(tmp_path):
    files = dataset_files(tmp_path, "pointmaze-large-stitch-v0")
    failed = write(tmp_path, "antmaze", [entry("IRU-5", "antmaze-medium-stitch-v0", [0.0] * 5),
                                         entry("FlexLoop", "antmaze-medium-stitch-v0", [0.0] * 5, traced_success=0.0)])
    evaluations = plot_ogbench.load_evaluations([*files, failed])
    assert len(plot_ogbench.traces(evaluations, "pointmaze-large-stitch-v0")) == 10  # 5 tasks x 2 seeds
    assert plot_ogbench.traces(evaluations, "antmaze-medium-stitch-v0") == []
    import matplotlib.pyplot as plt
    datasets = ["antmaze-medium-stitch-v0", "pointmaze-large-stitch-v0"]
    plot_ogbench.depth_trace_figure(evaluations, datasets, tmp_path / "traces.png")
    plot_ogbench.pareto_figure(evaluations, datasets, tmp_path / "pareto.png")
    plot_ogbench.elasticity_figure(evaluations, datasets, tmp_path / "elasticity.png")
    for name in ("traces.png", "pareto.png", "elasticity.png"):
        assert (tmp_path / name).stat().st_size > 5000
    plt.close("all")



def test_the_labels_reproduce_py_gives_ogbench_and_boxpick_evaluations_are_ones_the_reports_read():
    import sys
    sys.path.insert(0, str(ROOT))
    import studies
    for name, study in studies.STUDIES.items():
        if not name.startswith(("ogbench-", "boxpick-")):
            continue
        models = []
        for run in study.runs:
            if run.kind != "eval":
                continue
            command = list(run.command)
            labels = command[command.index("--labels") + 1:]
            labels = labels[:next((i for i, flag in enumerate(labels) if flag.startswith("--")), len(labels))]
            models += [plot_ogbench.plot_protocol.model_of(label) for label in labels]  # raises on an unread label
        assert models == ["IRU-5", "FlexLoop", "Self-TD-Only"], name
