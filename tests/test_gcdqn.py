"""flexloop_gcdqn.py: IRU equations, the FlexLoop KL, the TD target, relabelling, checkpoints, runs."""

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import flexloop_gcdqn as gcdqn
import flexloop_run
import iru_pretrain
from envs.boxpick import (AGENT, AGENT_ON_BOX, BOX, BOX_ON_TARGET, EMPTY, LEFT, PICK_UP, PUT_DOWN, RIGHT, TARGET, UP,
                          BoxPickVecEnv, goal_reached)

ROOT = Path(__file__).resolve().parent.parent

# A run small enough for a CPU in a few seconds.
TINY = dict(num_envs=16, batch_size=16, updates_per_rollout=3, intervals_per_epoch=2, pretrain_epochs=1, num_epochs=1,
            hidden_dim=16, eval_every=2, num_eval_envs=8, log_every=1, save_every=1, episode_length=10,
            replay_episodes=4, cuda=False)


def tiny_args(tmp_path, **overrides):
    return gcdqn.Args(**{**TINY, "run_dir": str(tmp_path), **overrides})


# ----- IRU equations -----

def hand_iru(network, obs, goal, action, variant):
    """The IRU of REFERENCE §1 for one critic and one (s, g, a), written out with plain tensors."""
    x = torch.cat([obs.float(), goal.float(), F.one_hot(torch.tensor(action), 6).float()])
    d = network.hidden_dim
    W, b = network.embed.weight[0], network.embed.bias[0, 0]
    x_emb = F.layer_norm(x @ W + b, (d,)) * network.embed_norm.weight[0, 0] + network.embed_norm.bias[0, 0]
    c, h = torch.zeros(d), torch.zeros(d)
    outs = []
    for _ in range(network.depth):
        carried = h if variant == "residual" else torch.tanh(c)
        z = F.layer_norm(torch.cat([x_emb, carried]), (2 * d,)) * network.gate_norm.weight[0, 0] + network.gate_norm.bias[0, 0]
        gates = z @ network.gates.weight[0] + network.gates.bias[0, 0]
        f, i = torch.sigmoid(gates[:d]), torch.tanh(gates[d:])
        c = f * c + (1 - f) * i
        h = h + torch.tanh(c)
        readout = h if variant == "residual" else c
        outs.append(readout @ network.head.weight[0, :, 0] + network.head.bias[0, 0, 0])
    return torch.stack(outs)


@pytest.mark.parametrize("variant", ["residual", "paper"])
def test_iru_matches_hand_computation(variant):
    torch.manual_seed(0)
    network = gcdqn.IRUNetwork(depth=3, hidden_dim=4, num_critics=2, variant=variant)
    with torch.no_grad():  # non-trivial norms, so a mistake in their use shows
        for p in network.parameters():
            p.add_(0.1 * torch.randn_like(p))
    obs = torch.randint(0, 12, (2, 36), dtype=torch.int8)
    goal = torch.randint(0, 12, (2, 36), dtype=torch.int8)
    q = network.all_depths(obs, goal)  # (K, E, B, A)
    assert q.shape == (3, 2, 2, 6)
    for row in range(2):
        for action in range(6):
            expected = hand_iru(network, obs[row], goal[row], action, variant)
            torch.testing.assert_close(q[:, 0, row, action], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backbone", ["iru", "lstm"])
def test_all_depths_reads_the_stacked_heads_as_each_depth_alone(backbone):
    """all_depths reads the head once over the K stacked states: the same Q and the same gradients as reading it
    after each step, for every action and for the taken action alone."""
    args = dataclasses.replace(gcdqn.Args(), depth=3, hidden_dim=8, backbone=backbone)
    network = gcdqn.build_network(args, torch.device("cpu"))
    obs, goal = torch.randint(0, 12, (5, 36)), torch.randint(0, 12, (5, 36))
    action = torch.randint(0, 6, (5,))
    weights = torch.randn(3, 2, 5, 6)  # a loss that weighs every depth, critic, row and action differently
    for taken in (None, action):
        def one_depth_at_a_time():
            state, q = network.start(obs, goal, taken), []
            for _ in range(network.depth):
                state = network.advance(state)
                q.append(network.q_values(state))
            return torch.stack(q)
        gradients = []
        for q_of in (lambda: network.all_depths(obs, goal, taken), one_depth_at_a_time):
            network.zero_grad()
            q = q_of()
            (q * weights[..., :q.shape[-1]]).sum().backward()
            gradients.append((q.detach(), [p.grad.clone() for p in network.parameters() if p.grad is not None]))
        (stacked, stacked_grads), (alone, alone_grads) = gradients
        assert stacked.shape == alone.shape == (3, 2, 5, 6 if taken is None else 1)
        torch.testing.assert_close(stacked, alone)
        assert len(stacked_grads) == len(alone_grads) > 0
        for a, b in zip(stacked_grads, alone_grads):
            torch.testing.assert_close(a, b)


def test_forget_gate_bias_starts_at_one():
    network = gcdqn.IRUNetwork(hidden_dim=8)
    assert torch.all(network.gates.bias[..., :8] == 1.0)


def test_depth_protocol_matches_all_depths():
    torch.manual_seed(1)
    network = gcdqn.IRUNetwork(depth=4, hidden_dim=8)
    obs, goal = torch.randint(0, 12, (5, 36)), torch.randint(0, 12, (5, 36))
    q = network.all_depths(obs, goal)
    state = network.start(obs, goal)
    for k in range(4):
        state = network.advance(state)
        torch.testing.assert_close(network.decide(state), q[k].mean(0) / network.policy_temperature)
    rows = torch.tensor([4, 1])
    gathered = network.gather(state, rows)
    torch.testing.assert_close(network.decide(gathered), network.decide(state)[rows])


@pytest.mark.parametrize("overrides", [{}, {"backbone": "lstm"}, {"obs_encoding": "onehot"}, {"iru_variant": "paper"}])
def test_the_acting_policy_traces_as_one_compiled_graph(overrides):
    """Training compiles network.policy_logits for collection on a GPU. fullgraph=True fails on any graph break (a host
    sync, a data-dependent branch), which would split the compiled step into pieces and recompile them."""
    args = dataclasses.replace(gcdqn.Args(), depth=3, hidden_dim=16, **overrides)
    network = gcdqn.build_network(args, torch.device("cpu"))
    obs, goal = torch.randint(0, 12, (5, 36)), torch.randint(0, 12, (5, 36))
    compiled = torch.compile(network.policy_logits, fullgraph=True, backend="eager")  # traced, not code-generated
    with torch.no_grad():
        torch.testing.assert_close(compiled(obs, goal, 3), network.policy_logits(obs, goal, 3), rtol=0, atol=0)


# ----- the FlexLoop KL -----

def test_depth_kl_direction_value_and_gradient():
    torch.manual_seed(2)
    q = torch.randn(3, 2, 4, 6, requires_grad=True)  # (K, E, B, A)
    loss = gcdqn.flexloop_depth_loss(q.mean(1) / 0.25)  # pi_k's logits: mean_E Q_k / tau
    # By hand: mean over k of KL(pi_{k+1} || pi_k), pi = softmax(mean_E Q / tau).
    pi = torch.softmax(q.detach().mean(1) / 0.25, -1)
    expected = torch.stack([(pi[k + 1] * (pi[k + 1].log() - pi[k].log())).sum(-1).mean() for k in range(2)]).mean()
    torch.testing.assert_close(loss, expected)
    reverse = torch.stack([(pi[k] * (pi[k].log() - pi[k + 1].log())).sum(-1).mean() for k in range(2)]).mean()
    assert not torch.isclose(loss, reverse)  # the direction matters, and this is the right one
    loss.backward()
    assert q.grad[-1].abs().sum() == 0  # the deepest policy is only ever a target
    assert q.grad[0].abs().sum() > 0 and q.grad[1].abs().sum() > 0


def test_depth_kl_is_zero_when_adjacent_depths_agree():
    q = torch.randn(1, 2, 4, 6).expand(5, -1, -1, -1)
    assert gcdqn.flexloop_depth_loss(q.mean(1) / 0.25).abs() < 1e-6


# ----- TD target -----

def test_td_target_uses_ensemble_mean_then_max():
    target_q_next = torch.tensor([[[1.0, 5.0, 0.0]], [[3.0, 1.0, 0.0]]])  # (E=2, B=1, A=3)
    # mean over critics: [2, 3, 0] -> max 3; y = 0.5 + 0.9 * 3
    torch.testing.assert_close(gcdqn.td_target(target_q_next, torch.tensor([0.5]), 0.9), torch.tensor([3.2]))


# ----- replay and relabelling -----

DIGITS = torch.tensor([EMPTY, BOX, TARGET, BOX_ON_TARGET])  # agent-free codes: the reward compares them as they are


def tag(values):
    """Two base-4 digits written as agent-free cell codes: a number up to 15, legal as a grid."""
    return DIGITS[torch.stack([values // 4 % 4, values % 4], -1)].to(torch.int8)


def untag(cells):
    digit = lambda c: (DIGITS[None] == c.long()[..., None]).long().argmax(-1)  # noqa: E731
    return digit(cells[..., 0]) * 4 + digit(cells[..., 1])


def filled_replay(num_envs=16, episodes=3, length=12):
    """Episodes whose every observation spells (env, episode, t) so samples can be traced back."""
    replay = gcdqn.TrajectoryReplay(num_envs, episodes, length, "cpu", 0.5, 0.99)
    for episode in range(episodes):
        obs = torch.zeros(num_envs, length + 1, 36, dtype=torch.int8)
        obs[:, :, 0:2] = tag(torch.arange(num_envs))[:, None]
        obs[:, :, 2] = DIGITS[episode]
        obs[:, :, 3:5] = tag(torch.arange(length + 1))
        replay.add(obs, torch.randint(0, 6, (num_envs, length), dtype=torch.int8), torch.full((num_envs,), length))
    return replay


def test_relabelled_goals_future_and_random():
    replay = filled_replay()
    generator = torch.Generator().manual_seed(0)
    offsets = []
    for _ in range(300):
        b = replay.sample(16, generator)
        assert len(set(b["env"].tolist())) == 16  # distinct envs
        future = b["use_future"]
        assert future.sum() == 8
        goal, obs = b["goal"].long(), b["obs"].long()
        assert torch.equal(untag(obs[:, 0:2]), b["env"]) and torch.equal(untag(obs[:, 3:5]), b["t"])
        # Future goals: same env, same episode, strictly later, within the episode.
        assert torch.equal(goal[future, :3], obs[future, :3])
        goal_t, obs_t = untag(goal[future, 3:5]), untag(obs[future, 3:5])
        assert (goal_t > obs_t).all() and (goal_t <= 12).all()
        assert torch.equal(goal_t - obs_t, b["offset"][future])
        # Random goals: another sample's current state.
        random_goals, all_obs = goal[~future], obs
        assert all(any(torch.equal(g, o) for o in all_obs) for g in random_goals[:4])
        assert not (random_goals == obs[~future]).all(1).any()
        offsets.append(b["offset"][future])
        # Rewards are recomputed against the relabelled goal with the env's rule.
        torch.testing.assert_close(b["reward"], goal_reached(b["next_obs"], b["goal"]))
        assert (b["reward"][future] == (b["offset"][future] == 1).float()).all()
    offsets = torch.cat(offsets)
    assert offsets.min() >= 1


def test_future_offsets_are_geometric_in_0_99():
    # Long episodes make truncation rare, so offsets follow P(j) = 0.01 * 0.99^(j-1).
    replay = gcdqn.TrajectoryReplay(1024, 1, 1000, "cpu", 1.0, 0.99)
    replay.add(torch.zeros(1024, 1001, 36, dtype=torch.int8), torch.zeros(1024, 1000, dtype=torch.int8),
               torch.full((1024,), 1000))
    replay.lengths[:] = 1000
    generator = torch.Generator().manual_seed(1)
    offsets = []
    for _ in range(40):
        b = replay.sample(1024, generator)
        keep = b["t"] < 300  # at least 700 steps left: truncation changes little
        offsets.append(b["offset"][keep])
    offsets = torch.cat(offsets).float()
    assert abs(offsets.mean().item() - 100) < 6  # geometric mean 1 / (1 - 0.99)
    p1 = (offsets == 1).float().mean().item()
    assert abs(p1 - 0.01) < 0.004
    ratio = ((offsets > 50) & (offsets <= 100)).float().sum() / ((offsets >= 1) & (offsets <= 50)).float().sum()
    assert abs(ratio.item() - 0.99 ** 50) < 0.06


def test_future_goal_never_crosses_an_episode_boundary():
    replay = gcdqn.TrajectoryReplay(32, 2, 10, "cpu", 1.0, 0.5)
    obs = torch.zeros(32, 11, 36, dtype=torch.int8)
    obs[:, :, 3:5] = tag(torch.arange(11))
    for _ in range(2):
        replay.add(obs, torch.zeros(32, 10, dtype=torch.int8), torch.full((32,), 6))  # only 6 valid steps
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        b = replay.sample(32, generator)
        assert (b["t"] < 6).all() and (untag(b["goal"][:, 3:5]) <= 6).all()


@pytest.mark.parametrize("window", [10, 100])
def test_a_future_goal_window_caps_offsets_as_the_references_replay_does(window):
    """--future-goal-window W: a future goal also stays inside a window of W stored steps at a uniform place p of the
    sample (offset <= W - 1 - p); each cap 1..W-1 is equally likely, so with a nearly flat discount the mean offset
    is about half that of a window-free draw."""
    replay = gcdqn.TrajectoryReplay(1024, 1, 1000, "cpu", 1.0, 0.9999, future_goal_window=window)
    replay.add(torch.zeros(1024, 1001, 36, dtype=torch.int8), torch.zeros(1024, 1000, dtype=torch.int8),
               torch.full((1024,), 1000))
    generator = torch.Generator().manual_seed(4)
    batches = [replay.sample(1024, generator) for _ in range(20)]
    offsets = torch.cat([b["offset"] for b in batches]).float()
    assert offsets.min() >= 1 and offsets.max() <= window - 1
    # Far from the episode's end only the window caps: c uniform on 1..W-1, and with a flat discount the offset is
    # uniform on 1..c, so its mean is (E[c] + 1) / 2 = (W / 2 + 1) / 2.
    far = torch.cat([b["offset"][b["t"] < 1000 - window] for b in batches]).float()
    assert abs(far.mean().item() - (window / 2 + 1) / 2) < 0.03 * window


def test_the_future_goal_window_must_be_off_or_at_least_2(tmp_path):
    with pytest.raises(ValueError, match="--future-goal-window must be 0"):
        gcdqn.train(tiny_args(tmp_path, future_goal_window=1))
    assert not any(tmp_path.iterdir())


def test_evaluation_plays_the_same_tasks_at_every_depth_and_every_call(monkeypatch):
    """Training's evaluation reseeds each split's env and sampler before every depth: the depths are compared on
    the same episodes' starts, and one evaluation on the next (the splits draw different tasks)."""
    args = dataclasses.replace(gcdqn.Args(), depth=3, hidden_dim=16, num_envs=8, num_eval_envs=16, episode_length=5)
    network = gcdqn.build_network(args, torch.device("cpu"))
    _, eval_envs = gcdqn.make_envs(args, torch.device("cpu"))
    starts, run_episode = [], gcdqn.run_episode

    def recording_run_episode(*call_args, **call_kwargs):
        episode = run_episode(*call_args, **call_kwargs)
        starts.append(episode[0][:, 0])  # each env's first observation
        return episode

    monkeypatch.setattr(gcdqn, "run_episode", recording_run_episode)
    first = gcdqn.evaluate(network, eval_envs, seed=7)
    second = gcdqn.evaluate(network, eval_envs, seed=7)
    assert len(starts) == 2 * 2 * args.depth  # two calls x two splits x K depths
    for call in range(2):
        for split in range(2):
            for depth in range(args.depth):
                assert torch.equal(starts[(call * 2 + split) * args.depth + depth], starts[split * args.depth])
    assert not torch.equal(starts[0], starts[args.depth])  # train and unseen tasks
    assert all(torch.equal(first[name], second[name]) for name in first)
    gcdqn.evaluate(network, eval_envs, seed=8)
    assert not torch.equal(starts[-1], starts[args.depth])  # another seed, other tasks


def test_goal_reached_ignores_the_agent():
    grid = torch.zeros(36, dtype=torch.int8)
    grid[0], grid[5] = BOX, AGENT
    goal = torch.zeros(36, dtype=torch.int8)
    goal[0], goal[9] = AGENT_ON_BOX, EMPTY
    assert goal_reached(grid[None], goal[None]).item() == 1.0
    goal[0], goal[1] = AGENT, BOX
    assert goal_reached(grid[None], goal[None]).item() == 0.0


def test_cells_changed_counts_moved_boxes_not_agent_steps():
    """The exploration metric: 2 for a box carried to another cell, 1 for a box still carried at the end, 0 for an
    agent that only walks; read at each episode's own length."""
    grid = torch.zeros(3, 36, dtype=torch.long)
    grid[:, 1], grid[:, 3] = BOX, TARGET
    env = BoxPickVecEnv(3, variant="Generalize-1-1", seed=0)
    obs, _ = env.reset(options={"grid": grid, "agent_pos": torch.zeros(3, dtype=torch.long)})
    plans = [[RIGHT, PICK_UP, RIGHT, RIGHT, PUT_DOWN], [RIGHT, RIGHT, LEFT, PUT_DOWN, PUT_DOWN],
             [RIGHT, PICK_UP, PUT_DOWN, PICK_UP, UP]]
    observations = [obs["observation"]]
    for t in range(5):
        obs, *_ = env.step(torch.tensor([plan[t] for plan in plans]))
        observations.append(obs["observation"])
    observations = torch.stack(observations, 1)
    assert gcdqn.cells_changed(observations, torch.full((3,), 5)).tolist() == [2, 0, 1]
    # Read at each episode's own end: before its PUT_DOWN, env 0 still carries the box (1 cell changed).
    assert gcdqn.cells_changed(observations, torch.tensor([4, 5, 0])).tolist() == [1, 0, 0]


# ----- bad flags -----

@pytest.mark.parametrize("overrides,match", [
    (dict(depth=1), "--depth"),
    (dict(lambda_depth=-1.0), "--lambda-depth"),
    (dict(batch_size=32, num_envs=16), "--batch-size"),
    (dict(env_id="BoxPick-Exact-9-v0"), "--env-id"),
    (dict(num_envs=0), "--num-envs"),
    (dict(policy_temperature=0.0), "--policy-temperature"),
    (dict(pretrain_epochs=0, num_epochs=0), "nothing to train"),
])
def test_bad_flags_fail_before_work(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        gcdqn.train(tiny_args(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())  # nothing was started


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_require_cuda_without_gpu(tmp_path):
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        gcdqn.train(tiny_args(tmp_path, require_cuda=True))


# ----- runs, checkpoints, resume -----

def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_smoke_run_writes_checkpoints_and_per_depth_metrics(tmp_path):
    run_dir = gcdqn.train(tiny_args(tmp_path))
    assert {p.name for p in run_dir.iterdir()} >= {"pretrained.pt", "latest.pt", "final.pt", "metrics.jsonl"}
    records = read_metrics(run_dir)
    phases = {r["phase"] for r in records}
    assert phases == {"pretrain", "flexloop"}
    eval_keys = set().union(*records)
    for split in ["train", "unseen"]:
        for k in range(1, 6):
            assert f"eval/{split}/success_depth_{k}" in eval_keys
    lambdas = {r["phase"]: r["charts/lambda_depth"] for r in records if "charts/lambda_depth" in r}
    assert lambdas == {"pretrain": 0.0, "flexloop": 1.0}
    assert all(0 <= r["charts/cells_changed"] <= 36 for r in records if "charts/lambda_depth" in r)
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert final["updates"] == 4 * 3 and final["global_step"] == 4 * 16 * 10
    assert final["phase"] == "flexloop" and flexloop_run.load_checkpoint(run_dir / "pretrained.pt")["phase"] == "pretrain"


def test_checkpoint_loads_in_a_fresh_process(tmp_path):
    run_dir = gcdqn.train(tiny_args(tmp_path, pretrain_epochs=0))
    code = ("import torch, flexloop_gcdqn as g, flexloop_run; c = flexloop_run.load_checkpoint(r'%s'); n, a = g.network_from_checkpoint(c); "
            "q = n.all_depths(torch.zeros(2, 36), torch.zeros(2, 36)); print(tuple(q.shape), a.depth)" % (run_dir / "final.pt"))
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "(5, 2, 2, 6) 5"


def test_resume_continues_steps_and_metrics_without_duplicates(tmp_path):
    # A full run, and a run interrupted after 2 of 4 intervals and resumed, must log the same steps.
    full_dir = gcdqn.train(tiny_args(tmp_path / "full"))
    cut = tiny_args(tmp_path / "cut")
    run_dir = gcdqn.train(dataclasses.replace(cut, pretrain_epochs=1, num_epochs=0))  # stops after pretraining
    checkpoint = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    assert checkpoint["iteration"] == 2
    # Resuming keeps the checkpoint's own flags, so extend the budget the way a killed run would have had it.
    checkpoint["args"]["num_epochs"] = 1
    flexloop_run.save_checkpoint(run_dir / "latest.pt", checkpoint)
    with open(run_dir / "metrics.jsonl", "a") as f:  # a record the killed run wrote after its checkpoint
        f.write(json.dumps({"global_step": 10 ** 9, "phase": "flexloop"}) + "\n")
    resumed_dir = gcdqn.train(dataclasses.replace(cut, resume=str(run_dir / "latest.pt")))
    assert resumed_dir == run_dir
    steps = [(r["global_step"], tuple(sorted(r))) for r in read_metrics(run_dir)]
    full_steps = [(r["global_step"], tuple(sorted(r))) for r in read_metrics(full_dir)]
    assert steps == full_steps
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["updates"] == 4 * 3


def test_init_checkpoint_starts_post_training_from_pretrained_weights(tmp_path):
    pre_dir = iru_pretrain.main("gcdqn", tiny_args(tmp_path / "pre"))
    pretrained = flexloop_run.load_checkpoint(pre_dir / "final.pt")
    assert pretrained["phase"] == "pretrain" and pretrained["args"]["lambda_depth"] == 0.0
    post_dir = gcdqn.train(tiny_args(tmp_path / "post", init_checkpoint=str(pre_dir / "final.pt"),
                                     updates_per_rollout=0 + 1, num_epochs=1))
    records = read_metrics(post_dir)
    assert {r["phase"] for r in records} == {"flexloop"}  # no second pretraining
    # "{seed}" in the path is the run's seed (one sweep value for every seed); the run records the path it read
    seeded = tmp_path / "seed7" / "final.pt"
    seeded.parent.mkdir()
    seeded.write_bytes((pre_dir / "final.pt").read_bytes())
    seeded_dir = gcdqn.train(tiny_args(tmp_path / "seeded", init_checkpoint=str(tmp_path / "seed{seed}" / "final.pt"),
                                       seed=7, updates_per_rollout=1, num_epochs=1))
    assert flexloop_run.load_checkpoint(seeded_dir / "final.pt")["args"]["init_checkpoint"] == str(seeded)
    with pytest.raises(FileNotFoundError, match="seed8"):  # the error names the path it looked for
        gcdqn.train(tiny_args(tmp_path / "seed8", init_checkpoint=str(tmp_path / "seed{seed}" / "final.pt"),
                              seed=8, updates_per_rollout=1, num_epochs=1))
    with pytest.raises(ValueError, match="--hidden-dim"):
        gcdqn.train(tiny_args(tmp_path / "bad", init_checkpoint=str(pre_dir / "final.pt"), hidden_dim=32))


def test_hostile_and_broken_checkpoints_are_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    hostile = tmp_path / "hostile.pt"
    torch.save({"format": flexloop_run.CHECKPOINT_FORMAT, "x": Payload()}, hostile)
    with pytest.raises(ValueError, match="because it can run code when loaded") as refused:
        flexloop_run.load_checkpoint(hostile)
    assert "weights_only" not in str(refused.value) and "Re-running" not in str(refused.value)
    truncated = tmp_path / "truncated.pt"
    run_dir = gcdqn.train(tiny_args(tmp_path / "run", pretrain_epochs=0))
    truncated.write_bytes((run_dir / "final.pt").read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt|truncated"):
        flexloop_run.load_checkpoint(truncated)
    other = tmp_path / "other.pt"
    torch.save({"weights": torch.zeros(3)}, other)
    with pytest.raises(ValueError, match="not a FlexLoop checkpoint"):
        flexloop_run.load_checkpoint(other)
    with pytest.raises(ValueError, match="flexloop_gcdqn.py"):
        flexloop_run.load_checkpoint(run_dir / "final.pt", algorithm="gcppo")
    with pytest.raises(FileNotFoundError):
        flexloop_run.load_checkpoint(tmp_path / "missing.pt")


def test_iru_pretrain_cli_runs(tmp_path):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k not in ("cuda", "num_epochs")]
    out = subprocess.run([sys.executable, "iru_pretrain.py", "gcdqn", *flags, "--no-cuda", f"--run-dir={tmp_path}"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (run_dir,) = tmp_path.iterdir()
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["args"]["lambda_depth"] == 0.0


def test_gpu_speedups_are_on_by_default_and_ignored_on_cpu(tmp_path, no_torch_compile):
    # On a GPU the update is compiled, graphed and run in bf16 (BENCHMARKS.md); a CPU run with the same defaults
    # must neither compile nor fail on the GPU-only flags.
    args = tiny_args(tmp_path)
    assert args.compile and args.cuda_graph and args.bf16
    assert (Path(gcdqn.train(args)) / "final.pt").exists()


# ----- learning -----

def easy_task_success(network, num_envs=2048, steps=10, seed=0):
    """Success on one-box tasks that take three actions (pick up, step right, put down), acting as training
    does (sampling softmax(Q / alpha)); the episode lasts `steps` and succeeds if the box ends on the target."""
    env = BoxPickVecEnv(num_envs, variant="Generalize-1-1", episode_length=steps, check_actions=False)
    generator = torch.Generator().manual_seed(seed)
    cells = torch.randint(0, 6, (num_envs,), generator=generator) * 6 + torch.randint(0, 5, (num_envs,), generator=generator)
    grid = torch.zeros(num_envs, 36, dtype=torch.long)
    grid[torch.arange(num_envs), cells] = AGENT_ON_BOX
    grid[torch.arange(num_envs), cells + 1] = TARGET
    obs, _ = env.reset(options={"grid": grid})
    for _ in range(steps):
        with torch.no_grad():
            action = network.act(network.policy_logits(obs["observation"], obs["desired_goal"], network.depth),
                                 generator)
        obs, _, _, _, info = env.step(action)
    return info["episode_success"].mean().item()


@pytest.mark.slow
def test_training_improves_success_on_a_small_task(tmp_path):
    """About 4,000 updates on Generalize-1-1 (one box, one target; 20-step episodes; gamma 0.9) must raise
    success on short one-box tasks well above the untrained policy's (about 0.02; 2,048 episodes, so the
    binomial noise is about 0.003)."""
    args = gcdqn.Args(env_id="BoxPick-Generalize-1-1-v0", episode_length=20, gamma=0.9, hidden_dim=64, depth=2,
                      num_envs=64, batch_size=64, updates_per_rollout=100, intervals_per_epoch=10, pretrain_epochs=4,
                      num_epochs=0, eval_every=1000, num_eval_envs=16, log_every=1000, save_every=1000, cuda=False,
                      run_dir=str(tmp_path), seed=0)
    before = easy_task_success(gcdqn.build_network(args, "cpu"))
    run_dir = gcdqn.train(args)
    network, _ = gcdqn.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"))
    after = easy_task_success(network)
    assert after > before + 0.015 and after > 1.5 * before, (before, after)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("all_action_gradients", [False, True])
def test_captured_update_draws_a_fresh_batch_at_every_replay(compiled, all_action_gradients):
    """A CUDA graph replays recorded kernels: the replay's random draws must still be new at each replay, or
    every update would train on one frozen batch. Three replays must sample different (env, episode, t, offset)."""
    args = dataclasses.replace(gcdqn.Args(), num_envs=64, batch_size=32, hidden_dim=32, replay_episodes=4)
    device = torch.device("cuda")
    env = BoxPickVecEnv(args.num_envs, variant="Exact-4", device=device, seed=0, check_actions=False)
    network, target_network = gcdqn.build_network(args, device), gcdqn.build_network(args, device)
    target_network.load_state_dict(network.state_dict())
    target_network.requires_grad_(False)
    generator = torch.Generator(device).manual_seed(0)
    replay = gcdqn.TrajectoryReplay(args.num_envs, args.replay_episodes, args.episode_length, device)
    for _ in range(3):
        replay.add(*gcdqn.run_episode(network, env, args.depth, generator)[:3])
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, capturable=True)
    loss_sums = torch.zeros(len(gcdqn.LOSS_NAMES), device=device)
    update = gcdqn.make_update(args, network, target_network, optimizer, replay, generator,
                               torch.zeros((), device=device), loss_sums, all_action_gradients=all_action_gradients)
    update = flexloop_run.capture_cuda_graph(torch.compile(update) if compiled else update, [generator])
    draws = []
    for _ in range(3):
        batch = update()
        draws.append(torch.stack([batch[k].long() for k in ("env", "episode", "t", "offset")]).cpu())
    for first, second in [(0, 1), (1, 2), (0, 2)]:
        assert not torch.equal(draws[first], draws[second])
        assert (draws[first][0] != draws[second][0]).float().mean() > 0.5  # most rows move to another env
    assert torch.isfinite(loss_sums).all() and loss_sums[0] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_collection_acts_as_the_eager_one_does(exact_float32_matmuls):
    """train() collects with network.policy_logits compiled by inductor. From the same env and generator states it must
    act as the eager policy does: every env's 100 actions the same, but for the rare near-tie that a float
    rounding flips (that env's episode then goes its own way). Captured in a CUDA graph, each replay collects a
    new episode."""
    args = dataclasses.replace(gcdqn.Args(), num_envs=256, hidden_dim=64)
    device = torch.device("cuda")
    network = gcdqn.build_network(args, device)
    compiled_logits = torch.compile(network.policy_logits)
    actions = {}
    for name, logits_fn in [("eager", network.policy_logits), ("compiled", compiled_logits)]:
        env = BoxPickVecEnv(args.num_envs, variant="Exact-4", device=device, seed=0, check_actions=False)
        generator = torch.Generator(device).manual_seed(0)
        actions[name] = gcdqn.run_episode(network, env, args.depth, generator, logits_fn)[1]
    same_episode = (actions["eager"] == actions["compiled"]).all(1)
    assert same_episode.float().mean() > 0.95, same_episode.float().mean()

    generator = torch.Generator(device).manual_seed(1)
    collect = flexloop_run.capture_cuda_graph(lambda: gcdqn.run_episode(network, env, args.depth, generator,
                                                                 compiled_logits), [generator, env.generator])
    first = collect()[1].clone()
    assert not torch.equal(first, collect()[1])


@pytest.mark.parametrize("backbone", ["iru", "lstm"])
def test_flax_init_is_lecun_normal_with_zero_biases_and_the_forget_bias_at_one(backbone):
    """--init flax: the reference's flax defaults in every ensemble layer (fan_in = in_features), the members drawn
    independently; the forget gate's bias stays +1 (IRU: the first d gate outputs, LSTM: the second d)."""
    torch.manual_seed(0)
    args = gcdqn.Args(init="flax", backbone=backbone, hidden_dim=64, cuda=False)
    network = gcdqn.build_network(args, "cpu")
    gates, d = network.gates, args.hidden_dim
    std = (1 / gates.weight.shape[1]) ** 0.5
    assert abs(gates.weight.std().item() - std) < 0.03 * std  # the truncation correction restores the variance
    assert gates.weight.abs().max().item() <= 2 * std / 0.87962566103423978 + 1e-6
    assert not torch.equal(gates.weight[0], gates.weight[1])
    forget = slice(d, 2 * d) if backbone == "lstm" else slice(0, d)
    assert (gates.bias[..., forget] == 1).all()
    others = torch.ones(gates.bias.shape[-1], dtype=torch.bool)
    others[forget] = False
    assert (gates.bias[..., others] == 0).all() and (network.embed.bias == 0).all() and (network.head.bias == 0).all()
    assert gcdqn.Args().init == "flax"  # the reference's init is the default: without it Generalize collapses
    pytorch = gcdqn.build_network(gcdqn.Args(init="pytorch", hidden_dim=64, cuda=False), "cpu")
    assert pytorch.embed.bias.abs().sum() > 0  # nn.Linear's uniform biases


def load_fidelity_bench():
    """bench/gcdqn_fidelity.py as a module (bench/ is not a package)."""
    import importlib.util
    path = Path(__file__).parent.parent / "bench" / "gcdqn_fidelity.py"
    spec = importlib.util.spec_from_file_location("gcdqn_fidelity", path)
    fidelity = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fidelity)
    return fidelity


def test_fidelity_bench_measures_the_inits_spread_of_q_across_actions():
    """bench/gcdqn_fidelity.py init: flax's lecun_normal kernels (1.73x nn.Linear's std) give the untrained critic
    a wider spread of Q over the 6 actions than PyTorch's init, for every network seed, on real start states."""
    fidelity = load_fidelity_bench()
    result = fidelity.initial_q_spread(num_envs=64, seeds=(0, 1))
    spreads = zip(result["pytorch"]["median_std_across_actions"], result["flax"]["median_std_across_actions"])
    assert all(flax > 1.5 * pytorch > 0 for pytorch, flax in spreads)
    entropies = result["pytorch"]["entropy_at_alpha_1"] + result["flax"]["entropy_at_alpha_1"]
    assert all(1.5 < h <= math.log(6) + 1e-3 for h in entropies)  # near uniform at alpha = 1 either way


def test_fidelity_bench_reads_a_trained_iru_5s_q_at_every_depth():
    """bench/gcdqn_fidelity.py depth-q on the committed Exact-4 IRU-5: one mean Q per depth, growing with depth as
    its residual state does (the scale AnyK-TD's shared target puts on the shallow depths)."""
    fidelity = load_fidelity_bench()
    checkpoint = Path(__file__).parent.parent / "checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/pretrained.pt"
    result = fidelity.q_by_depth(checkpoint, num_envs=32)
    q = result["mean_q_by_depth"]
    assert len(q) == 5 and result["updates"] > 5_000_000 - 100
    assert all(shallow + 5 < deep for shallow, deep in zip(q, q[1:])), q
