"""envs/ant_expert.py: SAC learns on an easy task, resumes exactly, runs on the ant, and fails clearly (CPU); the
update the CUDA graph replays is the eager update (CPU, and on a GPU when there is one)."""

import copy
import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

import flexloop_run

pytest.importorskip("ogbench")

from envs import ant_expert as ae  # noqa: E402
from envs import ogbench_data as od  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class DirectionBandit(gymnasium.Env):
    """The ant's reward without the ant: observe a unit direction z, act a in [-1, 1]^2, get a . z, done."""

    observation_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float64)
    action_space = gymnasium.spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        angle = self.np_random.uniform(0, 2 * np.pi)
        self.z = np.array([np.cos(angle), np.sin(angle)])
        return self.z.copy(), {}

    def step(self, action):
        return self.z.copy(), float(np.dot(action, self.z)), True, False, {}


BANDIT = "DirectionBandit-test-v0"
if BANDIT not in gymnasium.registry:
    gymnasium.register(BANDIT, entry_point=DirectionBandit)


def _bandit_args(tmp_path, **kw):
    base = dict(env_id=BANDIT, total_steps=900, learning_starts=150, batch_size=64, lr=1e-3, hidden_dims=(64, 64),
                run_dir=str(tmp_path / "run"), expert_path=str(tmp_path / "expert.pt"), log_every=10_000, seed=3)
    base.update(kw)
    return ae.TrainArgs(**base)


def _mean_progress(actor, n=500):
    angles = torch.linspace(0, 2 * np.pi, n)
    z = torch.stack([torch.cos(angles), torch.sin(angles)], dim=1)
    return (actor.act(z) * z).sum(1).mean().item()


@pytest.mark.slow  # about 10 s on a shared 2-core CPU
def test_sac_learns_the_direction_bandit(tmp_path):
    torch.manual_seed(0)
    untrained = ae.Actor(2, 2, (64, 64))
    assert abs(_mean_progress(untrained)) < 0.1  # the 0.01-scaled last layer starts near a = 0

    actor = ae.train(_bandit_args(tmp_path))
    # the best action in [-1, 1]^2 scores |z|_1 (mean 4/pi ~ 1.27 over directions); moving along z scores 1
    assert _mean_progress(actor) > 0.5
    loaded, info = ae.load_expert(str(tmp_path / "expert.pt"))
    assert info["env_steps"] == 900 and info["obs_dim"] == 2 and info["action_dim"] == 2
    z = torch.randn(16, 2)
    assert torch.equal(loaded.act(z), actor.act(z))


def test_resume_and_max_minutes_continue_the_same_run(tmp_path, capsys):
    small = dict(learning_starts=50, batch_size=32, hidden_dims=(32, 32))
    straight = ae.train(_bandit_args(tmp_path / "a", total_steps=200, **small))

    ae.train(_bandit_args(tmp_path / "b", total_steps=120, **small))
    assert ae.train(_bandit_args(tmp_path / "b", total_steps=200, max_minutes=0.0, **small)) is None
    out = capsys.readouterr().out
    assert "resuming" in out and "stopped (--max-minutes 0.0) at step 121" in out
    resumed = ae.train(_bandit_args(tmp_path / "b", total_steps=200, **small))
    assert "resuming" in capsys.readouterr().out

    # 1-step episodes: every save falls between episodes, so the pieces add up to the straight run, bit for bit
    for (name, p), q in zip(straight.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(p, q), name
    state = torch.load(tmp_path / "b" / "run" / "state.pt", weights_only=True)
    assert state["global_step"] == 200 and state["buffer"]["rewards"].shape == (200,)
    with pytest.raises(SystemExit, match="hidden dims"):  # a run is resumed with its own network, or not at all
        ae.train(_bandit_args(tmp_path / "b", total_steps=300, learning_starts=50, hidden_dims=(16,)))


def test_a_state_saved_on_cuda_resumes_on_the_cpu(tmp_path, capsys):
    """A CUDA run saves Adam as fused and capturable, its step counts as float32 tensors; the CPU resumes it with
    its own flags (a capturable Adam refuses CPU parameters)."""
    small = dict(learning_starts=50, batch_size=32, hidden_dims=(32, 32))
    ae.train(_bandit_args(tmp_path, total_steps=120, **small))
    path = tmp_path / "run" / "state.pt"
    state = torch.load(path, weights_only=True)
    state["optimizer"]["param_groups"][0].update(foreach=False, fused=True, capturable=True)
    for adam in state["optimizer"]["state"].values():
        adam["step"] = adam["step"].float()
    torch.save(state, path)
    ae.train(_bandit_args(tmp_path, total_steps=200, **small))
    assert "resuming" in capsys.readouterr().out
    state = torch.load(path, weights_only=True)
    assert state["global_step"] == 200 and state["optimizer"]["param_groups"][0]["capturable"] is False
    assert state["optimizer"]["state"][0]["step"].item() == 200 - 50 + 1


def test_ant_train_and_evaluate_smoke(tmp_path):
    args = ae.TrainArgs(total_steps=40, learning_starts=20, batch_size=16, hidden_dims=(32, 32),
                        run_dir=str(tmp_path / "run"), expert_path=str(tmp_path / "expert.pt"), log_every=20)
    assert ae.main(["train", "--total-steps", "40", "--learning-starts", "20", "--batch-size", "16",
                    "--hidden-dims", "32", "32", "--run-dir", args.run_dir, "--expert-path", args.expert_path,
                    "--log-every", "20"]) == 0
    env = ae.make_env("online-ant-xy-v0")
    assert env.observation_space.shape == (29,) and env.action_space.shape == (8,)  # 27 ant + the direction z
    _, info = ae.load_expert(args.expert_path)
    assert info["env_id"] == "online-ant-xy-v0" and info["obs_dim"] == 29 and info["action_dim"] == 8
    result = ae.evaluate(ae.EvaluateArgs(expert_path=args.expert_path, episodes=1))
    assert np.isfinite(result["speed_mean"]) and result["episodes"] == 1
    assert od.main(["check", "--env", "antmaze-medium-stitch-v0", "--episodes", "2", "--expert",
                    args.expert_path]) == 0


@pytest.mark.slow  # a fresh interpreter imports torch, mujoco and ogbench
def test_sigterm_saves_and_stops(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "envs.ant_expert", "train", "--total-steps", "1000000", "--learning-starts", "50",
         "--batch-size", "8", "--hidden-dims", "16", "16", "--log-every", "25", "--run-dir", str(run_dir),
         "--expert-path", str(tmp_path / "expert.pt")],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        for line in proc.stdout:  # wait until it is updating
            if line.startswith("step 100/"):
                break
        proc.send_signal(signal.SIGTERM)
        out = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 0 and "stopped (SIGTERM)" in out, out
    state = torch.load(run_dir / "state.pt", weights_only=True)
    assert 100 <= state["global_step"] < 1_000_000
    assert not (tmp_path / "expert.pt").exists()  # the expert is written only when training is done


def test_sac_losses_match_the_recipe():
    torch.manual_seed(0)
    actor, critic = ae.Actor(3, 2, (8,)), ae.TwinCritic(3, 2, (8,))
    batch = {"observations": torch.randn(5, 3), "actions": torch.rand(5, 2) * 2 - 1, "rewards": torch.randn(5),
             "next_observations": torch.randn(5, 3), "masks": torch.tensor([1.0, 1, 0, 1, 1])}
    log_alpha = torch.tensor(0.3, requires_grad=True)
    losses = ae.sac_losses(batch, actor, critic, critic, log_alpha, 0.99, -1.0)
    # the actor's loss sends no gradient into the critic, the critic's none into the actor
    losses["actor_loss"].backward(retain_graph=True)
    assert all(p.grad is None for p in critic.parameters()) and actor.mean.weight.grad is not None
    actor.zero_grad(set_to_none=True)
    losses["critic_loss"].backward()
    assert all(p.grad is None for p in actor.parameters())
    # squashed-Gaussian log-probabilities agree with torch.distributions
    mean, log_std = actor(batch["observations"])
    torch.manual_seed(1)
    a, logp = actor.sample(batch["observations"])
    dist = torch.distributions.TransformedDistribution(
        torch.distributions.Normal(mean, log_std.exp()), [torch.distributions.TanhTransform(cache_size=1)])
    assert torch.allclose(logp, dist.log_prob(a).sum(-1), atol=1e-3)
    assert (a.abs() < 1).all()


def test_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m envs.ant_expert train --device cuda"):
        ae.load_expert(str(tmp_path / "missing.pt"))
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="could not read"):
        ae.load_expert(str(junk))
    torch.save({"format": "something else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an ant expert"):
        ae.load_expert(str(tmp_path / "other.pt"))
    assert ae.main(["evaluate", "--expert-path", str(tmp_path / "missing.pt")]) == 2
    with pytest.raises(SystemExit, match="must be >= 1"):
        ae.train(dataclasses.replace(_bandit_args(tmp_path), batch_size=0))
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees none; use --device cpu"):
            ae.train(_bandit_args(tmp_path, device="cuda"))


# ---------------------------------------------------------------------------------------------------------------
# The update as the loop runs it (make_update_step, captured on CUDA) against the eager `update`
# ---------------------------------------------------------------------------------------------------------------


def _learner(device, adam_flags, obs_dim=5, action_dim=3, hidden_dims=(16, 16), seed=0):
    """Networks, temperature and Adam as train() builds them, plus a replay of 300 random transitions."""
    torch.manual_seed(seed)
    actor = ae.Actor(obs_dim, action_dim, hidden_dims).to(device)
    critic = ae.TwinCritic(obs_dim, action_dim, hidden_dims).to(device)
    critic_target = ae.TwinCritic(obs_dim, action_dim, hidden_dims).to(device)
    critic_target.load_state_dict(critic.state_dict())
    log_alpha = torch.zeros((), device=device, requires_grad=True)
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters(), log_alpha], lr=1e-2, **adam_flags)
    buffer = ae.ReplayBuffer(1000, obs_dim, action_dim, torch.device(device))
    _add_random(buffer, 300, np.random.default_rng(seed))
    return (actor, critic, critic_target), log_alpha, optimizer, buffer


def _add_random(buffer, n, rng):
    obs_dim, action_dim = buffer.data["observations"].shape[1], buffer.data["actions"].shape[1]
    for _ in range(n):
        buffer.add(rng.normal(size=obs_dim), rng.uniform(-1, 1, action_dim), rng.normal(),
                   rng.normal(size=obs_dim), float(rng.random() < 0.9))


def _tensors(nets, log_alpha, optimizer):
    """Every number an update changes: parameters, targets, temperature, Adam's moments and step counts."""
    out = {f"{i}.{name}": p for i, net in enumerate(nets) for name, p in net.state_dict().items()}
    out["log_alpha"] = log_alpha
    for i, p in enumerate(optimizer.param_groups[0]["params"]):
        for k, v in optimizer.state.get(p, {}).items():
            out[f"adam.{i}.{k}"] = v
    return {k: v.detach().float().cpu().clone() for k, v in out.items()}


def test_replay_rows_hold_the_transition_and_resume_in_order():
    buffer = ae.ReplayBuffer(4, 2, 1, torch.device("cpu"))
    for t in range(6):  # wraps around: the last 4 are kept
        buffer.add(np.array([t, -t]), np.array([0.5 * t]), 10.0 + t, np.array([t + 1, -t - 1]), float(t % 2))
    assert buffer.size == 4 and int(buffer.filled) == 4
    state = buffer.state_dict()
    assert state["rewards"].tolist() == [12.0, 13.0, 14.0, 15.0] and state["masks"].tolist() == [0.0, 1.0, 0.0, 1.0]
    assert state["observations"][:, 0].tolist() == [2, 3, 4, 5] and state["actions"][:, 0].tolist() == [1, 1.5, 2, 2.5]
    assert state["next_observations"][:, 1].tolist() == [-3, -4, -5, -6]
    resumed = ae.ReplayBuffer(10, 2, 1, torch.device("cpu"))
    resumed.load_state_dict(state)
    assert resumed.size == 4 and int(resumed.filled) == 4
    assert all(torch.equal(resumed.state_dict()[k], v) for k, v in state.items())
    batch = resumed.sample(500, torch.Generator().manual_seed(0))  # only the 4 filled rows, each of them
    assert sorted(set(batch["rewards"].tolist())) == [12.0, 13.0, 14.0, 15.0]
    assert batch["observations"].shape == (500, 2) and batch["rewards"].shape == (500,)


@pytest.mark.parametrize("adam", ["foreach", "fused"])
def test_update_step_is_the_eager_update_on_the_same_batch(adam):
    """make_update_step (what the CUDA graph records) from the same state and the same batch gives the parameters
    that `update` gives with today's eager Adam (foreach); with the fused Adam of the CUDA path, to float noise."""
    eager_nets, eager_alpha, eager_opt, buffer = _learner("cpu", {"foreach": True})
    nets, log_alpha, optimizer, _ = _learner("cpu", {"foreach": adam == "foreach", "fused": adam == "fused"})
    args = ae.TrainArgs(batch_size=64)
    loss_sums = torch.zeros(len(ae.LOSS_NAMES))
    generator = torch.Generator().manual_seed(5)
    step = ae.make_update_step(args, nets, log_alpha, optimizer, buffer, generator, -1.5, loss_sums)
    eager_sums = torch.zeros(len(ae.LOSS_NAMES))
    start = _tensors(eager_nets, eager_alpha, eager_opt)
    for i in range(3):
        draws = torch.randint(2**62, (64,), generator=copy.deepcopy(generator))
        batch = {k: v[draws % buffer.size] for k, v in buffer.data.items()}
        torch.manual_seed(100 + i)  # the actor's noise
        losses = ae.update(batch, *eager_nets, eager_alpha, eager_opt, args, -1.5)
        eager_sums += torch.stack([losses[name].detach() for name in ae.LOSS_NAMES])
        torch.manual_seed(100 + i)
        step()
        _add_random(buffer, 50, np.random.default_rng(i))  # the size the next batch is drawn from grows
    eager, stepped = _tensors(eager_nets, eager_alpha, eager_opt), _tensors(nets, log_alpha, optimizer)
    assert eager.keys() == stepped.keys() and "adam.0.exp_avg" in eager
    assert not torch.equal(eager["0.trunk.0.weight"], start["0.trunk.0.weight"])  # it did learn something
    for name in eager:
        if adam == "foreach":
            assert torch.equal(eager[name], stepped[name]), name
        else:
            assert torch.allclose(eager[name], stepped[name], rtol=1e-4, atol=1e-6), name
    assert torch.allclose(loss_sums, eager_sums, rtol=1e-4, atol=1e-6)


def test_capture_undoes_its_warm_up_updates(monkeypatch):
    """capture_update's warm-up calls are real updates; it puts every number back, so the first replay is the
    run's first update. Here a stand-in for the capture helper runs the warm-ups and returns fn uncaptured."""
    def warm_up_only(fn, generators):
        for _ in range(flexloop_run.CUDA_GRAPH_WARMUP):
            fn()
        return fn

    monkeypatch.setattr(flexloop_run, "capture_cuda_graph", warm_up_only)
    args = ae.TrainArgs(batch_size=32)
    nets, log_alpha, optimizer, buffer = _learner("cpu", {"foreach": True})
    for resumed in (False, True):  # Adam's state created by the warm-ups, then Adam's state from earlier updates
        before = _tensors(nets, log_alpha, optimizer)
        loss_sums = torch.zeros(len(ae.LOSS_NAMES))
        step = ae.make_update_step(args, nets, log_alpha, optimizer, buffer, torch.Generator(), -1.5, loss_sums)
        step = ae.capture_update(step, nets, log_alpha, optimizer, loss_sums, torch.Generator())
        after = _tensors(nets, log_alpha, optimizer)
        assert not torch.any(loss_sums)
        for name, value in after.items():
            assert torch.equal(value, before[name] if name in before else torch.zeros_like(value)), name
        step()
        step()
    # the warm-ups undone, the two captures' four updates take Adam's step count to 4, no more
    assert optimizer.state and all(s["step"].item() == 4 for s in optimizer.state.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_captured_update_and_action_match_the_eager_ones_on_cuda(exact_float32_matmuls):
    """On CUDA the captured update replays what the eager update_step does, from the same state and random draws:
    four replays, the replay growing between them (the graph must read its size at each replay, not at capture).
    The captured action is the eager action for the same observation and noise."""
    device = torch.device("cuda")
    flags = {"foreach": False, "fused": True, "capturable": True}  # as train() builds Adam on CUDA
    args = ae.TrainArgs(batch_size=64)
    sides = {}
    for name in ("eager", "graph"):
        nets, log_alpha, optimizer, buffer = _learner(device, flags)
        loss_sums = torch.zeros(len(ae.LOSS_NAMES), device=device)
        generator = torch.Generator(device).manual_seed(7)
        step = ae.make_update_step(args, nets, log_alpha, optimizer, buffer, generator, -1.5, loss_sums)
        if name == "graph":
            step = ae.capture_update(step, nets, log_alpha, optimizer, loss_sums, generator)
        sides[name] = (nets, log_alpha, optimizer, buffer, loss_sums, generator, step)
    start = _tensors(*sides["graph"][:3])
    for i in range(4):
        default_rng, batch_rng = torch.cuda.get_rng_state(device), sides["graph"][5].get_state()
        sides["graph"][6]()
        torch.cuda.set_rng_state(default_rng, device)  # the eager update draws what the replay drew
        sides["eager"][5].set_state(batch_rng)
        sides["eager"][6]()
        for name in ("eager", "graph"):
            _add_random(sides[name][3], 100, np.random.default_rng(i))
        eager, graph = _tensors(*sides["eager"][:3]), _tensors(*sides["graph"][:3])
        assert eager.keys() == graph.keys()
        for key in eager:
            assert torch.allclose(eager[key], graph[key], rtol=1e-4, atol=1e-5), (i, key)
    assert not torch.equal(graph["0.trunk.0.weight"], start["0.trunk.0.weight"])
    assert all(s["step"].item() == 4 for s in sides["graph"][2].state.values())  # the warm-ups were undone
    assert torch.allclose(sides["eager"][4], sides["graph"][4], rtol=1e-4, atol=1e-5)

    actor = sides["graph"][0][0]
    obs = np.random.default_rng(0).normal(size=5)
    eager_act = ae.make_policy(actor, 5, 3, device, graphed=False)
    graph_act = ae.make_policy(actor, 5, 3, device, graphed=True)
    rng = torch.cuda.get_rng_state(device)
    a = graph_act(obs)
    torch.cuda.set_rng_state(rng, device)
    assert np.allclose(a, eager_act(obs), atol=1e-5) and a.dtype == np.float32 and a.shape == (3,)
    assert not np.allclose(a, graph_act(obs))  # a fresh noise draw at each replay


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_training_learns_and_resumes_a_cpu_run(tmp_path, capsys):
    """train() on CUDA with its graphs: it continues a run saved on the CPU (Adam's flags and step counts move to
    the device) and still learns the bandit."""
    ae.train(_bandit_args(tmp_path, total_steps=300))
    actor = ae.train(_bandit_args(tmp_path, device="cuda"))
    assert "resuming" in capsys.readouterr().out
    assert _mean_progress(actor.cpu()) > 0.5
    state = torch.load(tmp_path / "run" / "state.pt", weights_only=True)
    assert state["global_step"] == 900 and state["buffer"]["rewards"].shape == (900,)
    assert ae.train(_bandit_args(tmp_path, total_steps=1000, max_minutes=0.0)) is None  # and back on the CPU


def test_the_committed_expert_walks_where_it_is_told():
    """checkpoints/ant_expert/expert.pt (400k env steps): three deterministic episodes of up to 1,000 steps on
    online-ant-xy-v0, the direction resampled every 100 steps. They must make over 1 m/s on average along their
    directions (1.53-1.59 m/s measured) and one must run to the end. Whether a given episode falls depends on the
    machine's floating point (the ant is chaotic): 0 of 10 fell where it was trained, 2 of 5 on a 2-core CPU."""
    assert Path(ae.DEFAULT_EXPERT_PATH).exists(), "the trained ant expert is committed"
    result = ae.evaluate(ae.EvaluateArgs(episodes=3))
    assert result["env_steps_trained"] == 400_000
    assert result["speed_mean"] > 1.0 and result["falls"] < 3
