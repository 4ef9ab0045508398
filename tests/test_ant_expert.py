"""envs/ant_expert.py: SAC learns on an easy task, resumes exactly, runs on the ant, and fails clearly. CPU."""

import dataclasses
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium
import numpy as np
import pytest
import torch

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
