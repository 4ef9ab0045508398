"""eval_adaptive.py: the stopping rule, compacted against masked inference, calibration, bucket sizes, LightsOut
episode accounting, bad inputs, a smoke run (results.json, plots, a tiny CPU stress test), and every plot and
printed table checked for readability."""

import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import matplotlib
import numpy as np
import pytest
import torch
import tyro

import envs
import eval_adaptive as ea
import flexloop_run
import flexloop_gcdqn as gcdqn
from envs.lightsout import min_solution_length, solve

matplotlib.use("Agg")
K = 5
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny networks: one thread is faster than two competing ones on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ----- the stopping rule -----

def hand_made_deltas(with_depth_zero):
    """Three rows of per-depth logits (3 actions), through the script's own divergence.
    row 0: the same policy at every depth (delta_k = 0 for k >= 2);
    row 1: changes a lot, except from depth 3 to 4 (delta_4 tiny);
    row 2: flips at every depth (never converges)."""
    per_depth = torch.tensor([
        [[1., 0, 0], [4, 0, 0], [4, 0, 0]],
        [[1., 0, 0], [0, 4, 0], [0, 4, 0]],
        [[1., 0, 0], [0, 0, 4], [4, 0, 0]],
        [[1., 0, 0], [0, 0, 4.01], [0, 4, 0]],
        [[1., 0, 0], [4, 0, 0], [4, 0, 0]],
    ])  # (K, rows, actions)
    decisions = list(per_depth)
    decision_0 = torch.zeros(3, 3) if with_depth_zero else None  # pi_0: uniform
    return ea.adjacent_divergences(gcdqn.IRUNetwork, decisions, decision_0)


def test_adjacent_divergence_is_the_training_direction():
    deltas = hand_made_deltas(with_depth_zero=True)
    p, q = torch.tensor([[0., 0, 4]]), torch.tensor([[0., 4, 0]])  # row 1's pi_3, pi_2
    assert torch.allclose(deltas[2, 1], gcdqn.IRUNetwork.divergence(p, q)[0])  # delta_3 = D(pi_3, pi_2)
    assert deltas[3, 1] < 1e-3 < deltas[1, 1]
    assert torch.isinf(hand_made_deltas(with_depth_zero=False)[0]).all()  # no pi_0: depth 1 can never stop


@pytest.mark.parametrize("k_min, expected", [(0, [2, 4, 5]), (1, [2, 4, 5]), (2, [3, 4, 5]), (3, [4, 4, 5]),
                                             (4, [5, 5, 5])])
def test_stopping_rule_respects_k_min_and_falls_back_to_k(k_min, expected):
    deltas = hand_made_deltas(with_depth_zero=k_min == 0)
    assert ea.stopping_depths(deltas, 0.01, k_min).tolist() == expected


@pytest.mark.parametrize("k_min", range(K))
def test_eps_zero_always_runs_to_k_and_huge_eps_stops_at_k_min_plus_one(k_min):
    deltas = hand_made_deltas(with_depth_zero=k_min == 0)
    assert ea.stopping_depths(deltas, 0.0, k_min).tolist() == [K] * 3
    assert ea.stopping_depths(deltas, 1e9, k_min).tolist() == [k_min + 1] * 3
    rounding = torch.full((K, 3), -1e-9)  # a KL of equal policies can round below 0
    assert ea.stopping_depths(rounding, 0.0, k_min).tolist() == [K] * 3


def test_per_row_eps():
    deltas = hand_made_deltas(with_depth_zero=False)
    assert ea.stopping_depths(deltas, torch.tensor([0.0, 0.01, 1e9]), 1).tolist() == [5, 4, 2]


# ----- compacted and masked inference -----

def random_network_and_batch(seed=0, batch=64):
    torch.manual_seed(seed)
    network = gcdqn.IRUNetwork(depth=K, hidden_dim=16).eval()
    with torch.no_grad():  # a sharper Q-head: random depths then disagree by different amounts per state
        network.head.weight.mul_(10)
    obs, _ = envs.make_vec("BoxPick-Exact-4-v0", batch, seed=seed).unwrapped.reset()
    return network, obs["observation"], obs["desired_goal"]


def eps_between_deltas(network, obs, goal, quantile, k_min=1):
    """An eps halfway between two neighbouring values of the deltas that can stop a row, so that rounding
    cannot flip a stop decision."""
    decisions = ea.depth_decisions(network, obs, goal, with_depth_zero=k_min == 0)
    decision_0 = decisions.pop(0) if k_min == 0 else None
    deltas = ea.adjacent_divergences(network, decisions, decision_0)[k_min:].flatten().sort().values
    i = int(quantile * (len(deltas) - 1))
    return float((deltas[i] + deltas[i + 1]) / 2)


@pytest.mark.parametrize("k_min", [0, 1, 2])
@pytest.mark.parametrize("quantile", [0.2, 0.5])
def test_compacted_and_masked_give_the_same_depths_and_actions(k_min, quantile):
    network, obs, goal = random_network_and_batch()
    eps = eps_between_deltas(network, obs, goal, quantile, k_min)
    masked_decision, masked_depth = ea.masked_policy(network, obs, goal, eps, k_min)
    assert len(masked_depth.unique()) >= 3  # the test needs rows stopping at several depths
    assert masked_depth.min() > k_min
    masked_actions = network.act(masked_decision, torch.Generator().manual_seed(1))

    exact = [ea.compacted_policy(network, obs, goal, eps, k_min, min_shrink=m) for m in (0.0, 0.5)]
    counts = [int(c) for c in exact[0][2]]
    levels = K - k_min - 1
    bucketed = [ea.compacted_policy(network, obs, goal, eps, k_min, sizes=sizes)
                for sizes in [(64,) * levels, tuple(counts) + (0,) * (levels - len(counts))]]
    for decision, depth, _, overflow in exact + bucketed:
        assert not overflow
        assert torch.equal(depth, masked_depth)
        assert torch.allclose(decision, masked_decision, atol=1e-5)
        assert torch.equal(network.act(decision, torch.Generator().manual_seed(1)), masked_actions)
    # the evaluation path (every depth computed, then chosen) agrees too
    _, chosen = ea.DepthChoice(network, [{"eps": eps}], k_min)(obs, goal, torch.zeros(64, dtype=torch.long))
    assert torch.equal(chosen, masked_depth)
    # buckets too small for the rows still going are flagged, never silently wrong
    assert max(counts) > 1
    assert ea.compacted_policy(network, obs, goal, eps, k_min, sizes=(1,) * levels)[3]


def test_stress_steppers_compact_and_masked_follow_the_same_episodes():
    network, obs, goal = random_network_and_batch(seed=1, batch=32)
    eps = eps_between_deltas(network, obs, goal, 0.4)
    steppers = {mode: ea.StressStepper(network, mode, eps, 1, 32, "BoxPick-Exact-4-v0", "train", 3, "cpu", False)
                for mode in ("compact", "masked", "full")}
    for _ in range(12):
        for stepper in steppers.values():
            stepper.step()
    compact, masked, full = steppers["compact"], steppers["masked"], steppers["full"]
    assert torch.equal(compact.env.grid, masked.env.grid)
    assert torch.equal(compact.depth_counts, masked.depth_counts)
    assert compact.depth_counts.sum() == 12 * 32 and 1 < compact.report()["mean_depth"] < K
    assert full.report()["mean_depth"] == K
    assert not torch.equal(compact.env.grid, compact.env.goal)  # the env state moved on


def eager_steppers(*modes):
    """Eager stress steppers of one random network on the same 64 Exact-4 episodes; "bucketed" is compact mode on
    the CUDA-graph path's fixed sizes (no margin, no minimum shrink, so the sizes move and sometimes overflow)."""
    network, obs, goal = random_network_and_batch(seed=1, batch=64)
    eps = eps_between_deltas(network, obs, goal, 0.4)
    return [ea.StressStepper(network, "compact" if mode == "bucketed" else mode, eps, 1, 64, "BoxPick-Exact-4-v0",
                             "train", 3, "cpu", False, min_shrink=0.0, margin=0.0, bucketed=mode == "bucketed")
            for mode in modes]


def test_bucketed_steps_redo_overflows_and_follow_the_masked_episodes():
    """The CUDA-graph path of compact mode (fixed sizes from recent counts, exact redo on overflow), run eagerly."""
    bucketed, masked = eager_steppers("bucketed", "masked")
    sizes_used = set()
    for _ in range(30):
        sizes_used.add(bucketed.sizes)
        bucketed.step()
        masked.step()
    assert torch.equal(bucketed.env.grid, masked.env.grid)
    assert torch.equal(bucketed.depth_counts, masked.depth_counts)
    assert len(sizes_used) > 2 and min(map(sum, sizes_used)) < sum(bucketed.full_sizes)  # it did compact
    assert bucketed.overflow_steps > 0  # no margin: some steps outgrow the recent maximum and are redone
    # mean depth x envs x steps is the exact compaction's work; the buckets' padding and redos run more
    assert bucketed.rows_needed == pytest.approx(float(masked.report()["mean_depth"]) * 64 * 30)
    assert bucketed.report()["rows_run_over_exact"] > 1.0
    bucketed.sizes_seen_before_timing = len(bucketed.policy_runs)  # as stress_test marks the end of warmup
    sizes_after = set()
    for _ in range(30):
        sizes_after.add(bucketed.sizes)
        bucketed.step()
    assert bucketed.report()["new_sizes_while_timed"] == len(sizes_after - sizes_used)


def test_frozen_bucket_sizes_capture_nothing_new_and_still_follow_the_masked_episodes():
    """--stress-freeze-sizes: after warm-up every step reuses captured sizes that hold its counts."""
    bucketed, masked, free = eager_steppers("bucketed", "masked", "bucketed")
    for _ in range(9):  # warm-up
        bucketed.step()
        masked.step()
    captured = set(bucketed.policy_runs)
    assert bucketed.sizes not in captured  # this warm-up ends on new sizes: freezing must not capture them either
    bucketed.sizes_seen_before_timing = len(captured)
    bucketed.freeze()
    for _ in range(9):  # the same warm-up, left unfrozen
        free.step()
    used_when_free = set()
    for _ in range(30):
        assert bucketed.sizes in captured
        used_when_free.add(free.sizes)
        bucketed.step()
        masked.step()
        free.step()
    assert used_when_free - captured  # unfrozen, the same steps would have captured new sizes
    assert bucketed.report()["new_sizes_while_timed"] == 0 and set(bucketed.policy_runs) == captured
    assert torch.equal(bucketed.env.grid, masked.env.grid)
    assert torch.equal(bucketed.depth_counts, masked.depth_counts)


def test_bucket_window_sizes_each_step_from_that_many_recent_counts():
    """--stress-bucket-window: the next sizes cover the maximum count of the last `window` steps, no older ones."""
    network, obs, goal = random_network_and_batch(seed=1, batch=64)
    eps = eps_between_deltas(network, obs, goal, 0.4)
    steppers = {window: ea.StressStepper(network, "compact", eps, 1, 64, "BoxPick-Exact-4-v0", "train", 3, "cpu",
                                         False, min_shrink=0.0, margin=0.0, bucketed=True, window=window)
                for window in (1, 10)}
    history = []
    for _ in range(12):
        for stepper in steppers.values():
            stepper.step()
        history.append(steppers[1].recent_counts[-1])
        assert steppers[1].recent_counts == history[-1:] and steppers[10].recent_counts == history[-10:]
        assert steppers[1].sizes == ea.bucket_sizes(history[-1:], 64, 0.0, 0.0)
    assert steppers[1].rows_needed == steppers[10].rows_needed  # the same episodes: only the padding differs


def test_bucket_sizes_cover_recent_counts_and_skip_small_shrinks():
    recent = [[50, 30, 10], [52, 28, 12]]
    assert ea.bucket_sizes(recent, 64, margin=0.0, min_shrink=0.0) == (52, 30, 12)  # granule 64 / 32 = 2
    assert ea.bucket_sizes(recent, 64, margin=0.0, min_shrink=0.5) == (64, 30, 12)  # 52 of 64 is no compaction
    assert ea.bucket_sizes(recent, 64, margin=0.1, min_shrink=0.0) == (58, 34, 14)  # + 10 %, rounded up to 2


# ----- calibration -----

def sweep(successes, eps=(0.0, 0.005, 0.01, 0.02, 0.05)):
    return [{"eps": e, "success": s} for e, s in zip(eps, successes)]


def test_calibration_picks_the_largest_eps_that_keeps_the_success():
    rows = sweep([0.99, 0.975, 0.99, 0.975, 0.5])  # not monotone in eps
    assert ea.calibrate(rows, 0.99, 0.99)["eps"] == 0.01  # floor 0.9801: 0.005 fails, 0.01 passes
    assert ea.calibrate(rows, 0.99, 0.98)["eps"] == 0.02  # floor 0.9702
    assert ea.calibrate(rows, 0.99, 0.5)["eps"] == 0.05
    strict = ea.calibrate(rows, 0.99, 1.0)
    assert strict["eps"] == 0.01 and strict["met"] and strict["floor"] == 0.99


def test_calibration_falls_back_to_the_smallest_eps_when_nothing_passes():
    result = ea.calibrate(sweep([0.9, 0.8, 0.7, 0.6, 0.5], eps=(0.05, 0.0, 0.01, 0.02, 0.03)), 1.0, 0.99)
    assert result["eps"] == 0.0 and not result["met"]


# ----- LightsOut episode accounting -----

class SolverNetwork:
    """The depth protocol around LightsOut's exact solver: every depth presses a button of the minimal solution."""
    depth = 3
    divergence = staticmethod(gcdqn.IRUNetwork.divergence)

    def start(self, obs, goal):
        return obs, goal

    def advance(self, state):
        return state

    def decide(self, state):
        obs, goal = state
        return solve(obs.bool() ^ goal.bool()).float() * 10

    @staticmethod
    def act(logits, generator=None, deterministic=False):
        return logits.argmax(-1)


def test_lightsout_adapter_counts_first_episodes_until_success():
    args = ea.Args(checkpoints=("x.pt",), num_eval_envs=16)
    adapter = ea.LightsOutAdapter(None, SolverNetwork(), None, envs.LIGHTSOUT_ID, args, "cpu")
    policies = [{"depth": 1}, {"depth": 3}, {"eps": 1e9}]
    results = adapter.run("train", ea.DepthChoice(SolverNetwork(), policies, k_min=1))
    tasks = adapter.make_env("train", 16)
    tasks.reset()
    steps = int(min_solution_length(tasks.board, tasks.goal).sum())  # the solver needs exactly these presses
    for result, depth in zip(results, [1, 3, 2]):
        assert result["success"] == 1.0
        assert result["depth_counts"][depth - 1] == steps and sum(result["depth_counts"]) == steps
    assert len(results[0]["trace"]["depths"]) == int(min_solution_length(tasks.board[:1], tasks.goal[:1]))


def test_ogbench_envs_step_as_the_run_did_unless_told_to_use_one_process():
    """OGBench's envs step in subprocesses where the checkpoint's run stepped them so, in one process where it did
    not or where --no-eval-async says so."""
    import flexloop_gciql as gciql
    for run_async in (True, False):
        train_args = gciql.Args(env_name="pointmaze-large-stitch-v0", eval_async=run_async)
        for flags, expected in (([], run_async), (["--no-eval-async"], False)):
            args = tyro.cli(ea.Args, args=["--checkpoints", "x.pt", *flags])
            adapter = ea.OGBenchAdapter(gciql, None, train_args, "pointmaze-large-stitch-v0", args, "cpu")
            assert adapter.async_envs is expected


def test_ogbench_env_count_is_the_runs_on_a_cpu_and_every_episode_of_a_task_on_a_gpu():
    """On a CPU a policy call costs by the row, so the envs are the run's; on a GPU a call costs about the same at
    any batch, so every episode of a task (episodes x policies) runs side by side where the envs are small (not
    manipulation's, about 160 MB each); --ogbench-envs overrides all."""
    import flexloop_gciql as gciql
    envs_made = []

    class CountingScript:
        @staticmethod
        def make_eval_vector_env(env_name, num_envs, async_envs):
            envs_made.append(num_envs)
            return object()

        @staticmethod
        def rollout(policy_fn, vector_env, task_ids, episodes, num_policies, seed):
            return np.ones((num_policies, 1, episodes))

    class TwoDepthNetwork:
        depth = 2

    def choice(obs, goal, policy_index):
        raise AssertionError("the fake rollout steps no env")
    choice.num_policies = 3

    train_args = gciql.Args(env_name="pointmaze-large-stitch-v0", eval_envs=30, eval_episodes=7)
    maze, cube, given = "pointmaze-large-stitch-v0", "cube-double-play-v0", ["--ogbench-envs", "100"]
    for env_id, device, flags, expected in ((maze, "cpu", [], 30), (maze, "cpu", given, 100),
                                            (maze, "cuda", [], 7 * 3), (maze, "cuda", given, 100),
                                            (cube, "cuda", [], 30), (cube, "cuda", given, 100)):
        args = tyro.cli(ea.Args, args=["--checkpoints", "x.pt", *flags])
        adapter = ea.OGBenchAdapter(CountingScript, TwoDepthNetwork(), train_args, env_id, args, device)
        adapter.device = "cpu"  # the count is chosen for the device above; the fake episodes need no GPU
        adapter.rollout("task1", choice)
        adapter.rollout("task2", choice, episodes=1)  # a later call, a trace's one episode, keeps the envs
        assert envs_made == [expected] and adapter.num_envs == expected, (env_id, device, flags)
        envs_made.clear()


def test_ogbench_trace_follows_the_first_successful_episode_of_a_task():
    """The paper's Figure 6 shows successful episodes: the trace runs the task's first TRACE_TRIES episodes side
    by side, then the first that succeeded (else the last) again alone, so row 0's depths are that episode's."""
    calls = []

    class FakeScript:  # the two functions eval_adaptive.py calls on flexloop_gciql.py
        @staticmethod
        def make_eval_vector_env(env_name, num_envs, async_envs):
            return object()

        @staticmethod
        def rollout(policy_fn, vector_env, task_ids, episodes, num_policies, seed):
            calls.append((task_ids, episodes, seed))
            first = seed - (7 + 1000 * task_ids[0])
            for step in range(3 + first):  # episode e runs 3 + e steps
                policy_fn(np.zeros((1, 2)), np.zeros((1, 2)), np.zeros(1))
            return np.array(outcomes[first:first + episodes], float).reshape(num_policies, 1, episodes)

    class FakeNetwork:
        depth = 3

        @staticmethod
        def act(decision):
            return decision

    def choice(obs, goal, policy_index):  # depth 2 everywhere
        return torch.zeros(len(obs), 2), torch.full((len(obs),), 2)
    choice.num_policies = 1

    args = tyro.cli(ea.Args, args=["--checkpoints", "x.pt", "--seed", "7"])
    train_args = type("TrainArgs", (), {"eval_episodes": 50, "eval_envs": 4, "eval_async": False})()
    adapter = ea.OGBenchAdapter(FakeScript, FakeNetwork(), train_args, "pointmaze-large-stitch-v0", args, "cpu")
    adapter.groups = ["task1", "task2"]
    outcomes = [0, 0, 1, 0, 1] + [0] * (ea.TRACE_TRIES - 5)
    trace = adapter.trace("task2", choice)
    assert trace == {"depths": [2] * 5, "episode_success": 1.0, "episode": 2}  # episode 2 alone: 5 steps
    assert calls == [((2,), ea.TRACE_TRIES, 7 + 2000), ((2,), 1, 7 + 2000 + 2)]  # the tries, then episode 2 alone
    calls.clear()
    outcomes = [0] * ea.TRACE_TRIES
    trace = adapter.trace("task1", choice)
    assert trace["episode_success"] == 0.0 and trace["episode"] == ea.TRACE_TRIES - 1
    assert calls[1] == ((1,), 1, 7 + 1000 + ea.TRACE_TRIES - 1)
    assert len(trace["depths"]) == 3 + ea.TRACE_TRIES - 1

# ----- bad inputs -----

@pytest.mark.parametrize("overrides, message", [
    (dict(checkpoints=()), "at least one checkpoint"),
    (dict(eps=(0.0, -0.01)), "eps must be a finite number >= 0"),
    (dict(eps=(float("nan"),)), "eps must be a finite number >= 0"),
    (dict(k_min=-1), "--k-min must be >= 0"),
    (dict(retain=0.0), "--retain must lie in"),
    (dict(labels=("a", "b")), "one label per checkpoint"),
    (dict(stress_envs=(0,)), "--stress-envs must be positive"),
    (dict(stress_bucket_window=0), "--stress-bucket-window must be at least 1 step"),
    (dict(ogbench_envs=0), "--ogbench-envs must be positive"),
    (dict(skip_eval=True, stress_envs=(8,)), "pass --stress-eps"),
    (dict(stress_env_id="LightsOut-4x5-v0"), "must be a BoxPick env"),
])
def test_bad_flags(overrides, message):
    with pytest.raises(ValueError, match=message):
        ea.check_args(ea.Args(**{"checkpoints": ("a.pt",), **overrides}))


def test_bad_checkpoints(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        flexloop_run.load_any_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "garbage.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is a text file, not a FlexLoop checkpoint"):
        flexloop_run.load_any_checkpoint(tmp_path / "garbage.pt")
    torch.save({"model": {}}, tmp_path / "untagged.pt")
    with pytest.raises(ValueError, match="no 'flexloop-checkpoint-v2' format tag"):
        flexloop_run.load_any_checkpoint(tmp_path / "untagged.pt")
    torch.save({"format": flexloop_run.CHECKPOINT_FORMAT, "algorithm": "sac", "args": {}, "env_id": "CartPole-v1",
                "depth": 2, "model": {}}, tmp_path / "sac.pt")  # names no script: flexloop_sac, which nobody has
    with pytest.raises(ModuleNotFoundError, match="flexloop_sac.py, which is neither next to its run nor on the"):
        flexloop_run.load_any_checkpoint(tmp_path / "sac.pt")
    with pytest.raises(ValueError, match="no evaluation for env 'CartPole-v1'"):
        ea.adapter_for("CartPole-v1")


# ----- smoke run -----

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A tiny gcdqn run (pretraining, then FlexLoop): pretrained.pt and final.pt."""
    args = gcdqn.Args(num_envs=8, batch_size=8, updates_per_rollout=2, intervals_per_epoch=1, pretrain_epochs=1,
                      num_epochs=1, hidden_dim=16, eval_every=1, num_eval_envs=4, log_every=1, save_every=1,
                      episode_length=10, replay_episodes=2, cuda=False, run_dir=str(tmp_path_factory.mktemp("runs")))
    run_dir = gcdqn.train(args)
    return run_dir / "pretrained.pt", run_dir / "final.pt"


def test_k_min_must_be_below_the_checkpoint_depth(checkpoints, tmp_path):
    with pytest.raises(ValueError, match="0 <= k_min < K = 5"):
        ea.main(ea.Args(checkpoints=(str(checkpoints[1]),), k_min=5, out_dir=str(tmp_path), cuda=False))


def test_checkpoints_of_different_envs_are_refused(checkpoints, tmp_path):
    other = torch.load(checkpoints[1], weights_only=True)
    other["env_id"] = other["args"]["env_id"] = "BoxPick-Exact-3-v0"
    torch.save(other, tmp_path / "exact3.pt")
    with pytest.raises(ValueError, match="different envs"):
        ea.main(ea.Args(checkpoints=(str(checkpoints[1]), str(tmp_path / "exact3.pt")), out_dir=str(tmp_path),
                        cuda=False))


def test_smoke_run_writes_results_and_plots(checkpoints, tmp_path, capsys):
    out_dir = ea.main(ea.Args(checkpoints=tuple(str(p) for p in checkpoints), num_eval_envs=8, eps=(0.0, 1e-3, 1e9),
                              stress_envs=(8,), stress_warmup=2, stress_samples=2, stress_block=1, trace_frames=4,
                              out_dir=str(tmp_path / "out"), cuda=False))
    results = json.loads((out_dir / "results.json").read_text())
    assert [c["label"] for c in results["checkpoints"]] == ["pretrained", "final"]
    for ev in results["checkpoints"]:
        assert ev["algorithm"] == "gcdqn" and ev["depth"] == K and ev["eps_grid"] == [0.0, 1e-3, 1e9]
        for split in ("train", "unseen"):
            assert len(ev["elasticity"][split]) == K
            assert all(0 <= s <= 1 for s in ev["elasticity"][split])
            rows = ev["adaptive"][split]
            for row in rows:
                assert sum(row["depth_histogram"]) == pytest.approx(1.0)
                assert row["ideal_speedup"] == pytest.approx(K / row["mean_depth"])
            assert rows[0]["mean_depth"] == K and rows[0]["depth_histogram"][-1] == 1.0  # eps = 0
            assert rows[2]["mean_depth"] == 2 and rows[2]["depth_histogram"][1] == 1.0  # huge eps: k_min + 1
            trace = ev["trace"][split]
            assert len(trace["depths"]) == len(trace["grids"]) == 10 and len(trace["goal"]) == 36
            assert all(1 < d <= K for d in trace["depths"])
            assert sum(b["fraction"] for b in ev["analysis"]["bins"][split]) == pytest.approx(1.0)
        calibration = ev["calibration"]
        assert calibration["eps"] in ev["eps_grid"] and set(calibration["results"]) == {"train", "unseen"}
        assert calibration["full_depth_success"] == ev["elasticity"]["train"][-1]
    names = {p.name for p in out_dir.iterdir()}
    assert {"elasticity.png", "pareto.png", "delta_vs_endpoint.png", "depth_trace.png",
            "strip_pretrained_train.png", "strip_final_unseen.png"} <= names
    assert all((out_dir / n).stat().st_size > 1000 for n in names if n.endswith(".png"))

    stress = results["stress"]
    assert stress["paper_anchor"]["speedup"] == 1.34
    assert [r["checkpoint"] for r in stress["results"]] == ["pretrained", "final"]
    for row in stress["results"]:
        assert row["num_envs"] == 8 and row["eps"] == row_eps(results, row["checkpoint"])
        assert set(row["modes"]) == {"full", "compact", "masked"}
        assert row["modes"]["full"]["mean_depth"] == K
        for mode in ("compact", "masked"):
            m = row["modes"][mode]
            assert m["ms_per_step_median"] > 0 and m["ms_per_step_iqr"] >= 0 and m["speedup"] > 0
            assert m["ms_per_step_mean"] > 0 and m["new_sizes_while_timed"] == 0  # eager compact: no buckets
            full_mean = row["modes"]["full"]["ms_per_step_mean"]
            assert m["speedup_of_means"] == pytest.approx(full_mean / m["ms_per_step_mean"])
            assert m["ideal_speedup"] == pytest.approx(K / m["mean_depth"])
    printed = capsys.readouterr().out  # tables, not JSON (the JSON is in results.json)
    assert "speed-up" in printed and "the paper (Table 3): 1.34x" in printed and '"paper_anchor"' not in printed
    assert "{" not in printed and len(printed.splitlines()) < 60


def test_stress_test_freezes_bucket_sizes_after_warmup_unless_told_not_to(monkeypatch):
    """By default no graph capture lands in a timed block; --no-stress-freeze-sizes keeps the older protocol."""
    network, obs, goal = random_network_and_batch(seed=1, batch=64)
    eps = eps_between_deltas(network, obs, goal, 0.4)
    eager_bucketed = functools.partial(ea.StressStepper, bucketed=True)  # the CUDA-graph path's buckets, on CPU
    monkeypatch.setattr(ea, "StressStepper", lambda *a, **kw: eager_bucketed(*a, **kw))
    def compact_row(**flags):
        args = ea.Args(stress_env_id="BoxPick-Exact-4-v0", stress_split="train", stress_mode=("compact",), seed=3,
                       stress_warmup=9, stress_samples=3, stress_block=10, stress_min_shrink=0.0,
                       stress_bucket_margin=0.0, **flags)
        return ea.stress_test(network, args, eps, 64, torch.device("cpu"))["modes"]["compact"]
    frozen, free = compact_row(), compact_row(stress_freeze_sizes=False)
    assert frozen["new_sizes_while_timed"] == 0 < free["new_sizes_while_timed"]
    assert frozen["mean_depth"] == free["mean_depth"] and frozen["success"] == free["success"]


def test_bucket_sizes_bench_counts_new_sizes_and_freezing_stops_them(checkpoints):
    """bench/bucket_sizes.py replays compact mode's buckets on the CPU and prints JSON."""
    def bench(*flags):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bucket_sizes.py"), "--checkpoint",
                              str(checkpoints[1]), "--num-envs", "64", "--warmup", "3", "--steps", "12",
                              "--eps", "1e-3", *flags], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    free, frozen = bench(), bench("--freeze")
    assert free["new_sizes_per_100_steps"] == [free["new_sizes_after_warmup"]]
    assert frozen["new_sizes_after_warmup"] == 0 and frozen["new_sizes_in_warmup"] == free["new_sizes_in_warmup"] > 0
    assert free["mean_depth"] == frozen["mean_depth"]  # freezing changes the buckets, never the decisions
    assert 0 < free["mean_bucket_fraction_after_warmup"] <= frozen["mean_bucket_fraction_after_warmup"] <= 1
    q25, median, q75 = frozen["block_bucket_fraction_q25_median_q75"]
    assert 0 < q25 <= median <= q75 <= 1


def test_bucket_sizes_bench_counts_the_rows_that_need_the_last_depth(checkpoints):
    """With eps 0 no row ever stops, so every row of every step reaches depth K; with an eps no divergence reaches,
    every row stops at its first chance and none does."""
    def bench(eps):
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "bucket_sizes.py"), "--checkpoint",
                              str(checkpoints[1]), "--num-envs", "32", "--warmup", "2", "--steps", "6",
                              "--eps", str(eps)], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)
    never_stop, first_chance = bench(0), bench(1e9)
    assert never_stop["rows_at_depth_K_min"] == 32 and never_stop["steps_with_a_row_at_depth_K"] == 1
    assert first_chance["rows_at_depth_K_min"] == 0 and first_chance["steps_with_a_row_at_depth_K"] == 0


def test_stress_profile_bench_splits_each_modes_step_by_kind_of_kernel(checkpoints, capsys):
    """bench/stress_profile.py on a CPU (ATen ops for kernels): with every row stopping at its first chance, compact
    mode runs fewer matmuls than full depth and masked more, the kinds add up to the device time, the env row
    (action and env.step alone) runs none of the policy's matmuls, and the policy's parts enter the ideals."""
    sys.path.insert(0, str(ROOT / "bench"))
    import stress_profile
    stress_profile.main(["--checkpoint", str(checkpoints[1]), "--eps", "1e9", "--num-envs", "16", "--warmup", "2",
                         "--steps", "2", "--profile-steps", "2", "--device", "cpu"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    modes = report["modes"]
    assert modes["full"]["mean_depth"] == K and modes["compact"]["mean_depth"] == modes["masked"]["mean_depth"] == 2
    matmuls = {mode: row["kernels_per_step_by_kind"]["matmul"] for mode, row in modes.items()}
    assert 0 < matmuls["compact"] < matmuls["full"] < matmuls["masked"]
    for mode, row in modes.items():
        assert sum(row["ms_per_step_by_kind"].values()) == pytest.approx(row["device_ms_per_step"])
        assert row["wall_ms_per_step"] > 0 and row["largest"]
    assert modes["compact"]["ideal_speedup"] == pytest.approx(K / 2)
    assert set(modes["compact"]["ms_by_kind_over_full"]) == set(modes["full"]["ms_per_step_by_kind"])
    # the env row is the action and env.step alone: no matmul of the policy in it
    env = report["env"]
    assert env["kernels_per_step_by_kind"]["matmul"] == 0
    assert env["kernels_per_step"] > 0 and env["wall_ms_per_step"] > 0
    full_ms, env_ms, compact = modes["full"]["wall_ms_per_step"], env["wall_ms_per_step"], modes["compact"]
    assert compact["policy_speedup"] == pytest.approx((full_ms - env_ms) / (compact["wall_ms_per_step"] - env_ms))
    assert compact["ideal_speedup_with_env"] == pytest.approx(full_ms / (env_ms + (full_ms - env_ms) * 2 / K))
    # the policy's parts over every row: the embedding and one recurrent step, whose GEMM is the gates' alone
    parts = report["parts"]
    assert parts["start"]["kernels_per_step_by_kind"]["matmul"] >= 1
    assert parts["advance"]["kernels_per_step_by_kind"]["matmul"] == 1
    fixed_ms = env_ms + parts["start"]["wall_ms_per_step"]
    assert report["rest_of_full_ms"] == pytest.approx(full_ms - fixed_ms - K * parts["advance"]["wall_ms_per_step"])
    assert compact["ideal_speedup_with_fixed"] == pytest.approx(full_ms / (fixed_ms + (full_ms - fixed_ms) * 2 / K))
    with pytest.raises(ValueError, match="0 <= k_min < K = 5"):
        stress_profile.main(["--checkpoint", str(checkpoints[1]), "--eps", "0.1", "--k-min", "5", "--device", "cpu"])


def test_stress_profile_sorts_gpu_kernels_by_kind():
    sys.path.insert(0, str(ROOT / "bench"))
    from profiling import kernel_kind
    assert kernel_kind("sm90_xmma_gemm_f32f32_tf32f32_f32_nn_n_tilesize128x128x32") == "matmul"
    assert kernel_kind("nvjet_tst_128x64_64x8_1x2_h_bz_TNN") == "matmul"
    assert kernel_kind("void splitKreduce_kernel<32, 16, int, float, float>(...)") == "matmul"
    assert kernel_kind("void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<...>>(...)") \
        == "gather and copy"
    assert kernel_kind("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4>(...)") \
        == "gather and copy"
    assert kernel_kind("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<"
                       "at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)>>(...)") == "gather and copy"
    assert kernel_kind("void at::native::vectorized_elementwise_kernel<4, at::native::sigmoid_kernel_cuda("
                       "at::TensorIteratorBase&)::{lambda()#2}>(...)") == "elementwise and reductions"
    assert kernel_kind("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>(...)") \
        == "elementwise and reductions"
    assert kernel_kind("triton_poi_fused_add_mul_sigmoid_tanh_0") == "elementwise and reductions"
    assert kernel_kind("triton_per_fused__to_copy_mul_native_layer_norm_native_layer_norm_backward_6") \
        == "elementwise and reductions"
    assert kernel_kind("triton_poi_fused_index_mul_3") == "gather and copy"
    assert kernel_kind("aten::bmm") == "matmul" and kernel_kind("aten::index") == "gather and copy"


def test_stress_test_times_a_checkpoint_on_its_own_env(checkpoints, tmp_path, capsys):
    """An Exact-3 policy is timed on Exact-3 (not on the paper's Exact-4), and naming another env is refused."""
    other = torch.load(checkpoints[1], weights_only=True)
    other["env_id"] = other["args"]["env_id"] = "BoxPick-Exact-3-v0"
    torch.save(other, tmp_path / "exact3.pt")
    stress_only = dict(checkpoints=(str(tmp_path / "exact3.pt"),), skip_eval=True, stress_envs=(8,), stress_eps=0.02,
                       stress_warmup=2, stress_samples=2, stress_block=1, out_dir=str(tmp_path / "out"), cuda=False)
    with pytest.raises(ValueError, match="not the checkpoints' env BoxPick-Exact-3-v0; leave --stress-env-id out"):
        ea.main(ea.Args(**stress_only, stress_env_id="BoxPick-Exact-4-v0"))
    results = json.loads((ea.main(ea.Args(**stress_only)) / "results.json").read_text())
    assert results["stress"]["results"][0]["env_id"] == "BoxPick-Exact-3-v0"
    assert results["stress"]["paper_anchor"] is None
    assert "the paper's Table 3 is on BoxPick-Exact-4-v0" in capsys.readouterr().out


def test_stress_test_alone_on_train_tasks_names_the_papers_train_row(checkpoints, tmp_path, capsys):
    """--skip-eval times the given eps only; Table 3's train row is 170.1 / 133.0 ms = 1.28x at mean depth 3.85."""
    out_dir = ea.main(ea.Args(checkpoints=(str(checkpoints[1]),), skip_eval=True, stress_envs=(8,), stress_eps=0.02,
                              stress_split="train", stress_warmup=2, stress_samples=2, stress_block=1,
                              out_dir=str(tmp_path / "out"), cuda=False))
    results = json.loads((out_dir / "results.json").read_text())
    assert results["checkpoints"] == [] and results["stress"]["paper_anchor"]["mean_depth"] == 3.85
    (row,) = results["stress"]["results"]
    assert row["split"] == "train" and row["eps"] == 0.02
    heading = capsys.readouterr().out.split("wall clock of one env step")[1].splitlines()[0]
    assert "train tasks" in heading and "the paper (Table 3): 1.28x at mean depth 3.85" in heading


def row_eps(results, label):
    return next(c["calibration"]["eps"] for c in results["checkpoints"] if c["label"] == label)


# ----- plots and printed tables -----

def fake_evaluation(label, env_id, depth, eps_grid, seed, groups=("train", "unseen"), k_min=1):
    """An evaluation shaped like evaluate_checkpoint's, with plausible numbers: success rising with depth, an eps
    sweep whose small eps crowd near depth K (the case where eps labels collide), analysis bins over decades."""
    rng = np.random.default_rng(seed)
    ogbench = not env_id.startswith(("BoxPick", "LightsOut"))
    top = {g: rng.uniform(0.05, 0.6) for g in groups}
    elasticity = {g: [float(top[g] * (1 - np.exp(-k / 1.5))) for k in range(1, depth + 1)] for g in groups}
    adaptive = {}
    for g in groups:
        rows = []
        for eps in eps_grid:
            mean_depth = depth - (depth - k_min - 1) * (eps / max(eps_grid)) ** 0.5 if eps else float(depth)
            success = float(np.interp(mean_depth, range(1, depth + 1), elasticity[g]) *
                            (rng.uniform(0.9, 1.0) if eps else 1.0))
            histogram = np.full(depth, 1.0 / depth).tolist()
            rows.append({"eps": eps, "success": success, "mean_depth": mean_depth, "depth_histogram": histogram,
                         "ideal_speedup": depth / mean_depth})
        adaptive[g] = rows
    if ogbench:
        elasticity["mean"] = np.mean([elasticity[g] for g in groups], 0).tolist()
        adaptive["mean"] = ea.mean_over_tasks([adaptive[g] for g in groups], depth)
    calibrated_on = "mean" if ogbench else "train"
    calibration = ea.calibrate(adaptive[calibrated_on], elasticity[calibrated_on][-1], 0.99)
    index = list(eps_grid).index(calibration["eps"])
    calibration.update(calibrated_on=calibrated_on, results={g: {**rows[index], "full_depth_success": elasticity[g][-1]}
                                                             for g, rows in adaptive.items()})
    calibration["warning"] = ea.calibration_warning(calibration)
    bins = {}
    if depth > 2:
        for g in groups:
            delta = np.logspace(-4, -1, 10) * rng.uniform(0.8, 1.2, 10)
            bins[g] = [{"bin": b, "fraction": 0.1, "delta_mean": float(d), "endpoint_mean": float(3 * d)}
                       for b, d in enumerate(delta)]
    trace = {}
    grid = envs.make_vec("BoxPick-Exact-4-v0", 1, seed=seed).unwrapped
    grid.reset()
    for g in groups:
        trace[g] = {"eps": calibration["eps"], "depths": rng.integers(k_min + 1, depth + 1, 100).tolist(),
                    "episode_success": 1.0}
        if env_id.startswith("BoxPick"):
            trace[g].update(grids=grid.grid.repeat(100, 1).tolist(), goal=grid.goal[0].tolist())
    return {"label": label, "path": f"{label}.pt", "algorithm": "fake", "env_id": env_id, "depth": depth,
            "k_min": k_min, "eps_grid": list(eps_grid), "elasticity": elasticity, "adaptive": adaptive,
            "calibration": calibration, "analysis": {"bins": bins}, "trace": trace,
            "episodes": {g: 128 * (len(groups) if g == "mean" else 1) for g in elasticity}}


def tick_labels(axis):
    """The labels of the major ticks inside the axis's view."""
    low, high = sorted(axis.get_view_interval())
    span = high - low
    return [label.get_text() for loc, label in zip(axis.get_majorticklocs(), axis.get_majorticklabels())
            if low - 1e-9 * span <= loc <= high + 1e-9 * span and label.get_text()]


def check_figures(evaluations, tmp_path, caplog, trace_frames=20):
    """Every figure builds and saves without a matplotlib warning; every plotting axes has axis labels and at
    least two labelled ticks per axis; pictures and messages are marked; Pareto eps labels never overlap."""
    import logging
    import warnings

    import matplotlib.pyplot as plt
    args = ea.Args(checkpoints=("x.pt",), trace_frames=trace_frames)
    with warnings.catch_warnings(), caplog.at_level(logging.WARNING, logger="matplotlib"):
        warnings.simplefilter("error")
        figures = ea.build_figures(evaluations, args, plt)
        for name, fig in figures.items():
            fig.savefig(tmp_path / name, dpi=ea.DPI)
    assert not [r for r in caplog.records if r.name.startswith("matplotlib")]
    for name, fig in figures.items():
        assert (tmp_path / name).stat().st_size > 5000, name
        for ax in fig.axes:
            if not ax.get_visible() or ax.get_label() == "picture":
                continue
            if ax.get_label() == "message":  # a panel that says in words why it has no data
                assert "nothing to show" in " ".join(t.get_text() for t in ax.texts), name
                continue
            assert ax.get_xlabel() and ax.get_ylabel(), (name, ax.get_title())
            for axis in (ax.xaxis, ax.yaxis):
                assert len(tick_labels(axis)) >= 2, (name, ax.get_title(), axis.axis_name, tick_labels(axis))
            if name == "pareto.png":  # eps labels: some, and none overlapping another
                renderer = fig.canvas.get_renderer()
                assert ax.texts and overlaps([t.get_window_extent(renderer) for t in ax.texts]) == []
    return figures


def overlaps(boxes):
    return [(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:] if a.overlaps(b)]


@pytest.mark.parametrize("depth", [2, 5])
def test_ogbench_shaped_plots_wrap_read_and_label_eps_without_overlap(depth, tmp_path, caplog):
    import matplotlib.pyplot as plt
    tasks = ("task1", "task2", "task3", "task4", "task5")
    eps_grid = ea.EPS_GRIDS["ogbench-manipulation"]
    evaluations = [fake_evaluation(name, "cube-double-play-v0", depth, eps_grid, seed, groups=tasks)
                   for seed, name in enumerate(["IRU", "FlexLoop"])]
    figures = check_figures(evaluations, tmp_path, caplog)
    # 6 panels (5 tasks and their mean) wrap into 2 rows of 3, not one wide strip
    panels = [ax for ax in figures["elasticity.png"].axes if ax.get_visible()]
    assert len(panels) == 6 and len({round(ax.get_position().y0, 3) for ax in panels}) == 2
    for name in ("elasticity.png", "pareto.png"):
        for ax in figures[name].axes:
            if ax.get_visible():  # whole depths only: K = 2 shows 1 and 2, never 1.2
                assert tick_labels(ax.xaxis) == [str(k) for k in range(1, depth + 1)]
    assert sum(len(ax.texts) for ax in figures["pareto.png"].axes) >= 12  # most points still carry their eps
    analysis = figures["delta_vs_endpoint.png"].axes
    if depth == 2:  # nothing to show, said in words
        assert all(ax.get_label() == "message" and "K >= 3" in ax.texts[0].get_text() for ax in analysis)
    else:
        assert all(ax.get_xscale() == "log" and len(tick_labels(ax.xaxis)) >= 3 for ax in analysis)
    plt.close("all")


def test_boxpick_shaped_plots_separate_traces_and_explain_the_symbols(tmp_path, caplog):
    import matplotlib.pyplot as plt
    evaluations = [fake_evaluation(name, "BoxPick-Exact-4-v0", 5, ea.EPS_GRIDS["boxpick"], seed)
                   for seed, name in enumerate(["IRU-5", "FlexLoop", "Self-TD Only"])]
    figures = check_figures(evaluations, tmp_path, caplog)
    traces = [ax for ax in figures["depth_trace.png"].axes if ax.get_visible()]
    assert len(traces) == 6 and all(len(ax.lines) == 1 for ax in traces)  # train and unseen never share a panel
    strip = figures["strip_FlexLoop_unseen.png"]
    legend_text = " ".join(t.get_text() for t in strip.legends[0].get_texts())
    for symbol in ("target cell", "box", "box on a target", "agent", "agent on a box", "agent carrying a box"):
        assert symbol in legend_text
    plt.close("all")


def test_narrow_log_ranges_get_several_tick_labels():
    for low, high in [(1e-3, 1.3e-3), (0.011, 0.029), (2e-5, 3e-1), (0.5, 0.5000001)]:
        ticks, lo, hi = ea.log_ticks(low, high)
        assert len([t for t in ticks if lo <= t <= hi]) >= 2 and lo <= low and hi >= high


def test_mean_depth_at_matched_success_reads_the_cheapest_row_within_one_standard_error():
    iru = fake_evaluation("IRU-5", "LightsOut-4x5-v0", 5, (0.0, 0.01, 0.02, 0.05), 0)
    flexloop = fake_evaluation("FlexLoop", "LightsOut-4x5-v0", 5, (0.0, 0.01, 0.02, 0.05), 1)
    iru["elasticity"]["train"][-1] = 0.64  # 128 episodes: one standard error is 0.0424
    rows = [(0.0, 0.70, 5.0), (0.01, 0.60, 3.2), (0.02, 0.59, 2.9), (0.05, 0.20, 2.0)]
    flexloop["adaptive"]["train"] = [{"eps": e, "success": p, "mean_depth": d, "ideal_speedup": 5 / d}
                                     for e, p, d in rows]
    iru["elasticity"]["unseen"][-1] = 0.5
    flexloop["adaptive"]["unseen"] = [{"eps": e, "success": 0.3, "mean_depth": d, "ideal_speedup": 5 / d}
                                      for e, _, d in rows]
    matched = {(r["label"], r["split"]): r for r in ea.matched_success([iru, flexloop])}
    train = matched["FlexLoop", "train"]
    assert train["floor"] == pytest.approx(0.64 - math.sqrt(0.64 * 0.36 / 128))
    assert (train["eps"], train["success"], train["mean_depth"]) == (0.01, 0.60, 3.2)  # 0.59 < floor 0.5976
    assert matched["FlexLoop", "unseen"]["eps"] is None  # no row reaches it: said, not guessed
    assert matched["IRU-5", "train"]["reference"] == "IRU-5"
    text = ea.summary_tables([iru, flexloop], [])
    assert "mean depth at matched success" in text and "not reached" in text and "3.20" in text


def test_printed_tables_and_calibration_warning(capsys):
    good = fake_evaluation("FlexLoop", "LightsOut-4x5-v0", 5, ea.EPS_GRIDS["lightsout"], 0)
    failing = fake_evaluation("IRU-5", "LightsOut-4x5-v0", 5, ea.EPS_GRIDS["lightsout"], 1)
    for rows in failing["elasticity"].values():
        rows[:] = [0.0] * len(rows)
    failing["calibration"]["full_depth_success"] = 0.0
    failing["calibration"]["warning"] = ea.calibration_warning(failing["calibration"])
    assert good["calibration"]["warning"] is None and "meaningless" in failing["calibration"]["warning"]
    text = ea.summary_tables([good, failing], [])
    assert "{" not in text and "k=5" in text and "<- calibrated eps*" in text
    assert "WARNING IRU-5" in text and "calibration is meaningless" in text and "WARNING FlexLoop" not in text
    assert max(len(line) for line in text.splitlines()) <= 120


@pytest.fixture(scope="module")
def k2_gcdqn_checkpoint(tmp_path_factory):
    """A K = 2 gcdqn checkpoint: no depths 2..K-1 to analyse, and no depth below K can stop at k_min = 1."""
    args = gcdqn.Args(num_envs=8, batch_size=8, updates_per_rollout=2, intervals_per_epoch=1, pretrain_epochs=1,
                      num_epochs=1, hidden_dim=16, depth=2, eval_every=1, num_eval_envs=4, log_every=1, save_every=1,
                      episode_length=10, replay_episodes=2, cuda=False, run_dir=str(tmp_path_factory.mktemp("runs")))
    return (gcdqn.train(args) / "final.pt",)


@pytest.fixture(scope="module")
def gcppo_checkpoints(tmp_path_factory):
    import flexloop_gcppo as gcppo
    args = gcppo.Args(cuda=False, num_envs=8, num_steps=8, num_minibatches=2, update_epochs=2, depth=3, hidden_dim=16,
                      pretrain_timesteps=128, total_timesteps=128, num_eval_envs=4, eval_every=1, save_every=1,
                      run_dir=str(tmp_path_factory.mktemp("runs")))
    run_dir = gcppo.train(args)
    return run_dir / "pretrained.pt", run_dir / "final.pt"


@pytest.mark.parametrize("which", ["checkpoints", "k2_gcdqn_checkpoint", "gcppo_checkpoints"])
def test_every_plot_of_real_checkpoints_reads(which, request, tmp_path, caplog, capsys):
    """gcdqn K = 5 and K = 2 and gcppo through main(); then every figure of its results.json is checked (OGBench
    layouts: the fake-evaluation tests above, since CPU MuJoCo episodes are too slow for the suite)."""
    import matplotlib.pyplot as plt
    checkpoints = request.getfixturevalue(which)
    out_dir = ea.main(ea.Args(checkpoints=tuple(str(p) for p in checkpoints), num_eval_envs=8, trace_frames=6,
                              out_dir=str(tmp_path / "out"), cuda=False))
    printed = capsys.readouterr().out
    results = json.loads((out_dir / "results.json").read_text())
    evaluations = results["checkpoints"]
    check_figures(evaluations, tmp_path, caplog, trace_frames=6)
    plt.close("all")
    assert "{" not in printed and "success at each fixed depth" in printed and "adaptive inference" in printed
    for ev in evaluations:
        calibration = ev["calibration"]
        assert calibration["meaningful"] == (calibration["full_depth_success"] > 0)
        if not calibration["meaningful"]:  # full-depth success 0: said in results.json and on the terminal
            assert "calibration is meaningless" in calibration["warning"]
            assert any(w.startswith(ev["label"]) for w in results["warnings"])
            assert f"WARNING {ev['label']}:" in printed
    if which == "k2_gcdqn_checkpoint":
        assert "no row can stop before depth K" in printed


def test_wandb_gets_every_table_with_its_rows(monkeypatch, tmp_path):
    """log_to_wandb, with a stand-in wandb module: one run, every table (matched success included) with rows."""
    import types
    logged = {}

    class Table:
        def __init__(self, columns, data):
            self.columns, self.data = columns, data

    class Run:
        def log(self, values):
            logged.update(values)

        def finish(self):
            logged["finished"] = True

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run(), Table=Table,
                                                                      Image=lambda path: path))
    evaluations = [fake_evaluation(name, "LightsOut-4x5-v0", 5, ea.EPS_GRIDS["lightsout"], seed)
                   for seed, name in enumerate(["IRU-5", "FlexLoop"])]
    ea.log_to_wandb(ea.Args(checkpoints=("a.pt",)), "run", tmp_path, evaluations, [], [])
    assert logged.pop("finished")
    assert set(logged) == {"eval/elasticity", "eval/adaptive", "eval/calibration", "eval/matched_success"}
    matched = logged["eval/matched_success"]
    assert len(matched.data) == 2 * 2 and matched.columns[:2] == ["checkpoint", "split"]
    assert len(logged["eval/adaptive"].data) == 2 * 2 * len(ea.EPS_GRIDS["lightsout"])


def test_stress_test_of_non_boxpick_checkpoints_is_skipped_and_said(gcppo_checkpoints, tmp_path, capsys):
    """The stress test drives BoxPick envs; LightsOut checkpoints are named as skipped, with no timing rows."""
    out_dir = ea.main(ea.Args(checkpoints=tuple(str(p) for p in gcppo_checkpoints), skip_eval=True, stress_envs=(8,),
                              stress_eps=0.02, out_dir=str(tmp_path / "out"), cuda=False))
    assert "stress test: skipped; it drives BoxPick checkpoints, and these are on LightsOut-4x5-v0" in \
        capsys.readouterr().out
    assert json.loads((out_dir / "results.json").read_text())["stress"]["results"] == []
