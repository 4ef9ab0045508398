"""bench/plot_protocol.py: the aggregation behind the BoxPick results page (Table 4 rows, Table 2 rows)."""
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_protocol", ROOT / "bench" / "plot_protocol.py")
plot_protocol = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_protocol)

EPS = [0.0, 0.01, 0.02]


def entry(label, env_id, full_depth, adaptive, calibrated_eps=0.01):
    """One evaluated checkpoint as eval_adaptive.py writes it; adaptive: {split: [(success, mean depth) per eps]}."""
    points = {split: [{"eps": eps, "success": s, "mean_depth": d} for eps, (s, d) in zip(EPS, adaptive[split])]
              for split in adaptive}
    return {"label": label, "env_id": env_id, "eps_grid": EPS,
            "elasticity": {split: [0.0, 0.0, 0.0, 0.0, full_depth[split]] for split in full_depth},
            "adaptive": points,
            "calibration": {"eps": calibrated_eps, "results": {split: points[split][EPS.index(calibrated_eps)]
                                                              for split in points}}}


def write(tmp_path, name, entries):
    path = tmp_path / f"{name}.results.json"
    path.write_text(json.dumps({"checkpoints": entries}))
    return path


def variant_files(tmp_path, env_id, flexloop_success):
    adaptive = {"train": [(1.0, 5.0), (flexloop_success, 4.0), (0.5, 3.0)],
                "unseen": [(0.8, 5.0), (0.79, 4.5), (0.7, 3.5)]}
    return [write(tmp_path, f"{env_id}-{seed}", [
        entry("IRU-5-5M", env_id, {"train": 0.9, "unseen": 0.6}, adaptive),
        entry("FlexLoop-5M+1M", env_id, {"train": 1.0, "unseen": 0.8}, adaptive)]) for seed in (1, 2)]


def test_table4_reads_the_train_calibrated_point_and_averages_seeds(tmp_path):
    files = variant_files(tmp_path, "BoxPick-Exact-4-v0", 0.98)
    rows = plot_protocol.table4(plot_protocol.load_evaluations(files), retain=0.99)
    train = next(row for row in rows if row["split"] == "train")
    assert train["seeds"] == 2
    assert train["flexloop_success"] == (pytest.approx(0.98), 0.0)
    assert train["flexloop_depth"] == (pytest.approx(4.0), 0.0)
    assert train["iru_success"][0] == pytest.approx(0.9)
    assert train["control_full_depth"] is None


def test_per_split_calibration_takes_the_shallowest_point_that_keeps_the_floor():
    adaptive = {"unseen": [(0.8, 5.0), (0.795, 4.5), (0.7, 3.5)]}
    e = entry("FlexLoop", "BoxPick-Exact-4-v0", {"unseen": 0.8}, adaptive)
    assert plot_protocol.per_split_calibration(e, "unseen", retain=0.99)["mean_depth"] == 4.5  # 0.795 >= 0.792
    assert plot_protocol.per_split_calibration(e, "unseen", retain=0.999)["mean_depth"] == 5.0


def test_table2_is_the_mean_over_the_four_variants_and_waits_for_all_four(tmp_path):
    successes = dict(zip(plot_protocol.VARIANTS, (0.9, 0.92, 0.94, 0.96)))
    files = [f for env_id, s in successes.items() for f in variant_files(tmp_path, env_id, s)]
    rows = plot_protocol.table4(plot_protocol.load_evaluations(files), retain=0.99)
    assert plot_protocol.table2(rows)["train"]["flexloop_success"] == pytest.approx(0.93)
    three = [row for row in rows if row["env_id"] != "BoxPick-Exact-3-v0"]
    assert plot_protocol.table2(three)["train"] is None


def test_sample_std_over_seeds():
    assert plot_protocol.mean_std([1.0, 3.0]) == (2.0, pytest.approx(2 ** 0.5))
    assert plot_protocol.mean_std([1.0]) == (1.0, 0.0)


def test_an_unknown_label_names_the_fix(tmp_path):
    path = write(tmp_path, "odd", [entry("mine", "BoxPick-Exact-4-v0", {"train": 1.0}, {"train": [(1, 5)] * 3})])
    with pytest.raises(ValueError, match="--labels"):
        plot_protocol.load_evaluations([path])
