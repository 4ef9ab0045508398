"""The paper's ablations and variants (§5.4, appendix C): each flag changes the loss as stated, the LSTM backbone
keeps the depth protocol, every K runs end to end, the from-scratch teacher is only ever read, and the sweep files
name real flags."""

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tyro
import yaml

import flexloop_gcdqn as gcdqn
import flexloop_run
import flexloop_gciql as gciql
import flexloop_gcppo as gcppo
from envs import ogbench_data

ROOT = Path(__file__).resolve().parent.parent

TINY = dict(num_envs=16, batch_size=16, updates_per_rollout=3, intervals_per_epoch=2, pretrain_epochs=1, num_epochs=1,
            hidden_dim=16, eval_every=2, num_eval_envs=8, log_every=1, save_every=1, episode_length=10,
            replay_episodes=4, cuda=False)


def tiny_args(tmp_path, **overrides):
    return gcdqn.Args(**{**TINY, "run_dir": str(tmp_path), **overrides})


def perturbed(network, seed):
    """The network with every parameter nudged, so that norms and gates are not at their initial values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in network.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return network


# ----- the loss terms on a fixed batch -----

DEPTH, GAMMA, TAU = 4, 0.9, 0.25


def fixed_batch(batch_size=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    codes = lambda: torch.randint(0, 12, (batch_size, 36), generator=generator, dtype=torch.int8)  # noqa: E731
    return dict(obs=codes(), next_obs=codes(), goal=codes(),
                action=torch.randint(0, 6, (batch_size,), generator=generator),
                reward=(torch.rand(batch_size, generator=generator) < 0.5).float())


def loss_setup(**overrides):
    args = gcdqn.Args(depth=DEPTH, hidden_dim=8, gamma=GAMMA, policy_temperature=TAU, cuda=False, **overrides)
    torch.manual_seed(0)
    network = perturbed(gcdqn.build_network(args, "cpu"), 1)
    target_network = perturbed(gcdqn.build_network(args, "cpu"), 2).requires_grad_(False)
    return args, network, target_network, fixed_batch()


def terms_for(args, network, target_network, batch, phase="flexloop", lam=1.0, teacher=None):
    weights = torch.tensor(gcdqn.td_depth_weights(args.ablation if phase == "flexloop" else "none", args.depth))
    loss, terms = gcdqn.flexloop_losses(network, target_network, batch, args, torch.tensor(lam), weights, teacher)
    short = dict(zip(gcdqn.LOSS_NAMES, ("td", "depth_kl", "alpha", "entropy", "bellman")))
    return {"loss": loss, **{short[name]: value for name, value in terms.items()}}


def hand_td(q_per_depth, bootstrap_q, batch, depth):
    """sum over critics of the batch mean of (Q_k(s, g, a) - y)^2, y = r + gamma * max_a' mean_critics Q(s', g, a')."""
    y = batch["reward"] + GAMMA * bootstrap_q.mean(0).max(-1).values
    q_taken = torch.stack([q_per_depth[depth - 1][:, b, batch["action"][b]] for b in range(len(y))], 1)  # (E, B)
    return ((q_taken - y) ** 2).mean(1).sum()


def hand_kl(q_per_depth, target_depth, student_depth):
    """KL(pi_target || pi_student) averaged over the batch, pi_k = softmax(mean_critics Q_k / tau)."""
    p = torch.softmax(q_per_depth[target_depth - 1].mean(0) / TAU, -1)
    q = torch.softmax(q_per_depth[student_depth - 1].mean(0) / TAU, -1)
    return (p * (p.log() - q.log())).sum(-1).mean()


def test_flexloop_terms_are_td_at_depth_k_plus_lambda_adjacent_kl():
    args, network, target_network, batch = loss_setup()
    terms = terms_for(args, network, target_network, batch, lam=0.7)
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
        q_next = target_network.all_depths(batch["next_obs"], batch["goal"])
    torch.testing.assert_close(terms["td"], hand_td(q, q_next[-1], batch, DEPTH))
    adjacent = torch.stack([hand_kl(q, k + 1, k) for k in range(1, DEPTH)]).mean()
    torch.testing.assert_close(terms["depth_kl"], adjacent)
    assert terms["bellman"] == 0
    torch.testing.assert_close(terms["loss"], terms["td"] + 0.7 * terms["depth_kl"] + terms["alpha"])


def test_anyk_td_is_the_mean_of_the_per_depth_td_losses():
    args, network, target_network, batch = loss_setup(ablation="anyk-td")
    terms = terms_for(args, network, target_network, batch)
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
        q_next = target_network.all_depths(batch["next_obs"], batch["goal"])
    per_depth = torch.stack([hand_td(q, q_next[-1], batch, k) for k in range(1, DEPTH + 1)])
    torch.testing.assert_close(terms["td"], per_depth.mean())  # every depth bootstraps from the depth-K target
    assert not torch.isclose(terms["td"], per_depth[-1])
    # Pretraining is never changed by the ablation: depth K alone.
    torch.testing.assert_close(terms_for(args, network, target_network, batch, phase="pretrain")["td"], per_depth[-1])


def test_distill_only_distils_the_pretrained_full_depth_policy_into_every_depth_with_no_td_term():
    args, network, target_network, batch = loss_setup(ablation="distill-only")
    pretrained = perturbed(gcdqn.build_network(args, "cpu"), 3).requires_grad_(False)
    weights = torch.tensor(gcdqn.td_depth_weights("distill-only", DEPTH))
    loss, terms = gcdqn.flexloop_losses(network, target_network, batch, args, torch.tensor(0.7), weights,
                                        pretrained=pretrained)
    td, depth_kl, alpha = (terms[name] for name in ("losses/td_loss", "losses/depth_kl", "losses/alpha_loss"))
    assert td == 0 and gcdqn.td_depth_weights("distill-only", 3) == [0.0, 0.0, 0.0]
    # mean over k = 1..K, K included, of KL(pi_K of the pretrained network || pi_k of the trained one)
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
        p = torch.softmax(pretrained.all_depths(batch["obs"], batch["goal"])[-1].mean(0) / TAU, -1)
    expected = torch.stack([(p * (p.log() - torch.log_softmax(q[k].mean(0) / TAU, -1))).sum(-1).mean()
                            for k in range(DEPTH)]).mean()
    torch.testing.assert_close(depth_kl, expected)
    torch.testing.assert_close(loss, 0.7 * depth_kl + alpha)
    # every depth's Q gets a gradient, depth K's too, and the pretrained network none
    q = network.all_depths(batch["obs"], batch["goal"])
    q.retain_grad()
    logits = q.mean(1) / TAU
    gcdqn.IRUNetwork.divergence(torch.log(p).expand_as(logits), logits).mean().backward()
    assert all(q.grad[k].abs().sum() > 0 for k in range(DEPTH))
    assert all(p.grad is None for p in pretrained.parameters())
    # plain FlexLoop on the same batch has a TD term and the adjacent KL
    assert terms_for(dataclasses.replace(args, ablation="none"), network, target_network, batch)["td"] > 0
    assert gcdqn.td_depth_weights("none", 3) == [0.0, 0.0, 1.0]


def test_distill_only_teacher_is_the_pretrained_network_and_survives_a_resume(tmp_path):
    """A two-phase Distill Only run distils from the IRU-K as pretraining ended (its pretrained.pt), keeps that
    teacher frozen through the FlexLoop phase, and a resumed run reads it back from latest.pt. A run from
    --init-checkpoint distils from the checkpoint's model."""
    args = tiny_args(tmp_path, ablation="distill-only", num_epochs=2)
    run_dir = Path(gcdqn.train(args))
    load = lambda name: torch.load(run_dir / name, weights_only=True)  # noqa: E731
    pretrained, final = load("pretrained.pt"), load("final.pt")
    assert pretrained["pretrained_model"] is None  # no teacher while pretraining
    for name, tensor in pretrained["model"].items():
        torch.testing.assert_close(final["pretrained_model"][name], tensor)
    assert any(not torch.equal(final["model"][n], t) for n, t in pretrained["model"].items())  # the student moved
    # resume from a copy of the final state as if it had been stopped: the teacher comes back, not a fresh copy
    latest = {**final, "iteration": final["iteration"] - 1, "iteration_updates": 0}
    torch.save(latest, run_dir / "latest.pt")
    seen = {}
    original = gcdqn.make_update

    def spy(*a, **kw):
        if kw.get("pretrained") is not None:
            seen["teacher"] = {n: t.clone() for n, t in kw["pretrained"].state_dict().items()}
        return original(*a, **kw)

    gcdqn.make_update = spy
    try:
        gcdqn.train(dataclasses.replace(args, resume=str(run_dir / "latest.pt")))
    finally:
        gcdqn.make_update = original
    for name, tensor in pretrained["model"].items():
        torch.testing.assert_close(seen["teacher"][name], tensor)
    # from --init-checkpoint, the teacher is the checkpoint's model
    started = Path(gcdqn.train(tiny_args(tmp_path / "init", ablation="distill-only",
                                         init_checkpoint=str(run_dir / "pretrained.pt"))))
    for name, tensor in pretrained["model"].items():
        torch.testing.assert_close(torch.load(started / "final.pt", weights_only=True)["pretrained_model"][name], tensor)


def test_final_depth_target_distils_every_depth_from_depth_k():
    args, network, target_network, batch = loss_setup(depth_target="final")
    terms = terms_for(args, network, target_network, batch)
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
    final = torch.stack([hand_kl(q, DEPTH, k) for k in range(1, DEPTH)]).mean()
    adjacent = torch.stack([hand_kl(q, k + 1, k) for k in range(1, DEPTH)]).mean()
    torch.testing.assert_close(terms["depth_kl"], final)
    assert not torch.isclose(final, adjacent)
    # Only the shallower depths are pulled: depth K is only ever the (detached) target.
    q = q.clone().requires_grad_(True)
    gcdqn.flexloop_depth_loss(q.mean(1) / TAU, "final").backward()
    assert q.grad[-1].abs().sum() == 0 and all(q.grad[k].abs().sum() > 0 for k in range(DEPTH - 1))


def test_teacher_target_and_inter_depth_bellman_loss():
    args, network, target_network, batch = loss_setup(bellman_weight=0.1)
    torch.manual_seed(5)
    teacher = perturbed(gcdqn.IRUNetwork(depth=3, hidden_dim=12), 3).requires_grad_(False)  # any shape will do
    terms = terms_for(args, network, target_network, batch, teacher=teacher)
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
        q_next = target_network.all_depths(batch["next_obs"], batch["goal"])
        q_teacher_next = teacher.all_depths(batch["next_obs"], batch["goal"])
    # Depth K regresses onto r + gamma * max_a' Q_teacher(s', g, a'), not onto the target network.
    torch.testing.assert_close(terms["td"], hand_td(q, q_teacher_next[-1], batch, DEPTH))
    assert not torch.isclose(terms["td"], hand_td(q, q_next[-1], batch, DEPTH))
    # Bellman refinement: Q_{k+1} against r + gamma * max_a' Q_target,k(s', g, a') for k = 1..K-2.
    bellman = torch.stack([hand_td(q, q_next[k - 1], batch, k + 1) for k in range(1, DEPTH - 1)]).mean()
    torch.testing.assert_close(terms["bellman"], bellman)
    torch.testing.assert_close(terms["loss"], terms["td"] + terms["depth_kl"] + 0.1 * bellman + terms["alpha"])
    # Its gradient reaches depths 2..K-1 only, and never the teacher.
    q = gcdqn.taken_action(q, batch["action"]).requires_grad_(True)  # (K, E, B)
    gcdqn.bellman_refinement_loss(q, q_next, batch["reward"], GAMMA).backward()
    assert q.grad[0].abs().sum() == 0 and q.grad[-1].abs().sum() == 0
    assert all(q.grad[k].abs().sum() > 0 for k in range(1, DEPTH - 1))


# ----- the LSTM backbone -----

def hand_lstm(network, obs, goal, action):
    """One critic's Q_1..Q_K for one (s, g, a), the LSTM written out with plain tensors."""
    x = torch.cat([obs.float(), goal.float(), F.one_hot(torch.tensor(action), 6).float()])
    d = network.hidden_dim
    x_emb = F.layer_norm(x @ network.embed.weight[0] + network.embed.bias[0, 0], (d,)) * \
        network.embed_norm.weight[0, 0] + network.embed_norm.bias[0, 0]
    c, h, outs = torch.zeros(d), torch.zeros(d), []
    for _ in range(network.depth):
        gates = torch.cat([x_emb, h]) @ network.gates.weight[0] + network.gates.bias[0, 0]
        i, f, g, o = gates[:d], gates[d:2 * d], gates[2 * d:3 * d], gates[3 * d:]
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        outs.append(h @ network.head.weight[0, :, 0] + network.head.bias[0, 0, 0])
    return torch.stack(outs)


def test_lstm_matches_hand_computation_and_the_depth_protocol():
    torch.manual_seed(0)
    network = perturbed(gcdqn.LSTMNetwork(depth=3, hidden_dim=6, num_critics=2), 0)
    obs, goal = torch.randint(0, 12, (5, 36)), torch.randint(0, 12, (5, 36))
    q = network.all_depths(obs, goal)  # (K, E, B, A)
    assert q.shape == (3, 2, 5, 6)
    for row, action in [(0, 0), (3, 5), (4, 2)]:
        torch.testing.assert_close(q[:, 0, row, action], hand_lstm(network, obs[row], goal[row], action),
                                   rtol=1e-5, atol=1e-5)
    # start / advance / decide give all_depths' policies, and gather keeps rows' states.
    state = network.start(obs, goal)
    for k in range(3):
        state = network.advance(state)
        torch.testing.assert_close(network.decide(state), q[k].mean(0) / network.policy_temperature)
    rows = torch.tensor([4, 1])
    torch.testing.assert_close(network.decide(network.gather(state, rows)), network.decide(state)[rows])
    # The depth KL through the LSTM reaches only the shallower depths.
    q = network.all_depths(obs, goal)
    q.retain_grad()
    gcdqn.flexloop_depth_loss(q.mean(1) / network.policy_temperature).backward()
    assert q.grad[-1].abs().sum() == 0 and q.grad[0].abs().sum() > 0 and q.grad[1].abs().sum() > 0
    assert torch.all(gcdqn.LSTMNetwork(hidden_dim=6).gates.bias[..., 6:12] == 1.0)  # forget-gate bias +1


def test_lstm_184_has_about_the_parameters_of_iru_256():
    count = lambda n: sum(p.numel() for p in n.parameters())  # noqa: E731
    iru_256 = count(gcdqn.IRUNetwork(hidden_dim=256))
    lstm_256, lstm_184 = count(gcdqn.LSTMNetwork(hidden_dim=256)), count(gcdqn.LSTMNetwork(hidden_dim=184))
    assert (iru_256, lstm_184, lstm_256) == (569_347, 573_347, 1_092_611)  # two critics each (README table)
    assert abs(lstm_184 / iru_256 - 1) < 0.01


def test_lstm_backbone_runs_end_to_end_and_reloads(tmp_path):
    run_dir = gcdqn.train(tiny_args(tmp_path, backbone="lstm", hidden_dim=12))
    network, args = gcdqn.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"))
    assert isinstance(network, gcdqn.LSTMNetwork) and args.backbone == "lstm"
    with pytest.raises(ValueError, match="--backbone"):  # an LSTM checkpoint cannot start an IRU run
        gcdqn.train(tiny_args(tmp_path / "bad", hidden_dim=12, init_checkpoint=str(run_dir / "pretrained.pt")))


# ----- depths K in {4, 5, 8, 10}: pretraining and FlexLoop -----

@pytest.mark.parametrize("depth", [4, 5, 8, 10])
def test_every_paper_depth_pretrains_and_post_trains(tmp_path, depth):
    run_dir = gcdqn.train(tiny_args(tmp_path, depth=depth, hidden_dim=8, num_eval_envs=4))
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert final["depth"] == depth and final["phase"] == "flexloop"
    assert flexloop_run.load_checkpoint(run_dir / "pretrained.pt")["phase"] == "pretrain"
    network, _ = gcdqn.network_from_checkpoint(final)
    assert network.all_depths(torch.zeros(2, 36), torch.zeros(2, 36)).shape == (depth, 2, 2, 6)
    assert f"eval/unseen/success_depth_{depth}" in final["metrics"]


# ----- FlexLoop from scratch: the teacher is only read -----

def test_from_scratch_update_never_changes_or_copies_the_teacher():
    args = gcdqn.Args(depth=3, hidden_dim=8, batch_size=8, num_envs=8, cuda=False, learning_rate=1e-2)
    torch.manual_seed(0)
    teacher = perturbed(gcdqn.build_network(args, "cpu"), 7).requires_grad_(False)
    teacher_before = {k: v.clone() for k, v in teacher.state_dict().items()}
    network = gcdqn.build_network(args, "cpu")
    target_network = gcdqn.build_network(args, "cpu").requires_grad_(False)
    target_network.load_state_dict(network.state_dict())
    student_before = {k: v.clone() for k, v in network.state_dict().items()}
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate)
    assert not {id(p) for p in teacher.parameters()} & {id(p) for g in optimizer.param_groups for p in g["params"]}
    replay = gcdqn.TrajectoryReplay(8, 2, 6, "cpu")
    replay.add(torch.randint(0, 12, (8, 7, 36), dtype=torch.int8), torch.randint(0, 6, (8, 6), dtype=torch.int8),
               torch.full((8,), 6))
    loss_sums = torch.zeros(len(gcdqn.LOSS_NAMES))
    update = gcdqn.make_update(args, network, target_network, optimizer, replay, torch.Generator().manual_seed(0),
                               torch.tensor(1.0), loss_sums, teacher=teacher)
    for _ in range(5):
        update()
    for name, value in teacher.state_dict().items():
        assert torch.equal(value, teacher_before[name]), name  # unchanged
        assert not torch.equal(network.state_dict()[name], value), name  # and not copied
        assert not torch.equal(network.state_dict()[name], student_before[name]), name  # while the student learnt
    assert all(p.grad is None for p in teacher.parameters())
    assert loss_sums[gcdqn.LOSS_NAMES.index("losses/bellman_loss")] > 0


def test_from_scratch_run_starts_from_fresh_weights_and_skips_pretraining(tmp_path):
    teacher_dir = gcdqn.train(tiny_args(tmp_path / "teacher", num_epochs=0))
    teacher_path = teacher_dir / "final.pt"
    teacher_bytes = teacher_path.read_bytes()
    # With a zero learning rate the student's final weights are its initial ones: fresh, not the teacher's.
    args = tiny_args(tmp_path / "student", teacher_checkpoint=str(teacher_path), learning_rate=0.0)
    run_dir = gcdqn.train(args)
    student = flexloop_run.load_checkpoint(run_dir / "final.pt")
    teacher = flexloop_run.load_checkpoint(teacher_path)["model"]
    assert set(student["model"]) == set(teacher)  # the student's checkpoint holds no teacher weights
    for name in ["embed.weight", "gates.weight", "head.weight", "embed_norm.weight", "log_alpha"]:
        assert not torch.equal(student["model"][name], teacher[name]), name
    torch.manual_seed(args.seed)
    fresh = gcdqn.build_network(args, "cpu").state_dict()
    for name, value in fresh.items():
        assert torch.equal(student["model"][name], value), name
    assert teacher_path.read_bytes() == teacher_bytes
    assert not (run_dir / "pretrained.pt").exists() and student["updates"] == 2 * 3  # FlexLoop phase only


@pytest.mark.parametrize("overrides,match", [
    (dict(ablation="distill-only", lambda_depth=0.0), "--ablation distill-only"),
    (dict(ablation="distill-only", depth_target="final"), "drop --depth-target"),
    (dict(backbone="lstm", iru_variant="paper"), "--iru-variant"),
    (dict(teacher_checkpoint="t.pt", init_checkpoint="i.pt"), "--teacher-checkpoint"),
    (dict(teacher_checkpoint="t.pt", ablation="anyk-td"), "--teacher-checkpoint"),
    (dict(bellman_weight=-0.1), "--bellman-weight"),
])
def test_bad_variant_flags_fail_before_work(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        gcdqn.train(tiny_args(tmp_path, **overrides))
    assert not any(tmp_path.iterdir())


def test_teacher_from_another_env_is_refused(tmp_path):
    teacher_dir = gcdqn.train(tiny_args(tmp_path / "teacher", num_epochs=0, env_id="BoxPick-Exact-3-v0"))
    with pytest.raises(ValueError, match="--env-id BoxPick-Exact-3-v0"):
        gcdqn.train(tiny_args(tmp_path / "student", teacher_checkpoint=str(teacher_dir / "final.pt")))


# ----- the other scripts: --backbone lstm and --depth-target final -----

def test_gcppo_final_target_and_lstm_backbone(tmp_path):
    logits = torch.randn(4, 5, 20, requires_grad=True)
    p = torch.softmax(logits.detach(), -1)
    final = torch.stack([(p[-1] * (p[-1].log() - p[k].log())).sum(-1).mean() for k in range(3)]).mean()
    torch.testing.assert_close(gcppo.flexloop_depth_loss(logits, "final"), final)
    network = gcppo.build_network(gcppo.Args(backbone="lstm", depth=3, hidden_dim=8), "cpu")
    obs, goal = torch.rand(4, 20).round(), torch.rand(4, 20).round()
    all_logits, values = network.all_depths(obs, goal)
    state = network.start(obs, goal)
    for k in range(3):
        state = network.advance(state)
        torch.testing.assert_close(network.decide(state), all_logits[k])
    assert isinstance(network, gcppo.LSTMNetwork) and values.shape == (3, 4)
    # end to end: pretraining and FlexLoop with both flags, and the checkpoint rebuilds the LSTM
    run_dir = gcppo.train(gcppo.Args(cuda=False, num_envs=8, num_steps=8, num_minibatches=2, update_epochs=1, depth=3,
                                     hidden_dim=8, pretrain_timesteps=64, total_timesteps=64, num_eval_envs=4,
                                     run_dir=str(tmp_path), backbone="lstm", depth_target="final"))
    network, _ = gcppo.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"))
    assert isinstance(network, gcppo.LSTMNetwork)


def test_gciql_final_target_and_lstm_backbone(tmp_path):
    policies = torch.randn(4, 5, 2, 3)
    policies[:, :, 1] = 1.0
    final = torch.stack([gciql.IRUActor.divergence(policies[-1], policies[k]).mean() for k in range(3)]).mean()
    torch.testing.assert_close(gciql.flexloop_depth_loss(policies, "final"), final)
    args = gciql.Args(backbone="lstm", depth=3, hidden_dim=8)
    agent = gciql.build_network(args, "cpu")
    assert all(isinstance(n, gciql.LSTM) for n in [agent.value, agent.critic, agent.actor.iru])
    obs = torch.randn(4, agent.actor.iru.embed.weight.shape[1] // 2)
    stacked = agent.actor.all_depths(obs, obs)
    state = agent.actor.start(obs, obs)
    for k in range(3):
        state = agent.actor.advance(state)
        torch.testing.assert_close(agent.actor.decide(state), stacked[k])
    # end to end on a tiny generated dataset (no evaluation), and the checkpoint rebuilds the LSTM actor
    ogbench_data.generate_dataset(args.env_name, str(tmp_path), episodes=4, episode_steps=40, seed=0, progress=False)
    args = dataclasses.replace(args, dataset_dir=str(tmp_path), download=False, run_dir=str(tmp_path), cuda=False,
                               depth=2, batch_size=16, pretrain_steps=3, total_steps=3, log_every=3, save_every=3,
                               eval_episodes=0, depth_target="final")
    run_dir = gciql.train(args)
    actor, _ = gciql.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"))
    assert isinstance(actor.iru, gciql.LSTM)


# ----- sweep files -----

SCRIPTS = {"flexloop_gcdqn.py": gcdqn, "flexloop_gcppo.py": gcppo, "flexloop_gciql.py": gciql}
SWEEPS = sorted((ROOT / "sweeps").glob("*.yaml"))


def test_there_are_sweeps_for_the_papers_grids():
    names = {p.stem for p in SWEEPS}
    assert {"main_boxpick", "lambda_depth", "ablation_distill_only", "ablation_self_td_only", "ablation_anyk_td",
            "depth_target", "backbone_lstm", "depth_k", "from_scratch"} <= names


@pytest.mark.parametrize("path", SWEEPS, ids=[p.stem for p in SWEEPS])
def test_sweep_file_parses_and_names_real_flags(path):
    sweep = yaml.safe_load(path.read_text())
    assert sweep["method"] == "grid" and sweep["program"] in SCRIPTS
    assert sweep["command"][:3] == ["${env}", "${interpreter}", "${program}"] and "${args}" in sweep["command"]
    script = SCRIPTS[sweep["program"]]
    fields = {f.name: f for f in dataclasses.fields(script.Args)}
    parameters = sweep["parameters"]
    assert set(parameters) <= set(fields), set(parameters) - set(fields)
    # Every grid point, as the command line wandb agent builds (--name=value), parses to those values and passes
    # the script's flag checks.
    grid = {name: spec["values"] if "values" in spec else [spec["value"]] for name, spec in parameters.items()}
    fixed = [word for word in sweep["command"] if not word.startswith("${")]
    for values in itertools.product(*grid.values()):
        point = dict(zip(grid, values))
        args = tyro.cli(script.Args, args=fixed + [f"--{name}={value}" for name, value in point.items()])
        assert {name: getattr(args, name) for name in point} == point
        script.check_args(args)
        # a sweep that starts from shared checkpoints (or distils a teacher) names committed ones, one per seed
        seeded = flexloop_run.with_seed_in_paths(args)
        for shared in (seeded.init_checkpoint, getattr(seeded, "teacher_checkpoint", None)):
            if shared is not None:
                assert (ROOT / shared).is_file(), f"{path.name}: seed {args.seed} reads {shared}, which is not committed"


# ----- the lambda = 0 update: gradient at the taken action only -----

@pytest.mark.parametrize("overrides", [dict(), dict(ablation="anyk-td"), dict(backbone="lstm"),
                                       dict(iru_variant="paper")])
def test_taken_action_update_has_the_full_updates_loss_and_gradient_at_lambda_0(overrides):
    """With lambda_depth = 0 the update runs the online critic with gradient at the taken action alone (the
    reference's dqn_interp.py); every loss term and every parameter's gradient must equal the 6-action pass's."""
    args, network, target_network, batch = loss_setup(**overrides)
    gradients = {}
    for all_actions in (True, False):
        network.zero_grad()
        weights = torch.tensor(gcdqn.td_depth_weights(args.ablation, args.depth))
        loss, terms = gcdqn.flexloop_losses(network, target_network, batch, args, torch.tensor(0.0), weights,
                                            all_action_gradients=all_actions)
        loss.backward()
        terms = {**terms, "loss": loss}
        gradients[all_actions] = ({k: v.detach() for k, v in terms.items()},
                                  {n: p.grad.clone() for n, p in network.named_parameters()})
    (full_terms, full_grads), (fast_terms, fast_grads) = gradients[True], gradients[False]
    for name in full_terms:
        torch.testing.assert_close(fast_terms[name], full_terms[name], rtol=1e-5, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in full_grads.values())
    for name in full_grads:
        torch.testing.assert_close(fast_grads[name], full_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_taken_action_pass_differs_from_the_full_pass_once_the_kl_counts():
    """The shortcut is only valid at lambda_depth = 0: with lambda > 0 its gradient would miss the KL's, so the
    two must differ (this guards against the training loop picking it for a FlexLoop phase)."""
    args, network, target_network, batch = loss_setup()
    weights = torch.tensor(gcdqn.td_depth_weights("none", args.depth))
    grads = []
    for all_actions in (True, False):
        network.zero_grad()
        loss, _ = gcdqn.flexloop_losses(network, target_network, batch, args, torch.tensor(1.0), weights,
                                        all_action_gradients=all_actions)
        loss.backward()
        grads.append(network.gates.weight.grad.clone())
    assert not torch.allclose(grads[0], grads[1])


def test_q_at_one_action_and_at_depth_k_match_the_all_action_pass():
    args, network, _, batch = loss_setup()
    with torch.no_grad():
        q = network.all_depths(batch["obs"], batch["goal"])
        torch.testing.assert_close(network.all_depths(batch["obs"], batch["goal"], batch["action"])[..., 0],
                                   gcdqn.taken_action(q, batch["action"]))
        torch.testing.assert_close(network.full_depth(batch["obs"], batch["goal"]), q[-1])


# ----- the temperature loss -----

@pytest.mark.parametrize("alpha_loss", ["per-state", "batch-mean"])
def test_temperature_loss_is_the_references_mean_of_per_state_squared_errors(alpha_loss):
    """The reference (dqn_interp.py) averages (H(s) + target_entropy)^2 over states; squaring the batch's mean entropy
    (batch-mean, this script's loss before) settles at a colder alpha. Both read Q at depth K, ensemble mean."""
    args, network, target_network, batch = loss_setup(alpha_loss=alpha_loss, init_alpha=0.01)  # peaked policies
    terms = terms_for(args, network, target_network, batch, phase="pretrain", lam=0.0)
    with torch.no_grad():
        q_full = network.all_depths(batch["obs"], batch["goal"])[-1].mean(0)
    log_policy = F.log_softmax(q_full / network.log_alpha.exp(), -1)
    entropy = -(log_policy.exp() * log_policy).sum(-1)  # per state
    expected = ((entropy + args.target_entropy) ** 2).mean() if alpha_loss == "per-state" else \
        (entropy.mean() + args.target_entropy) ** 2
    torch.testing.assert_close(terms["alpha"], expected)
    torch.testing.assert_close(terms["entropy"], entropy.mean())
    assert entropy.std() > 0.01  # states differ, so the two forms differ here


def test_bf16_is_the_default_on_a_gpu_and_a_cpu_update_stays_float32():
    """--bf16 (on by default) autocasts the update on a GPU only: on a CPU, the loss and every gradient are the
    float32 ones exactly, so CPU runs and the CPU tests keep float32 numerics."""
    assert gcdqn.Args().bf16
    args, network, target_network, batch = loss_setup()
    results = []
    for bf16 in (True, False):
        loss = terms_for(dataclasses.replace(args, bf16=bf16), network, target_network, batch)["loss"]
        results.append([loss, *torch.autograd.grad(loss, list(network.parameters()))])
    assert all(torch.equal(a, b) for a, b in zip(*results))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_a_gpu_runs_the_matmuls_in_bf16_with_the_loss_close_to_float32():
    args, network, target_network, batch = loss_setup()
    network, target_network = network.cuda(), target_network.cuda()
    batch = {k: v.cuda() for k, v in batch.items()}
    weights = torch.tensor(gcdqn.td_depth_weights("none", args.depth), device="cuda")
    half, full = (gcdqn.flexloop_losses(network, target_network, batch, dataclasses.replace(args, bf16=bf16),
                                        torch.tensor(1.0, device="cuda"), weights)[0] for bf16 in (True, False))
    assert half.dtype == torch.float32 and not torch.equal(half, full)  # the matmuls did run in bf16
    assert torch.allclose(half, full, rtol=0.05), (half, full)
