"""bench/plot_parity.py: every run is drawn however many are given, and a run's cut last line is skipped; GC-IQL's
runs (no splits) in one panel.
bench/seed_table.py: the mean and sample std over seeds of eval_adaptive.py results, runs of one seed joined, and
each seed's mean depth at matched success; its figure of the same means.
bench/plot_flexloop_length.py: the seed means of depth and success at each FlexLoop length, and a clear refusal.
bench/runs_per_gpu.py: copies started together, their rates summed line by line against one alone; clear refusals.
bench/iql_seeds.py: an update of N stacked GC-IQL seeds is N separate updates.
bench/profiling.py: the matmul FLOPs of a call, forward and backward, and the rates they make of a profile.
bench/split_gate.py: the IRU with its gates' LayerNorm split over its two halves is the plain one; its bf16 check.
bench/training_evals.py: a run's evaluations during training as a table, a background one at the step it evaluated."""

import importlib.util
import json
import sys
from pathlib import Path

import matplotlib
import pytest

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
    # the legend (run x depths 2 and 3, the paper) sits below both panels, over no data
    (legend,) = saved["figure"].legends
    assert len(legend.get_texts()) == 6 * 2 + 1 and train.get_legend() is None and unseen.get_legend() is None
    saved["figure"].canvas.draw()
    legend_box = legend.get_window_extent()
    assert all(legend_box.y1 <= axis.get_window_extent().y0 for axis in (train, unseen))
    plt.close("all")


def test_plot_parity_places_a_background_evaluation_at_the_step_it_evaluated(tmp_path):
    """GC-IQL's --eval-in-background logs an evaluation later than the update it evaluated, which
    charts/evaluated_step names; blocking evaluations are at their step."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"global_step": 100_000, "eval/success_depth_1": 0.2}) + "\n"
                    + json.dumps({"global_step": 231_000, "charts/evaluated_step": 200_000,
                                  "eval/success_depth_1": 0.4}) + "\n")
    records = load_bench("plot_parity").eval_records(path)
    assert [r["global_step"] for r in records] == [100_000, 200_000]


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


def test_plot_parity_draws_gciql_runs_in_one_panel_and_refuses_mismatched_labels(tmp_path, monkeypatch):
    """GC-IQL logs one success per depth over the dataset's tasks, no splits: one panel, every run and depth."""
    import matplotlib.pyplot as plt
    plot_parity = load_bench("plot_parity")
    paths = [tmp_path / f"iql{run}.jsonl" for run in range(2)]
    for run, path in enumerate(paths):
        with open(path, "w") as f:
            for step in (100_000, 200_000):
                f.write(json.dumps({"global_step": step, "losses/critic_loss": 1.0}) + "\n")
                f.write(json.dumps({"global_step": step, "phase": "pretrain", "eval/task_1/success_depth_2": 1.0,
                                    **{f"eval/success_depth_{k}": 0.1 * k + run * step / 1e6 for k in (1, 2)}})
                        + "\n")
    saved = {}
    monkeypatch.setattr(plt.Figure, "savefig", lambda figure, out, **kwargs: saved.update(figure=figure, out=out))
    monkeypatch.setattr(sys, "argv", ["plot_parity.py", "--runs", *map(str, paths), "--labels", "TF32", "bf16",
                                      "--updates-per-step", "1", "--out", str(tmp_path / "iql.png")])
    plot_parity.main()
    (panel,) = saved["figure"].axes
    assert panel.get_title() == "all tasks"
    assert [list(line.get_xdata()) for line in panel.lines] == [[100.0, 200.0]] * 4  # thousands of updates
    assert list(panel.lines[3].get_ydata()) == pytest.approx([0.3, 0.4])  # bf16, depth 2
    plt.close("all")
    monkeypatch.setattr(sys, "argv", ["plot_parity.py", "--runs", *map(str, paths), "--labels", "TF32",
                                      "--out", str(tmp_path / "iql.png")])
    with pytest.raises(SystemExit):
        plot_parity.main()


def write_eval_adaptive_results(path, labels, full_depth_success, mean_depth, adaptive_success=None, eval_seed=1):
    """A results.json of eval_adaptive.py reduced to what seed_table.py reads: 3 depths, eps grid {0, 0.05}, 1,000
    episodes per split. At eps 0 each checkpoint has its full-depth success at mean depth 3; at eps 0.05,
    adaptive_success (default: the same) at mean_depth."""
    checkpoints = []
    for i, (label, success) in enumerate(zip(labels, full_depth_success)):
        at_005 = success if adaptive_success is None else adaptive_success[i]
        split_results = {split: {"eps": 0.05, "success": at_005, "mean_depth": mean_depth}
                         for split in ("train", "unseen")}
        checkpoints.append({
            "label": label, "env_id": "BoxPick-Exact-4-v0", "depth": 3, "k_min": 1, "eps_grid": [0.0, 0.05],
            "episodes": {"train": 1000, "unseen": 1000},
            "elasticity": {split: [0.0, success / 2, success] for split in ("train", "unseen")},
            "calibration": {"results": split_results},
            "adaptive": {split: [{"eps": 0.0, "success": success, "mean_depth": 3.0, "ideal_speedup": 1.0},
                                 {"eps": 0.05, "success": at_005, "mean_depth": mean_depth,
                                  "ideal_speedup": 3.0 / mean_depth}]
                         for split in ("train", "unseen")}})
    path.write_text(json.dumps({"args": {"seed": eval_seed}, "checkpoints": checkpoints}))


def test_seed_table_gives_mean_and_sample_std_over_the_files(tmp_path):
    seed_table = load_bench("seed_table")
    paths = []
    for seed, (success, depth) in enumerate([(0.90, 2.0), (0.80, 2.5), (0.70, 3.0)]):
        paths.append(tmp_path / f"s{seed}.json")
        write_eval_adaptive_results(paths[-1], ["IRU-5", "FlexLoop"], [0.5, success], depth)
    table = seed_table.table(seed_table.load(paths), eps=0.05)
    flexloop_train = next(line for line in table.splitlines() if line.startswith("| FlexLoop | train"))
    # depth 2 is success / 2: 0.45, 0.40, 0.35 -> mean 0.400, sample std 0.050; depth 3: 0.800 ± 0.100
    assert "| 0.000 ± 0.000 | 0.400 ± 0.050 | 0.800 ± 0.100 |" in flexloop_train
    assert "0.800 ± 0.100 at 2.500 ± 0.500 (eps 0.05)" in flexloop_train  # calibrated
    assert "| 0.800 ± 0.100 at 2.500 ± 0.500 |" in flexloop_train  # at --eps 0.05
    assert sum(line.startswith("| IRU-5 |") for line in table.splitlines()) == 2  # one row per split


def test_seed_table_refuses_files_of_different_commands(tmp_path):
    seed_table = load_bench("seed_table")
    write_eval_adaptive_results(tmp_path / "a.json", ["IRU-5", "FlexLoop"], [0.5, 0.9], 2.0)
    write_eval_adaptive_results(tmp_path / "b.json", ["IRU-5", "Self-TD-Only"], [0.5, 0.9], 2.0)
    with pytest.raises(SystemExit, match="same eval_adaptive.py command"):
        seed_table.load([tmp_path / "a.json", tmp_path / "b.json"])


def test_seed_table_joins_runs_of_one_seed_and_matches_success_against_the_first_label(tmp_path):
    seed_table = load_bench("seed_table")
    paths = []
    # IRU-5 evaluated once (full depth 0.5: the floor is 0.5 - sqrt(0.25 / 1000) = 0.484), FlexLoop later, per seed
    for seed, adaptive in enumerate([0.49, 0.40]):
        write_eval_adaptive_results(tmp_path / f"iru{seed}.json", ["IRU-5"], [0.5], 4.0)
        write_eval_adaptive_results(tmp_path / f"flex{seed}.json", ["FlexLoop"], [0.6], 2.0, adaptive_success=[adaptive])
        paths.append(f"{tmp_path / f'iru{seed}.json'}+{tmp_path / f'flex{seed}.json'}")
    by_label = seed_table.load(paths)
    assert list(by_label) == ["IRU-5", "FlexLoop"] and all(len(runs) == 2 for runs in by_label.values())
    flexloop_unseen = next(line for line in seed_table.table(by_label).splitlines()
                           if line.startswith("| FlexLoop | unseen"))
    # seed 1: 0.49 at eps 0.05 passes the floor, at mean depth 2; seed 2: 0.40 does not, so eps 0 (depth 3) is it
    assert flexloop_unseen.endswith("| 2.00 / 3.00 |")


def test_seed_table_refuses_to_join_other_episodes_or_repeated_labels(tmp_path):
    seed_table = load_bench("seed_table")
    write_eval_adaptive_results(tmp_path / "iru.json", ["IRU-5"], [0.5], 4.0)
    write_eval_adaptive_results(tmp_path / "other_seed.json", ["FlexLoop"], [0.6], 2.0, eval_seed=2)
    with pytest.raises(SystemExit, match="did not evaluate the episodes"):
        seed_table.load([f"{tmp_path / 'iru.json'}+{tmp_path / 'other_seed.json'}"])
    with pytest.raises(SystemExit, match="the same label"):
        seed_table.load([f"{tmp_path / 'iru.json'}+{tmp_path / 'iru.json'}"])


def test_seed_table_plot_draws_the_seed_mean_of_the_labels_asked_for(tmp_path):
    import matplotlib.pyplot as plt
    seed_table = load_bench("seed_table")
    paths = []
    for seed, success in enumerate([0.9, 0.7]):
        paths.append(tmp_path / f"s{seed}.json")
        write_eval_adaptive_results(paths[-1], ["IRU-5", "Self-TD-Only", "FlexLoop"], [0.5, 0.6, success], 2.0)
    by_label = seed_table.load(paths)
    fig = seed_table.plot_elasticity(by_label, ["FlexLoop", "IRU-5"], tmp_path / "elasticity.png")
    assert (tmp_path / "elasticity.png").stat().st_size > 0
    train = fig.axes[0]
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["FlexLoop", "IRU-5"]  # in the order asked
    # FlexLoop's depths are 0, success / 2, success: means 0, 0.4, 0.8 over the two seeds
    assert list(train.lines[0].get_ydata()) == pytest.approx([0.0, 0.4, 0.8])
    assert fig._suptitle.get_text().endswith("mean ± std of 2 seeds")
    one_seed = seed_table.plot_elasticity(seed_table.load(paths[:1]), ["FlexLoop"], tmp_path / "one.png")
    assert one_seed._suptitle.get_text().endswith("one seed")
    with pytest.raises(SystemExit, match="the labels are"):
        seed_table.plot_elasticity(by_label, ["AnyK-TD"], tmp_path / "x.png")
    plt.close("all")


def fake_results(path, rows):
    """An eval_adaptive.py results.json with one checkpoint per (mean depth, success) row, at ε = 0.05 only."""
    checkpoints = [{"label": f"c{i}", "adaptive": {split: [{"eps": 0.05, "mean_depth": depth, "success": success}]
                                                   for split in ("train", "unseen")}}
                   for i, (depth, success) in enumerate(rows)]
    path.write_text(json.dumps({"checkpoints": checkpoints}))
    return str(path)


def test_plot_flexloop_length_gives_the_seed_means_at_each_length(tmp_path, monkeypatch, capsys):
    plot = load_bench("plot_flexloop_length")
    files = [fake_results(tmp_path / "a.json", [(4.4, 0.7), (3.8, 0.8)]),
             fake_results(tmp_path / "b.json", [(4.2, 0.9), (3.6, 0.6)])]
    out = tmp_path / "length.png"
    monkeypatch.setattr(sys, "argv", ["plot", "--results", *files, "--steps", "0", "50", "--out", str(out)])
    plot.main()
    summary = json.loads(capsys.readouterr().out)
    assert summary["train"]["mean_depth"] == pytest.approx([4.3, 3.7])
    assert summary["unseen"]["success"] == pytest.approx([0.8, 0.7])
    assert out.stat().st_size > 0
    monkeypatch.setattr(sys, "argv", ["plot", "--results", *files, "--steps", "0", "--out", str(out)])
    with pytest.raises(SystemExit, match="one length per checkpoint"):
        plot.main()


def run_runs_per_gpu(*args):
    import subprocess
    return subprocess.run([sys.executable, str(ROOT / "bench" / "runs_per_gpu.py"), *args], capture_output=True,
                          text=True, timeout=120)


def test_runs_per_gpu_runs_copies_together_and_sums_their_rates_line_by_line(tmp_path):
    """Each copy appends to a file, sleeps, and reports how many copies had started by then: copies that run
    together see each other. Two JSON lines per copy are summed line by line; a non-JSON line is skipped."""
    started = tmp_path / "started"
    bench = ("import json, time, pathlib; p = pathlib.Path(%r); p.open('a').write('x'); time.sleep(1.0); "
             "n = len(p.read_text()); print('compiling'); print(json.dumps({'rate': 10.0, 'seen': n})); "
             "print(json.dumps({'rate': 4.0}))" % str(started))
    result = run_runs_per_gpu("--copies", "1", "2", "--key", "rate", "--", sys.executable, "-c", bench)
    assert result.returncode == 0, result.stderr
    one, two = [json.loads(line) for line in result.stdout.splitlines()]
    assert one["copies"] == 1 and one["total"] == [10.0, 4.0] and one["of_one_alone"] == [1.0, 1.0]
    assert two["per_copy"] == [[10.0, 4.0], [10.0, 4.0]] and two["total"] == [20.0, 8.0]
    assert two["of_one_alone"] == [2.0, 2.0]
    seen = run_runs_per_gpu("--copies", "3", "--key", "seen", "--", sys.executable, "-c", bench)
    assert json.loads(seen.stdout)["per_copy"] == [[6], [6], [6]]  # 1 + 2 from before, then all 3 at once


def test_runs_per_gpu_refuses_a_missing_key_a_failing_copy_and_no_command():
    missing = run_runs_per_gpu("--copies", "1", "--key", "updates_per_second", "--", sys.executable, "-c",
                             "print('{\"rate\": 1}')")
    assert missing.returncode == 1 and "printed no JSON line with 'updates_per_second'" in missing.stderr
    failing = run_runs_per_gpu("--copies", "2", "--key", "rate", "--", sys.executable, "-c",
                             "import sys; sys.exit('no GPU here')")
    assert failing.returncode == 1 and "exited with 1" in failing.stderr and "no GPU here" in failing.stderr
    empty = run_runs_per_gpu("--key", "rate")
    assert empty.returncode == 2 and "give the bench's command after --" in empty.stderr


def test_seed_table_plot_keeps_long_legends_inside_the_figure(tmp_path):
    import matplotlib.pyplot as plt
    seed_table = load_bench("seed_table")
    labels = ["Self-TD-Only-5M+1M", "FlexLoop-lambda-0.1-5M+1M", "FlexLoop-lambda-0.3-5M+1M", "FlexLoop-5M+1M"]
    write_eval_adaptive_results(tmp_path / "s1.json", labels, [0.6, 0.7, 0.8, 0.9], 2.0)
    fig = seed_table.plot_elasticity(seed_table.load([tmp_path / "s1.json"]), labels, tmp_path / "long.png")
    renderer = fig.canvas.get_renderer()
    legend, figure_box = fig.legends[0].get_window_extent(renderer), fig.bbox
    assert figure_box.x0 <= legend.x0 and legend.x1 <= figure_box.x1  # no label runs off an edge
    for ax in fig.axes:  # and the legend sits below the panels' x labels, not over them
        assert legend.y1 <= ax.get_tightbbox(renderer).y0
    plt.close("all")


def test_iql_seeds_stacked_update_is_the_separate_updates(monkeypatch):
    import dataclasses

    import torch

    import flexloop_gciql as gciql
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    iql_seeds = load_bench("iql_seeds")
    args = gciql.resolve_dataset_defaults(dataclasses.replace(
        gciql.Args(), env_name="cube-double-play-v0", batch_size=16, hidden_dim=32))
    agents, _ = iql_seeds.build_seeds(args, [1, 2], torch.device("cpu"))
    first, second = (dict(a.named_parameters())["critic.gates.weight"] for a in agents)
    assert not torch.equal(first, second)  # each seed starts from its own weights

    result = iql_seeds.check_against_separate(args, [1, 2, 3], torch.device("cpu"), updates=3)
    assert result["max_weight_change"] > 1e-4  # the updates moved the weights...
    assert result["max_difference"] < 1e-5  # ...as three separate runs' updates on the same batches do


def test_profiling_counts_matmul_flops_forward_and_backward_and_rates_them(monkeypatch):
    import torch
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    profiling = load_bench("profiling")
    a = torch.randn(64, 32, requires_grad=True)
    b = torch.randn(32, 16)

    def product_and_backward():
        (a @ b).sum().backward()  # forward 2*64*32*16; backward d a = grad @ b.T, the same again

    assert profiling.matmul_flops(product_and_backward) == 2 * (2 * 64 * 32 * 16)
    rates = profiling.matmul_rates(2e12, {"us_per_call_by_kind": {"matmul": 4000.0}}, calls_per_second=50)
    assert rates == {"tflops_in_matmuls": 500.0, "tflops_over_wall": 100.0}


@pytest.mark.parametrize("variant", ["residual", "paper"])
def test_split_gate_network_equals_the_plain_one(monkeypatch, variant):
    """bench/split_gate.py: the gates' LayerNorm split over its halves gives the plain IRU's Q at every depth and its
    gradients, for all actions and at one action per row, and GC-IQL's IRU outputs and gradients; the scripts build
    their plain networks again afterwards."""
    import torch

    import flexloop_gcdqn as gcdqn
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    split_gate = load_bench("split_gate")
    for with_action in (False, True):
        result = split_gate.check(torch.device("cpu"), variant, with_action)
        assert result["q_max_abs"] > 1  # Q far from 0, so the tolerance below is relative to something
        assert result["q_max_abs_diff"] < 1e-5 * result["q_max_abs"]
        assert result["grad_max_rel_diff"] < 1e-5
    iql = split_gate.check_iql(torch.device("cpu"), variant)  # GC-IQL's IRU: no action dimension, two members
    assert iql["out_max_abs"] > 1 and iql["out_max_abs_diff"] < 1e-5 * iql["out_max_abs"]
    assert iql["grad_max_rel_diff"] < 1e-5
    args = gcdqn.Args(hidden_dim=16)
    with split_gate.split_gate_networks(gcdqn):
        assert isinstance(gcdqn.build_network(args, "cpu"), split_gate.SplitGateIRU)
    assert type(gcdqn.build_network(args, "cpu")) is gcdqn.IRUNetwork
    import flexloop_gciql as gciql
    with split_gate.split_gate_networks(gciql):
        assert isinstance(gciql.recurrent_network("iru", 4, 2, 5, 16, variant), split_gate.SplitGateIQL)
    assert type(gciql.recurrent_network("iru", 4, 2, 5, 16, variant)) is gciql.IRU


def test_split_gate_bf16_check_compares_both_networks_with_float32(monkeypatch):
    """bench/split_gate.py --bf16-check on the committed Exact-4 FlexLoop: under bf16 autocast both networks' Q stay
    close to float32's, and their greedy actions agree with it at every depth in most states."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    split_gate = load_bench("split_gate")
    result = split_gate.bf16_errors(ROOT / "checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/final.pt",
                                    num_states=64, steps=5)
    assert result["q_max_abs"] > 10  # a trained critic's Q, not a fresh one's
    for name in ("plain", "split"):
        assert 0 < result[name]["mean_abs_diff"] < 0.01 * result["q_max_abs"]  # bf16 differs, but a little
        assert len(result[name]["greedy_agreement_per_depth"]) == 5
        assert min(result[name]["greedy_agreement_per_depth"]) >= 0.85


def test_training_evals_tables_each_evaluated_step_with_its_task_and_loss(tmp_path, monkeypatch):
    """bench/training_evals.py: one row per evaluation, a background one at the step it evaluated with the loss
    logged nearest that step; per-split columns for GC-DQN runs; clear refusals."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    training_evals = load_bench("training_evals")
    gciql_run = tmp_path / "gciql.jsonl"
    with open(gciql_run, "w") as f:
        for step, critic in ((100_000, 2.0), (250_000, 1.5), (359_970, 9.0)):
            f.write(json.dumps({"global_step": step, "losses/critic_loss": critic}) + "\n")
        evaluation = {"global_step": 359_970, "charts/evaluated_step": 250_000}
        for k in (1, 2):
            evaluation[f"eval/success_depth_{k}"] = 0.1 * k
            for t in (1, 2):
                evaluation[f"eval/task_{t}/success_depth_{k}"] = 0.25 * t * k
        f.write(json.dumps(evaluation) + "\n")
        f.write('{"global_step": 400000, "eval/succ')  # a killed run's cut last line
    lines = training_evals.table(gciql_run, task=2, loss="losses/critic_loss").splitlines()
    assert lines[0] == "| step | depths 1-K | task 2, depths 1-K | losses/critic_loss |"
    assert lines[2:] == ["| 250k | 0.100 / 0.200 | 0.500 / 1.000 | 1.5 |"]  # 1.5 logged at 250k, not 9.0 after it
    assert training_evals.step_label(1_000_000) == "1M" and training_evals.step_label(1_000_012) == "1,000,012"

    gcdqn_run = tmp_path / "gcdqn.jsonl"
    write_run(gcdqn_run, [0.3, 0.6])
    lines = training_evals.table(gcdqn_run).splitlines()
    assert lines[0] == "| step | train, depths 1-K | unseen, depths 1-K |"
    assert lines[3] == "| 204,800 | 0.200 / 0.400 / 0.600 | 0.200 / 0.400 / 0.600 |"
    with pytest.raises(SystemExit, match="logs no success for task 2"):
        training_evals.table(gcdqn_run, task=2)
    with pytest.raises(SystemExit, match=r"logs no losses/critic_loss; its losses: \['losses/td_loss'\]"):
        training_evals.table(gcdqn_run, loss="losses/critic_loss")
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"global_step": 1, "losses/td_loss": 1.0}) + "\n")
    with pytest.raises(SystemExit, match="holds no evaluation yet"):
        training_evals.table(empty)
