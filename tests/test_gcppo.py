"""flexloop_gcppo.py: GAE, the PPO loss, the adjacent-depth KL, the IRU equations, teacher value targets,
smoke runs (both phases, CLI, resume, iru_pretrain, --init-checkpoint), bad input, and that learning happens."""

import copy
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import types
from functools import partial
from pathlib import Path

import pytest
import torch

import envs
import flexloop_gcdqn
import flexloop_gcppo as gcppo
import flexloop_run
import iru_pretrain
from envs.lightsout import min_solution_length

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # These networks are tiny: on a busy 2-core machine one thread is many times faster than two.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_args(tmp_path, **overrides):
    flags = dict(cuda=False, num_envs=8, num_steps=8, num_minibatches=2, update_epochs=2, depth=3, hidden_dim=16,
                 pretrain_timesteps=128, total_timesteps=128, num_eval_envs=4, eval_every=1, save_every=1,
                 run_dir=str(tmp_path))
    flags.update(overrides)
    return gcppo.Args(**flags)


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------
# GAE
# ---------------------------------------------------------------------------------------------------------
def test_gae_matches_reference_loop():
    gen = torch.Generator().manual_seed(0)
    T, N, gamma, lam = 9, 6, 0.9, 0.8
    rewards = torch.randn(T, N, generator=gen)
    values = torch.randn(T, N, generator=gen)
    final_values = torch.randn(T, N, generator=gen)
    next_value = torch.randn(N, generator=gen)
    ends = torch.rand(T, N, generator=gen)
    terminated, truncated = ends < 0.2, (ends >= 0.2) & (ends < 0.35)
    advantages, returns = gcppo.compute_gae(rewards, values, terminated, truncated, final_values, next_value,
                                            gamma, lam)

    # Reference: A_t = sum_l (gamma lam)^l delta_{t+l}, summed forward until the episode ends (that step included);
    # delta bootstraps from 0 on success, from V(final obs) on truncation, else from the next step's value.
    for n in range(N):
        for t in range(T):
            expected = 0.0
            for step in range(t, T):
                if terminated[step, n]:
                    bootstrap = 0.0
                elif truncated[step, n]:
                    bootstrap = final_values[step, n].item()
                else:
                    bootstrap = next_value[n].item() if step == T - 1 else values[step + 1, n].item()
                delta = rewards[step, n].item() + gamma * bootstrap - values[step, n].item()
                expected += (gamma * lam) ** (step - t) * delta
                if terminated[step, n] or truncated[step, n]:
                    break
            assert advantages[t, n].item() == pytest.approx(expected, abs=1e-5)
    assert torch.allclose(returns, advantages + values)
    assert terminated.any() and truncated.any()  # both kinds of ending were exercised


# ---------------------------------------------------------------------------------------------------------
# PPO loss
# ---------------------------------------------------------------------------------------------------------
def test_ppo_loss_on_a_hand_made_batch():
    logits = torch.zeros(4, 20, requires_grad=True)  # uniform policy: every log-prob is -log 20
    actions = torch.tensor([3, 5, 7, 9])
    ratios = torch.tensor([1.5, 0.5, 0.5, 1.5])
    old_logprobs = -math.log(20) - ratios.log()
    advantages = torch.tensor([1.0, 1.0, -1.0, -1.0])
    values = torch.tensor([1.0, 0.0, 2.0, 0.5], requires_grad=True)
    old_values = torch.tensor([0.5, 0.0, 0.0, 0.5])
    targets = torch.tensor([2.0, 1.0, 2.0, 0.5])
    policy_loss, value_loss, entropy, approx_kl, clipfrac = gcppo.ppo_loss(
        logits, values, actions, old_logprobs, old_values, advantages, targets, clip_coef=0.3, norm_adv=False)

    # per row -min(rA, clip(r)A): A>0 r=1.5 clipped to 1.3; A>0 r=0.5 unclipped; A<0 r=0.5 clipped to 0.7;
    # A<0 r=1.5 unclipped
    assert policy_loss.item() == pytest.approx((-1.3 - 0.5 + 0.7 + 1.5) / 4)
    policy_loss.backward()
    per_row_grad = logits.grad.abs().sum(1)
    assert per_row_grad[0] == 0 and per_row_grad[2] == 0  # the clip is active: no gradient
    assert per_row_grad[1] > 0 and per_row_grad[3] > 0

    # 0.5 * max((v - R)^2, (old + clip(v - old, +-0.3) - R)^2): 1.44 (clipped side), 1, 2.89 (clipped side), 0
    assert value_loss.item() == pytest.approx(0.5 * (1.44 + 1 + 2.89 + 0) / 4)
    unclipped = gcppo.ppo_loss(logits, values, actions, old_logprobs, old_values, advantages, targets, 0.3,
                               clip_vloss=False, norm_adv=False)[1]
    assert unclipped.item() == pytest.approx(0.5 * (1 + 1 + 0 + 0) / 4)
    assert entropy.item() == pytest.approx(math.log(20))
    assert clipfrac.item() == 1.0
    assert approx_kl.item() == pytest.approx(((ratios - 1) - ratios.log()).mean().item())

    # advantage normalisation: the same as passing normalised advantages
    normalised = (advantages - advantages.mean()) / advantages.std()
    with_norm = gcppo.ppo_loss(logits, values, actions, old_logprobs, old_values, advantages, targets, 0.3)[0]
    by_hand = gcppo.ppo_loss(logits, values, actions, old_logprobs, old_values, normalised, targets, 0.3,
                             norm_adv=False)[0]
    assert with_norm.item() == pytest.approx(by_hand.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------------------
# FlexLoop's adjacent-depth KL
# ---------------------------------------------------------------------------------------------------------
def test_divergence_is_kl_p_q():
    p_logits, q_logits = torch.tensor([[4.0, 0.0, -2.0]]), torch.tensor([[0.0, 1.0, 0.5]])
    p, q = p_logits.softmax(-1), q_logits.softmax(-1)
    expected = (p * (p / q).log()).sum()
    assert gcppo.IRUNetwork.divergence(p_logits, q_logits).item() == pytest.approx(expected.item())
    reverse = (q * (q / p).log()).sum()
    assert abs(expected - reverse) > 0.1  # the direction matters on this pair


def test_depth_loss_direction_gradient_and_zero():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 5, 20, generator=gen, requires_grad=True)  # (K, B, A)
    loss = gcppo.flexloop_depth_loss(logits)
    p = logits.detach().softmax(-1)
    expected = torch.stack([(p[k + 1] * (p[k + 1] / p[k]).log()).sum(-1).mean() for k in range(3)]).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-5)
    loss.backward()
    assert torch.all(logits.grad[-1] == 0)  # the deepest policy is only a target
    assert all(logits.grad[k].abs().sum() > 0 for k in range(3))  # every shallower depth moves

    agreeing = torch.randn(1, 5, 20, generator=gen).expand(4, 5, 20).clone().requires_grad_()
    loss = gcppo.flexloop_depth_loss(agreeing)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-6)
    assert agreeing.grad.abs().max() < 1e-6


def test_pretraining_update_reads_depth_k_alone_with_the_same_gradient():
    """every_depth=False (pretraining, lambda 0) gives the every-depth loss's PPO terms and gradient, without
    computing the depth KL; with lambda > 0 only the every-depth loss moves the shallow heads."""
    args = gcppo.Args(cuda=False)
    network = gcppo.IRUNetwork(depth=4, hidden_dim=16)
    gen = torch.Generator().manual_seed(3)
    rows = 32
    minibatch = dict(obs=torch.randint(0, 2, (rows, 20), generator=gen).float(),
                     goal=torch.randint(0, 2, (rows, 20), generator=gen).float(),
                     actions=torch.randint(0, 20, (rows,), generator=gen), logprobs=-3 + torch.rand(rows, generator=gen),
                     values=torch.randn(rows, generator=gen), advantages=torch.randn(rows, generator=gen),
                     value_targets=torch.randn(rows, generator=gen))
    gradients, terms = {}, {}
    for every_depth in (True, False):
        network.zero_grad()
        loss, terms[every_depth] = gcppo.flexloop_losses(network, minibatch, args, torch.tensor(0.0), every_depth)
        loss.backward()
        gradients[every_depth] = [param.grad.clone() for param in network.parameters()]
    for name in gcppo.LOSS_NAMES:
        if name != "losses/depth_kl":
            torch.testing.assert_close(terms[False][name], terms[True][name])
    assert terms[True]["losses/depth_kl"] > 0 and terms[False]["losses/depth_kl"] == 0
    for every, k_only in zip(gradients[True], gradients[False]):
        torch.testing.assert_close(k_only, every)
    network.zero_grad()
    gcppo.flexloop_losses(network, minibatch, args, torch.tensor(1.0), every_depth=True)[0].backward()
    assert not all(torch.allclose(a.grad, b) for a, b in zip(network.parameters(), gradients[True]))


# ---------------------------------------------------------------------------------------------------------
# The IRU actor-critic
# ---------------------------------------------------------------------------------------------------------
def test_iru_equations_by_hand():
    """Gates that ignore their input (zero weights) make every step a number: f = sigmoid(1) (the forget-gate
    bias init), i = tanh(0.5); the value head reads the first unit of h (residual) or c (paper)."""
    sigma, candidate = 1 / (1 + math.exp(-1.0)), math.tanh(0.5)
    c1 = (1 - sigma) * candidate
    c2 = sigma * c1 + (1 - sigma) * candidate
    expected = {"residual": [math.tanh(c1), math.tanh(c1) + math.tanh(c2)], "paper": [c1, c2]}
    for variant, values_by_hand in expected.items():
        network = gcppo.IRUNetwork(depth=2, hidden_dim=2, variant=variant)
        assert torch.all(network.gates.bias[:2] == 1.0)  # forget-gate bias initialised to +1
        with torch.no_grad():
            network.gates.weight.zero_()
            network.gates.bias[2:] = 0.5
            network.critic.weight.copy_(torch.tensor([[1.0, 0.0]]))
            network.critic.bias.zero_()
        obs = torch.randint(0, 2, (3, 20)).float()
        _, values = network.all_depths(obs, obs.flip(0))
        assert torch.allclose(values, torch.tensor(values_by_hand)[:, None].expand(2, 3), atol=1e-6)


def test_iru_wiring_matches_the_equations():
    """Random weights: normalised input, LayerNorm(Linear(x)), LayerNorm over concat[x_emb, carried], the
    update of c and h, and the heads, written out with explicit means and variances."""
    torch.manual_seed(0)
    layer_norm = lambda x, w, b: (x - x.mean(-1, keepdim=True)) / torch.sqrt(  # noqa: E731
        x.var(-1, unbiased=False, keepdim=True) + 1e-5) * w + b
    for variant in ["residual", "paper"]:
        network = gcppo.IRUNetwork(depth=3, hidden_dim=4, variant=variant)
        with torch.no_grad():
            for param in [network.embed_norm.weight, network.embed_norm.bias, network.gate_norm.weight,
                          network.gate_norm.bias]:
                param.normal_()
            network.obs_mean.fill_(0.5)
            network.obs_var.fill_(0.25)
        obs, goal = torch.randint(0, 2, (5, 20)).float(), torch.randint(0, 2, (5, 20)).float()
        logits, values = network.all_depths(obs, goal)

        x = (torch.cat([obs, goal], -1) - 0.5) / math.sqrt(0.25 + 1e-8)
        x_emb = layer_norm(x @ network.embed.weight.T + network.embed.bias, network.embed_norm.weight,
                           network.embed_norm.bias)
        c = h = torch.zeros(5, 4)
        for k in range(3):
            carried = h if variant == "residual" else torch.tanh(c)
            z = layer_norm(torch.cat([x_emb, carried], -1), network.gate_norm.weight, network.gate_norm.bias)
            gates = z @ network.gates.weight.T + network.gates.bias
            f, i = torch.sigmoid(gates[:, :4]), torch.tanh(gates[:, 4:])
            c = f * c + (1 - f) * i
            h = h + torch.tanh(c)
            read = h if variant == "residual" else c
            assert torch.allclose(logits[k], read @ network.actor.weight.T + network.actor.bias, atol=1e-5)
            assert torch.allclose(values[k], (read @ network.critic.weight.T + network.critic.bias)[:, 0], atol=1e-5)


def test_depth_protocol_and_act():
    network = gcppo.IRUNetwork(depth=3, hidden_dim=8)
    obs, goal = torch.randint(0, 2, (6, 20)).float(), torch.randint(0, 2, (6, 20)).float()
    state = network.start(obs, goal)
    assert torch.all(state[1] == 0) and torch.all(state[2] == 0)  # zero recurrent state at depth 0
    all_logits, _ = network.all_depths(obs, goal)
    for k in range(3):
        state = network.advance(state)
        assert torch.allclose(network.decide(state), all_logits[k])
    rows = torch.tensor([4, 1])
    shallow = network.gather(network.start(obs, goal), rows)
    assert torch.allclose(network.decide(network.advance(shallow)), all_logits[0, rows])

    logits = torch.tensor([[0.0, math.log(3.0), -30.0]]).expand(30000, 3)
    assert torch.all(network.act(logits, deterministic=True) == 1)
    counts = torch.bincount(network.act(logits, torch.Generator().manual_seed(0)), minlength=3) / 30000
    assert counts.tolist() == pytest.approx([0.25, 0.75, 0.0], abs=0.015)


def test_running_normalizer_matches_whole_data_statistics():
    network = gcppo.IRUNetwork(depth=2, hidden_dim=4)
    batches = [torch.rand(50, 40) * 3, torch.rand(70, 40), torch.rand(10, 40) - 2]
    for batch in batches:
        network.update_normalizer(batch[:, :20], batch[:, 20:])
    data = torch.cat(batches)
    assert torch.allclose(network.obs_mean, data.mean(0), atol=1e-4)
    assert torch.allclose(network.obs_var, data.var(0, unbiased=False), atol=1e-4)
    assert "obs_mean" in network.state_dict()  # checkpoints and evaluation carry it


def test_env_max_presses():
    env = envs.make_vec("LightsOut-4x5-v0", 512, split="train", max_presses=2).unwrapped
    obs, _ = env.reset(seed=0)
    lengths = min_solution_length(obs["observation"], obs["desired_goal"])
    assert set(lengths.tolist()) == {1, 2}
    with pytest.raises(ValueError, match="max_presses"):
        envs.make_vec("LightsOut-4x5-v0", 4, split="unseen", max_presses=3)


# ---------------------------------------------------------------------------------------------------------
# Smoke runs, checkpoints, resume, iru_pretrain, --init-checkpoint
# ---------------------------------------------------------------------------------------------------------
def test_cli_two_phase_run_checkpoints_and_resume(tmp_path):
    """The CLI in a fresh process: pretrain, then FlexLoop; this process reads its checkpoints and resumes."""
    command = [sys.executable, "flexloop_gcppo.py", "--no-cuda", "--num-envs", "8", "--num-steps", "8",
               "--num-minibatches", "2", "--update-epochs", "2", "--depth", "3", "--hidden-dim", "16",
               "--pretrain-timesteps", "128", "--total-timesteps", "128", "--num-eval-envs", "4",
               "--eval-every", "1", "--run-dir", str(tmp_path)]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    (run_dir,) = tmp_path.iterdir()
    assert run_dir.name.startswith("LightsOut-4x5-v0__flexloop_gcppo__1__")
    records = read_metrics(run_dir)
    train_records = [r for r in records if "losses/policy_loss" in r]
    assert [r["phase"] for r in train_records] == ["pretrain"] * 2 + ["flexloop"] * 2
    assert [r["charts/lambda_depth"] for r in train_records] == [0.0, 0.0, 0.05, 0.05]
    assert [r["global_step"] for r in train_records] == [64, 128, 192, 256]
    last_eval = [r for r in records if "eval/train/success_depth_1" in r][-1]
    assert {f"eval/{s}/success_depth_{k}" for s in ["train", "unseen"] for k in [1, 2, 3]} <= set(last_eval)

    pretrained = flexloop_run.load_checkpoint(run_dir / "pretrained.pt")
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert final["global_step"] == 256 and final["iteration"] == 4 and final["phase"] == "flexloop"
    assert pretrained["teacher_model"] is None
    for name, tensor in pretrained["model"].items():  # the teacher is the pretrained model at the switch
        assert torch.equal(final["teacher_model"][name], tensor)
    network, args = gcppo.network_from_checkpoint(final)
    assert args.depth == 3 and network.obs_count > 100  # the normaliser travels in the checkpoint
    obs = torch.randint(0, 2, (2, 20)).float()
    assert network.all_depths(obs, obs)[0].shape == (3, 2, 20)

    # Resume from the checkpoint written at the phase switch: same folder, no duplicated steps.
    gcppo.train(gcppo.Args(resume=str(run_dir / "pretrained.pt"), cuda=False))
    train_records = [r for r in read_metrics(run_dir) if "losses/policy_loss" in r]
    assert [r["global_step"] for r in train_records] == [64, 128, 192, 256]
    resumed = flexloop_run.load_checkpoint(run_dir / "final.pt")
    for name, tensor in pretrained["model"].items():
        assert torch.equal(resumed["teacher_model"][name], tensor)


def test_iru_pretrain_then_flexloop_uses_teacher_values(tmp_path):
    assert iru_pretrain.pretrain_args(flexloop_gcdqn.Args()).num_epochs == 0
    pretrain = iru_pretrain.pretrain_args(tiny_args(tmp_path, lambda_depth=1.0, init_checkpoint="x.pt"))
    assert (pretrain.total_timesteps, pretrain.pretrain_timesteps, pretrain.lambda_depth) == (0, 128, 0.0)
    assert pretrain.init_checkpoint is None
    default = iru_pretrain.pretrain_default(gcppo)
    run_dir = iru_pretrain.main("gcppo", tiny_args(tmp_path, exp_name=default.exp_name))
    assert run_dir.name.split("__")[1] == "iru_pretrain_gcppo"
    assert {r["phase"] for r in read_metrics(run_dir)} == {"pretrain"}
    checkpoint = flexloop_run.load_checkpoint(run_dir / "final.pt")

    # A teacher whose value is the constant 7: the student starts as its copy, so with teacher targets its value
    # loss is exactly 0 throughout (the value head gets no gradient); GAE returns differ from 7 by the rewards.
    with torch.no_grad():
        checkpoint["model"]["critic.weight"].zero_()
        checkpoint["model"]["critic.bias"].fill_(7.0)
    flexloop_run.save_checkpoint(tmp_path / "teacher.pt", checkpoint)
    for teacher_targets in [True, False]:
        run_dir = gcppo.train(tiny_args(tmp_path / str(teacher_targets), init_checkpoint=str(tmp_path / "teacher.pt"),
                                        teacher_value_targets=teacher_targets))
        value_losses = [r["losses/value_loss"] for r in read_metrics(run_dir) if "losses/value_loss" in r]
        assert len(value_losses) == 2
        if teacher_targets:
            assert value_losses == [0.0, 0.0]
        else:
            assert min(value_losses) > 0.01
        final = flexloop_run.load_checkpoint(run_dir / "final.pt")
        assert final["teacher_model"]["critic.bias"].item() == 7.0


# ---------------------------------------------------------------------------------------------------------
# The authors' PPO choices (issue 16): hard resets, rollout-wide advantage normalisation, time-row minibatches,
# the normaliser updated before the epochs. One tiny run with CleanRL's choices and one with the authors' four.
# ---------------------------------------------------------------------------------------------------------
SPY_ITERATIONS, SPY_ENVS, SPY_STEPS, SPY_MINIBATCHES, SPY_EPOCHS = 5, 8, 8, 4, 2
REFERENCE_CHOICES = dict(hard_reset_every=2, advantage_norm="rollout", minibatch_layout="time-rows",
                         obs_norm_update="before-epochs")
CLEANRL_CHOICES = dict(hard_reset_every=0, advantage_norm="minibatch", minibatch_layout="rows",
                       obs_norm_update="after-epochs")


def spied_run(tmp_path, **overrides):
    """Train a few iterations and record what each rollout starts from and what each update sees."""
    rollouts, updates, losses = [], [], []
    collect, make_update, ppo_loss = gcppo.collect_rollout, gcppo.make_update, gcppo.ppo_loss

    def spy_collect(network, env, obs, buffers, generator, episode_sums, step=gcppo.rollout_step):
        before = dict(lengths=env.episode_length.clone(), goal=env.goal.clone())
        obs = collect(network, env, obs, buffers, generator, episode_sums, step)
        rollouts.append({**before, "goal_after": env.goal.clone()})
        return obs

    def spy_make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums, **kwargs):
        update = make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums, **kwargs)

        def spy_update():
            updates.append(dict(rows=minibatch_index.clone(), obs_count=network.obs_count.item(),
                                obs_mean=network.obs_mean.clone(), advantages=buffers["advantages"].clone(),
                                inputs=torch.cat([buffers["obs"], buffers["goal"]], -1).flatten(0, 1).clone()))
            update()
        return spy_update

    def spy_ppo_loss(*loss_args, **kwargs):
        losses.append(dict(advantages=loss_args[5].clone(), norm_adv=loss_args[9]))
        return ppo_loss(*loss_args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gcppo, "collect_rollout", spy_collect)
        patch.setattr(gcppo, "make_update", spy_make_update)
        patch.setattr(gcppo, "ppo_loss", spy_ppo_loss)
        run_dir = gcppo.train(tiny_args(tmp_path, num_envs=SPY_ENVS, num_steps=SPY_STEPS,
                                        num_minibatches=SPY_MINIBATCHES, update_epochs=SPY_EPOCHS,
                                        pretrain_timesteps=SPY_ITERATIONS * SPY_ENVS * SPY_STEPS, total_timesteps=0,
                                        eval_every=100, **overrides))
    assert len(rollouts) == SPY_ITERATIONS
    assert len(updates) == len(losses) == SPY_ITERATIONS * SPY_EPOCHS * SPY_MINIBATCHES
    return dict(run_dir=run_dir, rollouts=rollouts, updates=updates, losses=losses)


@pytest.fixture(scope="module")
def spied_runs(tmp_path_factory):
    """{"ours": CleanRL's four choices, "reference": the authors' four}, each with its spy records."""
    return {"ours": spied_run(tmp_path_factory.mktemp("ours"), **CLEANRL_CHOICES),
            "reference": spied_run(tmp_path_factory.mktemp("reference"), **REFERENCE_CHOICES)}


def per_iteration(records):
    per = SPY_EPOCHS * SPY_MINIBATCHES
    return [records[i * per:(i + 1) * per] for i in range(SPY_ITERATIONS)]


def test_hard_reset_every_n_iterations(spied_runs):
    """A hard reset (after iterations 2 and 4 here) starts every env on a fresh task at step 0; otherwise
    the next rollout continues the episodes in flight. The first rollout follows the initial reset."""
    for name, reset_before in [("ours", {0}), ("reference", {0, 2, 4})]:
        rollouts = spied_runs[name]["rollouts"]
        starts_fresh = {i for i, r in enumerate(rollouts) if torch.all(r["lengths"] == 0)}
        assert starts_fresh == reset_before, name
        for i in reset_before - {0}:  # every goal is new, not only those of the episodes that ended
            assert torch.all((rollouts[i]["goal"] != rollouts[i - 1]["goal_after"]).any(-1)), name
    assert gcppo.Args().hard_reset_every == 3  # the authors' default


def test_advantage_norm_rollout_vs_minibatch(spied_runs):
    """rollout: the stored advantages of the whole rollout have mean 0 and std 1 and the loss does not
    renormalise its minibatch (whose own mean need not be 0); minibatch: raw advantages, normalised in the loss."""
    reference = spied_runs["reference"]
    for update in reference["updates"]:
        assert update["advantages"].mean().item() == pytest.approx(0.0, abs=1e-5)
        assert update["advantages"].std().item() == pytest.approx(1.0, abs=1e-4)
    assert not any(loss["norm_adv"] for loss in reference["losses"])
    assert max(abs(loss["advantages"].mean().item()) for loss in reference["losses"]) > 0.05

    ours = spied_runs["ours"]
    assert all(loss["norm_adv"] for loss in ours["losses"])
    raw = ours["updates"][0]["advantages"]
    assert abs(raw.mean().item()) > 1e-3 or abs(raw.std().item() - 1) > 1e-3


def test_minibatch_layout_time_rows(spied_runs):
    """time-rows: each minibatch is num_steps / num_minibatches whole time steps of every env, each epoch covers
    every row once, and the steps are reshuffled from epoch to epoch; rows: minibatches cut across time steps."""
    steps_per_minibatch = SPY_STEPS // SPY_MINIBATCHES
    epochs = []
    for update_records in per_iteration(spied_runs["reference"]["updates"]):
        for epoch in range(SPY_EPOCHS):
            minibatches = [u["rows"] for u in update_records[epoch * SPY_MINIBATCHES:(epoch + 1) * SPY_MINIBATCHES]]
            for rows in minibatches:
                steps = (rows // SPY_ENVS).unique()
                assert len(steps) == steps_per_minibatch
                whole = (steps[:, None] * SPY_ENVS + torch.arange(SPY_ENVS)).flatten()
                assert torch.equal(rows.sort().values, whole.sort().values)
            assert torch.equal(torch.cat(minibatches).sort().values, torch.arange(SPY_ENVS * SPY_STEPS))
            epochs.append(torch.cat(minibatches))
    assert len({tuple(order.tolist()) for order in epochs}) > 1  # reshuffled

    ours = [u["rows"] for u in spied_runs["ours"]["updates"]]
    assert any(len((rows // SPY_ENVS).unique()) > steps_per_minibatch for rows in ours)


def test_obs_norm_update_before_or_after_epochs(spied_runs):
    """before-epochs: every update of iteration i already sees rollouts 0..i in the normaliser; after-epochs
    (ours): rollouts 0..i-1 only, so the first iteration's updates see the initial statistics (mean 0)."""
    batch = SPY_ENVS * SPY_STEPS
    for name, seen_extra in [("ours", 0), ("reference", 1)]:
        rollout_means = []
        for i, update_records in enumerate(per_iteration(spied_runs[name]["updates"])):
            rollout_means.append(update_records[0]["inputs"].mean(0))
            seen = rollout_means[:i + seen_extra]
            expected = torch.stack(seen).mean(0) if seen else torch.zeros(40)
            for update in update_records:  # fixed through the epochs
                assert update["obs_count"] == pytest.approx(1e-4 + len(seen) * batch), (name, i)
                torch.testing.assert_close(update["obs_mean"], expected, atol=1e-5, rtol=0)


def test_timeout_bootstrap_value_or_zero(tmp_path):
    """value (ours): a truncated step bootstraps from V(final obs); zero: a time-out is a termination."""
    gen = torch.Generator().manual_seed(3)
    T, N = 6, 5
    network = gcppo.IRUNetwork(depth=2, hidden_dim=8)
    buffers = gcppo.make_rollout_buffers(T, N, "cpu")
    for name in ["obs", "goal", "final_obs", "final_goal"]:
        buffers[name].copy_(torch.randint(0, 2, (T, N, 20), generator=gen).float())
    buffers["values"].copy_(torch.randn(T, N, generator=gen))
    buffers["rewards"].copy_(torch.randn(T, N, generator=gen))
    buffers["truncated"][2, :3] = True
    buffers["terminated"][4, 1] = True
    next_obs = {"observation": torch.zeros(N, 20), "desired_goal": torch.ones(N, 20)}
    next_value = network.full_depth(next_obs["observation"], next_obs["desired_goal"])[1]
    final_values = network.full_depth(buffers["final_obs"].flatten(0, 1),
                                      buffers["final_goal"].flatten(0, 1))[1].view(T, N)
    advantages = {}
    for choice in ["value", "zero"]:
        gcppo.prepare_targets(network, None, buffers, next_obs,  # raw advantages: normalised in the loss
                              tiny_args(tmp_path, timeout_bootstrap=choice, advantage_norm="minibatch"))
        advantages[choice] = buffers["advantages"].clone()
    ended = buffers["terminated"] | buffers["truncated"]
    as_termination = gcppo.compute_gae(buffers["rewards"], buffers["values"], ended, torch.zeros_like(ended),
                                       final_values, next_value, 0.99, 0.95)[0]
    with_value = gcppo.compute_gae(buffers["rewards"], buffers["values"], buffers["terminated"], buffers["truncated"],
                                   final_values, next_value, 0.99, 0.95)[0]
    torch.testing.assert_close(advantages["zero"], as_termination)
    torch.testing.assert_close(advantages["value"], with_value)
    assert not torch.allclose(advantages["zero"][:3, :3], advantages["value"][:3, :3])  # the truncated envs differ
    torch.testing.assert_close(advantages["zero"][:, 3:], advantages["value"][:, 3:])  # the others do not
    assert gcppo.Args().timeout_bootstrap == "value"


def test_reference_ppo_choices_smoke_run_and_cli(spied_runs):
    run_dir = spied_runs["reference"]["run_dir"]
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert final["iteration"] == SPY_ITERATIONS
    assert {k: final["args"][k] for k in REFERENCE_CHOICES} == REFERENCE_CHOICES  # a resume keeps them
    records = [r for r in read_metrics(run_dir) if "losses/policy_loss" in r]
    assert len(records) == SPY_ITERATIONS
    assert all(math.isfinite(r[k]) for r in records for k in ["losses/policy_loss", "losses/value_loss"])
    assert "eval/train/success_depth_3" in read_metrics(run_dir)[-1]

    flags = ["--hard-reset-every", "3", "--advantage-norm", "rollout", "--minibatch-layout", "time-rows",
             "--obs-norm-update", "before-epochs"]
    parsed = flexloop_run.parse_args(gcppo.Args, flags)
    assert (parsed.hard_reset_every, parsed.advantage_norm, parsed.minibatch_layout, parsed.obs_norm_update) == \
        (3, "rollout", "time-rows", "before-epochs")
    # The defaults: the authors' three choices that showed no loss against CleanRL's, and our normaliser order,
    # which the screen kept (README, LightsOut screen).
    defaults = gcppo.Args()
    assert (defaults.hard_reset_every, defaults.advantage_norm, defaults.minibatch_layout,
            defaults.obs_norm_update) == (3, "rollout", "time-rows", "after-epochs")
    assert flexloop_run.parse_args(gcppo.Args, ["--hard-reset-every", "0", "--advantage-norm", "minibatch", "--minibatch-layout",
                             "rows"]).minibatch_layout == "rows"  # CleanRL's choices stay one flag away


def test_gpu_speedups_are_on_by_default_and_ignored_on_cpu(tmp_path, no_torch_compile):
    # On a GPU the update is compiled and graphed (BENCHMARKS.md, 4x); a CPU run with the same defaults
    # must neither compile nor fail on the GPU-only flag.
    args = tiny_args(tmp_path, pretrain_timesteps=64, total_timesteps=64)
    assert args.compile and args.cuda_graph
    run_dir = gcppo.train(args)
    assert (Path(run_dir) / "final.pt").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiled", [False, True])
def test_captured_update_trains_as_the_eager_update_does(compiled, exact_float32_matmuls):
    """The graph replays one recorded minibatch update; train() copies each minibatch's rows into its index
    before a replay. Replays must train on those new rows, as eager updates do: same start, same rows, same
    parameters and losses. The capture's 3 warm-up calls are real updates on the first minibatch."""
    device = torch.device("cuda")
    args = tiny_args(Path("."), cuda=True, num_envs=64, num_steps=8, num_minibatches=4, hidden_dim=32)
    generator = torch.Generator(device).manual_seed(0)
    buffers = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, device)
    for name in ("obs", "goal"):
        buffers[name].copy_(torch.rand(buffers[name].shape, generator=generator, device=device).round())
    buffers["actions"].random_(0, 20, generator=generator)
    for name in ("logprobs", "values", "advantages", "value_targets"):
        buffers[name].normal_(generator=generator)
    buffers["logprobs"].sub_(3.0)  # centred on log(1/20), a fresh policy's log-probabilities
    rows = torch.randperm(args.num_envs * args.num_steps, generator=generator, device=device).view(4, -1)
    start = gcppo.build_network(args, device)

    def trainer():
        network = copy.deepcopy(start)
        optimizer = torch.optim.Adam(network.parameters(), lr=1e-3, eps=args.adam_eps, capturable=True)
        index, loss_sums = rows[0].clone(), torch.zeros(len(gcppo.LOSS_NAMES), device=device)
        update = gcppo.make_update(args, network, optimizer, buffers, index, torch.tensor(0.5, device=device),
                                   loss_sums)
        return network, index, loss_sums, update

    eager, eager_index, eager_sums, eager_update = trainer()
    for i in [0, 0, 0, 0, 1, 2, 3]:  # the 3 warm-up updates, then one per minibatch
        eager_index.copy_(rows[i])
        eager_update()
    graphed, graphed_index, graphed_sums, graphed_update = trainer()
    replay = flexloop_run.capture_cuda_graph(torch.compile(graphed_update) if compiled else graphed_update, [])
    for i in range(4):
        graphed_index.copy_(rows[i])
        replay()
    smooth = [i for i, name in enumerate(gcppo.LOSS_NAMES) if name != "losses/clipfrac"]  # a count can flip a row
    torch.testing.assert_close(graphed_sums[smooth], eager_sums[smooth], rtol=1e-3, atol=1e-5)
    for (name, a), b in zip(graphed.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4, msg=name)
    assert not torch.allclose(graphed.actor.weight, start.actor.weight)  # it trained


def test_rollout_writes_its_last_obs_in_place_and_the_normalizer_keeps_its_tensors():
    """make_rollout is collect_rollout with the obs after the last step written back into the obs it started from
    (a captured rollout reads and writes fixed tensors); update_normalizer writes its statistics in place, so a
    captured forward reads the new ones."""
    args = tiny_args(Path("."))
    network = gcppo.build_network(args, "cpu")
    runs = []
    for _ in range(2):
        env = envs.make_vec(args.env_id, args.num_envs, seed=5, check_actions=False, max_steps=3).unwrapped
        obs, _ = env.reset()
        buffers, sums = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, "cpu"), torch.zeros(4)
        runs.append(dict(env=env, obs=obs, buffers=buffers, sums=sums, generator=torch.Generator().manual_seed(0)))
    direct, in_place = runs
    start = {key: tensor.data_ptr() for key, tensor in in_place["obs"].items()}
    rollout = gcppo.make_rollout(network, in_place["env"], in_place["obs"], in_place["buffers"],
                                 in_place["generator"], in_place["sums"])
    for _ in range(2):
        direct["obs"] = gcppo.collect_rollout(network, direct["env"], direct["obs"], direct["buffers"],
                                              direct["generator"], direct["sums"])
        rollout()
        for name in direct["buffers"]:
            assert torch.equal(direct["buffers"][name], in_place["buffers"][name]), name
        for key in start:
            assert torch.equal(direct["obs"][key], in_place["obs"][key])
            assert in_place["obs"][key].data_ptr() == start[key]
    assert torch.equal(direct["sums"], in_place["sums"]) and in_place["sums"][0] > 0
    gcppo.copy_obs(in_place["obs"], in_place["env"].reset()[0])  # a hard reset, as train() does it
    assert torch.equal(in_place["obs"]["desired_goal"], in_place["env"].goal.float())

    statistics = {name: getattr(network, name).data_ptr() for name in ("obs_mean", "obs_var", "obs_count")}
    network.update_normalizer(in_place["buffers"]["obs"].flatten(0, 1), in_place["buffers"]["goal"].flatten(0, 1))
    assert network.obs_count > 1
    assert {name: getattr(network, name).data_ptr() for name in statistics} == statistics


def test_the_whole_rollout_step_compiles_to_the_eager_steps_without_recompiling():
    """--compile-env-step compiles rollout_step whole: the policy, the action's draw, the env step with its
    auto-reset draws, and the writes into this step's slice of the buffers. Under dynamo's trace and
    functionalisation with PyTorch's own kernels (the aot_eager backend, on a CPU: the same numbers to the bit) two
    rollouts fill the buffers, the episode sums, the env and the obs exactly as the eager steps do, and every step
    after the first reuses the compiled graphs: a new buffer slice each step must not recompile."""
    args = tiny_args(Path("."), num_envs=64, num_steps=12, max_episode_steps=4, depth=3, hidden_dim=16)
    graphs, graphs_after_each_step = [], []

    def counting_backend(graph, example_inputs):
        graphs.append(graph)
        return torch._dynamo.backends.debugging.aot_eager(graph, example_inputs)

    compiled = torch.compile(gcppo.rollout_step, backend=counting_backend)

    def compiled_step(*step_args):
        obs = compiled(*step_args)
        graphs_after_each_step.append(len(graphs))
        return obs

    torch._dynamo.reset()
    runs = {}
    for name, step in (("eager", gcppo.rollout_step), ("compiled", compiled_step)):
        torch.manual_seed(0)
        network = gcppo.build_network(args, "cpu")
        env = envs.make_vec(args.env_id, args.num_envs, seed=3, check_actions=False,
                            max_steps=args.max_episode_steps).unwrapped
        buffers, sums = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, "cpu"), torch.zeros(4)
        obs, _ = env.reset()
        rollout = gcppo.make_rollout(network, env, obs, buffers, torch.Generator().manual_seed(7), sums, step)
        rollout()
        rollout()
        runs[name] = dict(buffers=buffers, sums=sums, obs=obs, board=env.board, goal=env.goal,
                          lengths=env.episode_length)
    eager, traced = runs["eager"], runs["compiled"]
    for name in gcppo.make_rollout_buffers(1, 1, "cpu"):
        assert torch.equal(traced["buffers"][name], eager["buffers"][name]), name
    for name in ("sums", "board", "goal", "lengths"):
        assert torch.equal(traced[name], eager[name]), name
    assert all(torch.equal(traced["obs"][key], eager["obs"][key]) for key in eager["obs"])
    assert eager["sums"][0] > 0  # episodes ended and auto-reset inside the compiled steps
    # compiled in the first step (in pieces: each draw from a named generator splits the graph), never again
    assert len(graphs_after_each_step) == 2 * args.num_steps and 0 < graphs_after_each_step[0] == len(graphs)


def test_train_compiles_the_whole_rollout_step_or_its_policy_pass_alone():
    """compiled_rollout_step hands its compile function (train(): run.compiled) the whole rollout_step with
    --compile-env-step, and otherwise the policy pass, which the step then calls in place of network.full_depth."""
    args = tiny_args(Path("."))
    network = gcppo.build_network(args, "cpu")
    given, policy_calls = [], []

    def compiled(fn):
        given.append(fn)
        return fn if fn is gcppo.rollout_step else lambda *inputs: policy_calls.append(1) or fn(*inputs)

    assert gcppo.compiled_rollout_step(compiled, network, whole_step=True) is gcppo.rollout_step
    step = gcppo.compiled_rollout_step(compiled, network, whole_step=False)
    assert given == [gcppo.rollout_step, network.full_depth]
    env, _ = gcppo.make_envs(args, "cpu")
    buffers = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, "cpu")
    gcppo.collect_rollout(network, env, env.reset()[0], buffers, torch.Generator(), torch.zeros(4), step)
    assert len(policy_calls) == args.num_steps  # every step's policy pass went through the compiled one


def rollouts_from_the_same_start(args, device, captured, compiled=None):
    """Three rollouts from one seed, eagerly or replayed from one captured graph whose single warm-up call is the
    first: between rollouts the normaliser takes in the last one, and before the third a hard reset refreshes obs.
    compiled: "policy", the policy pass torch.compile'd, as train() runs it on a GPU; "step", the whole step, as
    with --compile-env-step; backend, torch.compile's (inductor by default)."""
    torch.manual_seed(0)
    network = gcppo.build_network(args, device)
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=3, check_actions=False,
                        max_steps=args.max_episode_steps).unwrapped
    buffers = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, device)
    generator, episode_sums = torch.Generator(device).manual_seed(7), torch.zeros(4, device=device)
    obs, _ = env.reset()
    step = {None: gcppo.rollout_step, "step": torch.compile(gcppo.rollout_step),
            "policy": partial(gcppo.rollout_step, forward=torch.compile(network.full_depth))}[compiled]
    rollout = gcppo.make_rollout(network, env, obs, buffers, generator, episode_sums, step)
    if captured:
        replay = flexloop_run.capture_cuda_graph(rollout, [generator, env.generator], warmup=1)
    else:
        rollout()
    records = []
    for i in range(3):
        if i > 0:
            if i == 2:
                gcppo.copy_obs(obs, env.reset()[0])
            network.update_normalizer(buffers["obs"].flatten(0, 1), buffers["goal"].flatten(0, 1))
            replay() if captured else rollout()
        records.append({**{name: tensor.clone() for name, tensor in buffers.items()},
                        "next_obs": obs["observation"].clone(), "episode_sums": episode_sums.clone()})
    return records


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("compiled", [None, "policy", "step"])
def test_captured_rollout_equals_the_eager_rollout(exact_float32_matmuls, compiled):
    """The rollout graph replays collect_rollout's steps: from the same seeds, its buffers, episode sums and final
    obs must be the eager rollout's, through normaliser updates (read in place) and a hard reset (the static obs
    refreshed). The capture's one warm-up call is the first rollout: more warm-up calls would shift every record
    by a rollout and add their episodes to the sums."""
    device = torch.device("cuda")
    args = tiny_args(Path("."), cuda=True, num_envs=256, num_steps=24, max_episode_steps=6, depth=3, hidden_dim=32)
    eager = rollouts_from_the_same_start(args, device, captured=False, compiled=compiled)
    captured = rollouts_from_the_same_start(args, device, captured=True, compiled=compiled)
    for i, (a, b) in enumerate(zip(eager, captured)):
        for name in a:
            if name in ("advantages", "value_targets"):
                continue  # prepare_targets writes them
            if a[name].is_floating_point():
                torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-6, msg=f"rollout {i}: {name}")
            else:
                assert torch.equal(b[name], a[name]), f"rollout {i}: {name}"
    # The replays drew fresh numbers: later rollouts differ from the first, and every action is a button.
    assert not torch.equal(captured[1]["actions"], captured[0]["actions"])
    assert not torch.equal(captured[2]["actions"], captured[1]["actions"])
    assert all(record["actions"].min() >= 0 and record["actions"].max() < 20 for record in captured)
    # episode_sums counted each episode that ended in the three rollouts once, with its length
    ended = [record["terminated"] | record["truncated"] for record in captured]
    assert captured[-1]["episode_sums"][0].item() == sum(e.sum().item() for e in ended) > 0
    assert 0 < captured[-1]["episode_sums"][3].item() <= 3 * args.num_envs * args.num_steps


def test_evaluation_plays_the_tasks_of_a_seeded_reset_at_every_depth():
    """evaluate(seed) reseeds each split's env before each depth: every depth plays the tasks that
    env.reset(seed=seed) draws, with the argmax policy, one episode per env."""
    args = tiny_args(Path("."), depth=3, hidden_dim=16, num_eval_envs=64)
    torch.manual_seed(0)
    network = gcppo.build_network(args, "cpu")
    _, eval_envs = gcppo.make_envs(args, "cpu")
    results = gcppo.evaluate(network, eval_envs, seed=5)
    for split, env in eval_envs.items():
        for depth in range(1, args.depth + 1):
            obs, _ = env.reset(seed=5)
            alive, solved = torch.ones(env.num_envs, dtype=torch.bool), torch.zeros(env.num_envs, dtype=torch.bool)
            for _ in range(env.max_steps):
                logits = network.policy_logits(obs["observation"], obs["desired_goal"], depth)
                obs, _, terminated, truncated, _ = env.step(logits.argmax(-1))
                solved |= alive & terminated
                alive &= ~(terminated | truncated)
            assert results[f"eval/{split}/success_depth_{depth}"].item() == solved.float().mean().item()
    again = gcppo.evaluate(network, eval_envs, seed=5)  # the same seed, the same tasks, the same scores
    assert all(again[name].item() == value.item() for name, value in results.items())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_captured_evaluation_equals_the_eager_one_and_reads_the_live_weights(exact_float32_matmuls):
    """The evaluation's episodes, captured at the first evaluation and replayed after, score what the eager
    evaluation scores on the same tasks, before and after the weights change in place (as training changes them)."""
    device = torch.device("cuda")
    args = tiny_args(Path("."), cuda=True, depth=3, hidden_dim=32, num_eval_envs=256)
    torch.manual_seed(1)
    network = gcppo.build_network(args, device)
    _, eval_envs = gcppo.make_envs(args, device)
    captured = gcppo.make_evaluate(network, eval_envs, cuda_graph=True)
    for round_ in range(2):
        eager = gcppo.evaluate(network, eval_envs, seed=7)
        replayed = captured(seed=7)
        assert replayed.keys() == eager.keys()
        for name in eager:
            assert replayed[name].item() == eager[name].item(), f"evaluation {round_}: {name}"
        with torch.no_grad():  # what an update does: new values in the same tensors
            for p in network.parameters():
                p.add_(0.2 * torch.randn_like(p))


def one_press_gpu_run(tmp_path, **overrides):
    """A short GPU run on one-press goals (20 pretraining and 4 FlexLoop iterations, 16 updates each), and 512
    envs of those goals to evaluate it on."""
    args = tiny_args(tmp_path, cuda=True, require_cuda=True, num_envs=256, num_steps=32, num_minibatches=4,
                     update_epochs=4, learning_rate=3e-3, depth=3, hidden_dim=64, train_max_presses=1,
                     max_episode_steps=5, pretrain_timesteps=20 * 256 * 32, total_timesteps=4 * 256 * 32,
                     eval_every=1000, save_every=1000, log_every=1, **overrides)
    easy = {"train": envs.make_vec(args.env_id, 512, split="train", max_presses=1, max_steps=5, device="cuda",
                                   check_actions=False).unwrapped}
    return args, easy


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_captured_training_counts_every_env_step_resumes_and_learns(tmp_path):
    """A GPU run with the rollout, the targets and the update replayed from CUDA graphs: both phases (the targets
    graph with and without the teacher), hard resets, a resume from the phase switch. The episodes it logs fit in
    the env steps it counts (warm-up rollouts that went uncounted would overflow them), and it learns one-press
    goals as the CPU run does."""
    args, easy = one_press_gpu_run(tmp_path, compile=False)
    torch.manual_seed(args.seed)
    before = gcppo.evaluate(gcppo.build_network(args, "cuda"), easy, seed=123)["eval/train/success_depth_3"].item()
    run_dir = gcppo.train(args)
    records = [r for r in read_metrics(run_dir) if "losses/policy_loss" in r]
    batch = args.num_envs * args.num_steps
    assert [r["global_step"] for r in records] == [batch * (i + 1) for i in range(24)]
    assert [r["phase"] for r in records] == ["pretrain"] * 20 + ["flexloop"] * 4
    finished_steps = sum(r["charts/episodes"] * r["charts/episodic_length"] for r in records)
    hard_resets = 24 // args.hard_reset_every
    cut_short = args.num_envs * args.max_episode_steps * (hard_resets + 1)  # in flight at a reset or the end
    assert 24 * batch - cut_short <= finished_steps <= 24 * batch
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    # 16 updates per iteration, and the update capture's warm-up updates, which are counted
    assert final["global_step"] == 24 * batch and final["updates"] == 24 * 16 + flexloop_run.CUDA_GRAPH_WARMUP
    network, _ = gcppo.network_from_checkpoint(final, "cuda")
    after = gcppo.evaluate(network, easy, seed=123)["eval/train/success_depth_3"].item()
    assert after > before + 0.15, (before, after)

    gcppo.train(gcppo.Args(resume=str(run_dir / "pretrained.pt"), cuda=True))
    resumed = [r for r in read_metrics(run_dir) if "losses/policy_loss" in r]
    assert [r["global_step"] for r in resumed] == [batch * (i + 1) for i in range(24)]
    assert all(math.isfinite(r["losses/value_loss"]) for r in resumed)


# ---------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (dict(depth=1), "--depth must be at least 2"),
    (dict(lambda_depth=-0.1), "--lambda-depth must be >= 0"),
    (dict(num_minibatches=3), "does not divide"),
    (dict(num_minibatches=64), "too small to normalise"),
    (dict(total_timesteps=50), "at least one rollout"),
    (dict(pretrain_timesteps=0), "needs a pretrained IRU-K"),
    (dict(pretrain_timesteps=0, total_timesteps=0), "nothing to train"),
    (dict(train_max_presses=10), "--train-max-presses"),
    (dict(env_id="BoxPick-Exact-4-v0"), r"not an env of gcppo; choose one of \['LightsOut-4x5-v0'\]"),
    (dict(init_checkpoint="a.pt", resume="b.pt"), "not both"),
    (dict(minibatch_layout="time-rows", num_minibatches=16), "time-rows needs --num-minibatches 16 to divide"),
    (dict(hard_reset_every=-1), "--hard-reset-every must be 0"),
])
def test_bad_flags(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        gcppo.check_args(tiny_args(tmp_path, **overrides))


@pytest.mark.parametrize("overrides, device, capability, reason", [
    (dict(backbone="lstm"), "cuda", (9, 0), "residual IRU's steps only"),
    (dict(iru_variant="paper"), "cuda", (9, 0), "residual IRU's steps only"),
    (dict(hidden_dim=128), "cuda", (9, 0), "hidden width of 16, 32 or 64, not 128"),
    (dict(), "cpu", (9, 0), "they are GPU kernels"),
    (dict(), "cuda", (8, 0), r"Hopper GPU's shared memory \(H100, H200\); this GPU is NVIDIA A100-SXM4-80GB"),
    (dict(), "cuda", (9, 0), None),
])
def test_fused_iru_is_on_where_its_kernels_run_and_says_why_not_elsewhere(monkeypatch, tmp_path, overrides, device,
                                                                          capability, reason):
    """--fused-iru (on by default) runs on a Hopper GPU, the residual IRU at a width of 16-64; elsewhere the reason
    names what stops it, and the flags pass the check either way."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    args = tiny_args(tmp_path, **overrides)
    assert args.fused_iru and args.compile_env_step and args.combo_kernels  # the defaults
    gcppo.check_args(args)
    why = gcppo.fused_iru_off_because(args, device)
    if reason is None:
        assert why is None
    else:
        assert why is not None and re.search(reason, why), why


def test_speed_flags_on_by_default_leave_a_cpu_run_as_it_was(tmp_path):
    """On a CPU (no torch.compile, no kernels) the default flags change nothing: the run trains, its checkpoint
    records that the fused steps did not run, and a checkpoint trained with them rebuilds with the PyTorch steps.
    --no-compile with the compile flags on is no error: they act on what torch.compile compiles."""
    gcppo.check_args(tiny_args(tmp_path, compile=False))
    args = tiny_args(tmp_path, pretrain_timesteps=64, total_timesteps=64)
    run_dir = gcppo.train(args)
    checkpoint = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert flexloop_run.args_from_checkpoint(gcppo.Args, checkpoint).fused_iru is False
    checkpoint["args"]["fused_iru"] = True  # as a checkpoint trained on a Hopper GPU says
    network, rebuilt = gcppo.network_from_checkpoint(checkpoint, "cpu")
    assert network.fused_steps is None and rebuilt.fused_iru is False


FUSED_CHECK = """
import copy, sys, torch
import flexloop_gcppo as gcppo, flexloop_kernels
device = torch.device(sys.argv[1])
torch.manual_seed(0)
plain = gcppo.IRUNetwork(depth=4, hidden_dim=16).to(device)
with torch.no_grad():  # LayerNorm's affine away from 1 and 0, so a kernel that dropped it would show
    plain.gate_norm.weight.uniform_(0.5, 1.5)
    plain.gate_norm.bias.uniform_(-0.2, 0.2)
fused = gcppo.frozen_copy(plain).requires_grad_(True).train()
exact = copy.deepcopy(plain).double()  # the truth both float32 paths are measured against
calls = []
fused.fused_steps = lambda *args: calls.append(1) or flexloop_kernels.iru_steps(*args)
# On a GPU tl.dot multiplies in TF32, as the scripts' matmuls do with TF32 on, so there the kernels may be as far from
# the truth as PyTorch's TF32 path is (a few 1e-4 of the largest value per product, more through K steps); on a CPU
# everything is float32.
torch.backends.cuda.matmul.allow_tf32 = True
floor = 1e-5 if device.type == "cpu" else 2e-3
obs = torch.randint(0, 2, (40, 20), device=device).float()
goal = torch.randint(0, 2, (40, 20), device=device).float()


def error(value, truth):  # largest difference, relative to the truth's largest entry
    return ((value.double() - truth).abs().max() / truth.abs().max()).item()


for name, weight_grad in (("all_depths", "in kernel"), ("all_depths", "gemm"), ("full_depth", "in kernel")):
    flexloop_kernels.IRUSteps.BACKWARD = (*flexloop_kernels.IRUSteps.BACKWARD[:3], weight_grad)
    outputs = [getattr(network, name)(obs, goal) for network in (plain, fused, exact)]
    for network, (logits, values) in zip((plain, fused, exact), outputs):
        network.zero_grad()
        (logits.square().sum() + values.sum()).backward()
    compared = list(zip(("logits", "values"), *outputs))
    compared += [(key, p.grad, q.grad, r.grad) for (key, p), q, r in
                 zip(plain.named_parameters(), fused.parameters(), exact.parameters())]
    for key, by_pytorch, by_kernels, truth in compared:
        assert by_kernels.shape == truth.shape and truth.abs().max() > 0, (name, key)  # each on the inputs' path
        assert error(by_kernels, truth) <= max(4 * error(by_pytorch, truth), floor), \
            (name, weight_grad, key, error(by_kernels, truth), error(by_pytorch, truth))
assert len(calls) == 3, calls  # both methods took the kernels' path
print("ok")
"""


def test_a_fused_kernel_too_large_for_the_gpu_names_the_fix():
    """Forward or backward (which autograd runs later), a block over the GPU's shared memory says to drop the flag."""
    pytest.importorskip("triton")
    import flexloop_kernels
    from triton.runtime.errors import OutOfResources

    class TooLarge:
        def __getitem__(self, grid):
            def run(*args, **options):
                raise OutOfResources(237568, 232448, "shared memory")
            return run
    message = "do not fit this GPU's shared memory.*Drop --fused-iru"
    with pytest.raises(flexloop_kernels.SharedMemoryError, match=message):
        flexloop_kernels.launch(TooLarge(), (1,))


def test_fused_iru_steps_give_the_network_s_outputs_and_gradients():
    """--fused-iru's Triton kernels (flexloop_kernels.py) and the IRU's own steps, both against the steps in float64:
    the logits and values of every depth and of depth K alone, and every parameter's gradient, with the gate
    weights' gradient summed in the backward kernel and by a matmul after it. The kernels must be as close to the
    truth as PyTorch is (on a GPU both multiply in TF32). On a GPU when there is one, else on a CPU under Triton's
    interpreter."""
    pytest.importorskip("triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if device == "cpu":
        environment["TRITON_INTERPRET"] = "1"
    result = subprocess.run([sys.executable, "-c", FUSED_CHECK, device], cwd=ROOT, env=environment,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fused_iru_trains_compiled_and_captured_and_learns(tmp_path):
    """--fused-iru inside the compiled update and the rollout, both replayed from CUDA graphs, in both phases:
    finite losses, and one-press goals learnt as the run without it learns them."""
    pytest.importorskip("triton")
    args, easy = one_press_gpu_run(tmp_path, fused_iru=True)
    torch.manual_seed(args.seed)
    before = gcppo.evaluate(gcppo.build_network(args, "cuda"), easy, seed=123)["eval/train/success_depth_3"].item()
    run_dir = gcppo.train(args)
    records = [r for r in read_metrics(run_dir) if "losses/policy_loss" in r]
    assert [r["phase"] for r in records] == ["pretrain"] * 20 + ["flexloop"] * 4
    assert all(math.isfinite(r[name]) for r in records for name in gcppo.LOSS_NAMES)
    network, _ = gcppo.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"), "cuda")
    after = gcppo.evaluate(network, easy, seed=123)["eval/train/success_depth_3"].item()
    assert after > before + 0.15, (before, after)


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        flexloop_run.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "notes.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is a text file, not a FlexLoop checkpoint"):
        flexloop_run.load_checkpoint(tmp_path / "notes.pt")
    other = {"format": flexloop_run.CHECKPOINT_FORMAT, "algorithm": "gcdqn", "args": {}, "env_id": "BoxPick-Exact-4-v0",
             "depth": 5, "model": {}}
    torch.save(other, tmp_path / "gcdqn.pt")
    with pytest.raises(ValueError, match="use flexloop_gcdqn.py"):
        flexloop_run.load_checkpoint(tmp_path / "gcdqn.pt", gcppo.ALGORITHM)
    ours = {"args": dataclasses.asdict(tiny_args(tmp_path, depth=4)), "env_id": "LightsOut-4x5-v0"}
    with pytest.raises(ValueError, match="--depth 4"):
        flexloop_run.check_compatible(gcppo, ours, tiny_args(tmp_path))


# ---------------------------------------------------------------------------------------------------------
# Learning happens
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_training_solves_one_press_goals(tmp_path):
    """About 20 s of CPU PPO on one-press goals (5-step episodes) lifts deterministic success far above the
    untrained policy's (about 0.06)."""
    args = tiny_args(tmp_path, num_envs=64, num_steps=32, num_minibatches=4, update_epochs=4, learning_rate=3e-3,
                     depth=3, hidden_dim=64, train_max_presses=1, max_episode_steps=5, pretrain_timesteps=200_000,
                     total_timesteps=0, eval_every=1000, save_every=1000, log_every=20)
    easy = {"train": envs.make_vec(args.env_id, 512, split="train", max_presses=1, max_steps=5,
                                   check_actions=False).unwrapped}
    torch.manual_seed(args.seed)
    before = gcppo.evaluate(gcppo.build_network(args, "cpu"), easy, seed=123)["eval/train/success_depth_3"].item()
    run_dir = gcppo.train(args)
    network, _ = gcppo.network_from_checkpoint(flexloop_run.load_checkpoint(run_dir / "final.pt"))
    after = gcppo.evaluate(network, easy, seed=123)["eval/train/success_depth_3"].item()
    assert before < 0.12
    assert after > before + 0.15, (before, after)


# ---------------------------------------------------------------------------------------------------------
# The authors' initialisation and Adam epsilon (issue 16, item 3)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backbone", ["iru", "lstm"])
def test_flax_init_is_lecun_normal_kernels_zero_biases_and_forget_bias_one(backbone):
    torch.manual_seed(0)
    args = gcppo.Args(init="flax", backbone=backbone, hidden_dim=256)
    network = gcppo.build_network(args, "cpu")
    d = args.hidden_dim
    for name, layer in [("embed", network.embed), ("gates", network.gates), ("actor", network.actor),
                        ("critic", network.critic)]:
        std = (1 / layer.in_features) ** 0.5
        weight = layer.weight.detach()
        assert weight.abs().max() <= 2 * std / 0.87962566103423978 + 1e-6, name  # truncated at 2 sigma
        if weight.numel() > 1000:  # enough draws to check the variance: lecun's 1 / fan_in
            assert abs(weight.std().item() / std - 1) < 0.05, name
    forget = slice(d, 2 * d) if backbone == "lstm" else slice(0, d)
    bias = network.gates.bias.detach().clone()
    assert torch.equal(bias[forget], torch.ones(d))
    bias[forget] = 0
    assert not bias.any() and not network.embed.bias.any() and not network.actor.bias.any()
    # Ours: the actor's orthogonal init at gain 0.01 gives a nearly uniform first policy; flax's does not.
    ours = gcppo.build_network(gcppo.Args(backbone=backbone, hidden_dim=256), "cpu")
    assert ours.actor.weight.abs().max() < 0.02 < network.actor.weight.abs().max()


def test_init_and_adam_eps_reach_the_run_and_its_checkpoint(tmp_path):
    run_dir = gcppo.train(tiny_args(tmp_path, init="flax", adam_eps=1e-8))
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert final["args"]["init"] == "flax"
    assert all(group["eps"] == 1e-8 for group in final["optimizer"]["param_groups"])
    parsed = flexloop_run.parse_args(gcppo.Args, ["--init", "flax", "--adam-eps", "1e-8"])
    assert (parsed.init, parsed.adam_eps) == ("flax", 1e-8)
    assert (gcppo.Args().init, gcppo.Args().adam_eps) == ("cleanrl", 1e-5)  # defaults unchanged until screened
    with pytest.raises(ValueError, match="--adam-eps must be positive"):
        gcppo.check_args(gcppo.Args(adam_eps=0.0))


def test_every_lightsout_screen_variant_is_flags_the_script_accepts():
    """sweeps/lightsout_screen.sh starts 50M-step runs on a GPU; a misspelt flag there would only show on the
    device. Each variant's flags must parse and pass check_args, and change at least one default."""
    import re
    script = (Path(__file__).resolve().parent.parent / "sweeps" / "lightsout_screen.sh").read_text()
    variants = dict(re.findall(r'^\s+\[([\w-]+)\]="([^"]*)"', script, flags=re.M))
    assert {"defaults", "cleanrl", "candidate", "ref-loss", "flax-init", "authors-neutral"} <= set(variants)
    for name, flags in variants.items():
        args = flexloop_run.parse_args(gcppo.Args, flags.split(), prog=name)
        gcppo.check_args(args)
        # authors-neutral, screened against CleanRL's choices, is what became the defaults
        assert (args != gcppo.Args()) == (name not in ("defaults", "authors-neutral")), name


def test_throughput_bench_reports_each_phases_logged_rate(tmp_path):
    """bench/ppo_throughput.py reads a real run's charts/SPS per phase, leaving out each phase's first log (its
    compilation), and refuses a run too short to have a second log or an inductor option that does not exist."""
    bench = [sys.executable, str(ROOT / "bench" / "ppo_throughput.py"), "--cpu", "--num-envs", "16", "--num-steps",
             "8", "--num-minibatches", "2", "--update-epochs", "1"]
    done = subprocess.run(bench + ["--iterations", "3", "--inductor", "combo_kernels=True"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["inductor"] == {"combo_kernels": True}  # the JSON line says what it measured
    assert set(result["env_steps_per_second"]) == {"pretrain", "flexloop"}
    for phase, rate in result["env_steps_per_second"].items():
        assert rate > 0
        assert result["seconds_per_iteration"][phase] == pytest.approx(16 * 8 / rate, abs=1e-3)
    refused = subprocess.run(bench + ["--iterations", "1"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert refused.returncode != 0 and "--iterations must be at least 2" in refused.stderr
    for option, message in [("combo_kernel=True", "has no such option"), ("combo_kernels=1", "expected a bool")]:
        refused = subprocess.run(bench + ["--inductor", option], capture_output=True, text=True, cwd=tmp_path,
                                 timeout=60)
        assert refused.returncode != 0 and message in refused.stderr


def test_combo_kernels_flag_is_inductors_option_when_the_run_compiles(monkeypatch):
    """--combo-kernels (the default) turns on torch._inductor.config.combo_kernels as Run.compiled compiles (a GPU
    run); with --no-combo-kernels inductor's own setting stands (bench --inductor sets it)."""
    import torch._inductor.config as inductor_config
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn: seen.append(inductor_config.combo_kernels) or fn)
    off = gcppo.Args(combo_kernels=False)
    for args, before in ((gcppo.Args(), False), (off, False), (off, True),
                         (types.SimpleNamespace(), False)):
        monkeypatch.setattr(inductor_config, "combo_kernels", before)
        assert flexloop_run.Run.compiled(types.SimpleNamespace(compile=True, args=args), len) is len
    assert seen == [True, False, True, False]
    assert flexloop_run.Run.compiled(types.SimpleNamespace(compile=False, args=gcppo.Args()), len) is len
    assert len(seen) == 4  # a CPU run compiles nothing
