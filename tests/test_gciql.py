"""flexloop_gciql.py: GC-IQL losses, the normalised KL, IRU equations, the actor's depth protocol, OGBench
evaluation, smoke runs with checkpoints and resume, and iru_pretrain's gciql subcommand. CPU, no network."""

import copy
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
import time
import types
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("ogbench")
import flexloop_gciql as gciql  # noqa: E402
import flexloop_run  # noqa: E402
from envs import ogbench_data  # noqa: E402
from envs.eval_workers import EvalEnvs, EvalWorkers  # noqa: E402
from conftest import PYTHONPATH  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PM = "pointmaze-large-stitch-v0"
SUBPROCESS_ENV = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny networks: one thread is faster than two competing ones on a shared 2-core machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gciql_data")
    ogbench_data.generate_dataset(PM, str(out), episodes=8, episode_steps=60, seed=0, progress=False)
    return out


def tiny_args(data_dir, run_dir, **overrides):
    args = gciql.Args(env_name=PM, dataset_dir=str(data_dir), download=False, run_dir=str(run_dir), cuda=False,
                      depth=2, hidden_dim=16, batch_size=32, pretrain_steps=6, total_steps=6, eval_every=1000,
                      log_every=3, save_every=3, eval_episodes=1, eval_envs=10, eval_async=False)
    return replace(args, **overrides)


def read_metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------------------ losses


def test_expectile_loss_hand_values_and_asymmetry():
    diff = torch.tensor([2.0, -2.0, 0.0, 0.5])
    torch.testing.assert_close(gciql.expectile_loss(diff, 0.9), torch.tensor([3.6, 0.4, 0.0, 0.225]))
    # under-estimates of Q (diff > 0) cost 9x over-estimates, so the minimiser is an upper expectile:
    # for Q in {0, 1}, argmin_v 0.9 (1 - v)^2 + 0.1 v^2 = 0.9
    grid = torch.linspace(0, 1, 101)
    losses = torch.stack([gciql.expectile_loss(torch.tensor([0.0, 1.0]) - v, 0.9).sum() for v in grid])
    assert grid[losses.argmin()].item() == pytest.approx(0.9)
    assert torch.equal(gciql.expectile_loss(diff, 0.5) * 2, diff ** 2)  # expectile 0.5 is plain MSE


def test_critic_target_masks_stop_bootstrapping_at_the_goal():
    rewards, masks = torch.tensor([-1.0, 0.0, -1.0]), torch.tensor([1.0, 0.0, 1.0])
    next_value = torch.tensor([-5.0, -7.0, 0.0])
    torch.testing.assert_close(gciql.critic_target(rewards, masks, next_value, 0.99),
                               torch.tensor([-1.0 - 0.99 * 5.0, 0.0, -1.0]))


def test_gaussian_log_prob_matches_torch_normal():
    mean, std, actions = torch.randn(4, 3), torch.rand(4, 3) + 0.5, torch.randn(4, 3)
    expected = torch.distributions.Normal(mean, std).log_prob(actions).sum(-1)
    torch.testing.assert_close(gciql.gaussian_log_prob(actions, mean, std), expected)


def test_ddpg_bc_actor_loss_hand_case():
    q = torch.tensor([-2.0, -4.0], requires_grad=True)  # mean |Q| = 3
    log_prob = torch.tensor([-1.0, -3.0])
    loss, q_loss, bc_loss = gciql.ddpg_bc_actor_loss(q, log_prob, alpha=0.5)
    assert q_loss.item() == pytest.approx(1.0, abs=1e-5)  # -mean(Q) / mean|Q| = 3 / 3
    assert bc_loss.item() == pytest.approx(1.0)  # -0.5 * mean(-1, -3)
    assert loss.item() == pytest.approx(2.0, abs=1e-5)
    loss.backward()
    # the normaliser is detached: dL/dQ = -1 / (batch * mean|Q|) for every row
    torch.testing.assert_close(q.grad, torch.full((2,), -1 / 6), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------- normalised KL


def policy(mean, std):
    mean = torch.as_tensor(mean, dtype=torch.float32)
    return torch.stack([mean, torch.as_tensor(std, dtype=torch.float32).expand_as(mean)], -2)


def raw_gaussian_kl(p, q):
    mp, sp, mq, sq = p[..., 0, :], p[..., 1, :], q[..., 0, :], q[..., 1, :]
    return (torch.log(sq / sp) + (sp ** 2 + (mp - mq) ** 2) / (2 * sq ** 2) - 0.5).sum(-1)


def test_normalised_kl_values_and_direction():
    d = gciql.IRUActor.divergence
    p = policy(torch.randn(5, 3), torch.rand(5, 3) + 0.3)
    torch.testing.assert_close(d(p, p), torch.zeros(5))  # zero at equality
    # hand value: (1/|A|) sum_j (tanh mu_p - tanh mu_q)^2 / (2 sigma_p^2) = (1/2) (tanh(1)^2 / 8 + 0)
    teacher, student = policy([[1.0, 0.0]], [[2.0, 1.0]]), policy([[0.0, 0.0]], [[0.3, 5.0]])
    assert d(teacher, student).item() == pytest.approx(math.tanh(1) ** 2 / 16)
    # it is the KL between the squashed means' Gaussians with q's std replaced by p's, averaged over dimensions
    squashed = lambda x: policy(torch.tanh(x[:, 0]), x[:, 1])  # noqa: E731
    same_scale = policy(torch.tanh(student[:, 0]), teacher[:, 1])
    assert d(teacher, student).item() == pytest.approx(raw_gaussian_kl(squashed(teacher), same_scale).item() / 2)
    # direction: the first argument's (the teacher's) std sets the scale
    assert d(student, teacher).item() == pytest.approx(0.5 * (math.tanh(1) ** 2 / (2 * 0.3 ** 2)))


def test_normalised_kl_stays_bounded_for_runaway_means():
    """Squashed means bound the distance by 2 / sigma_p^2 however far the means run, and its gradient
    vanishes as the student's mean grows: no moving-target runaway through shared weights."""
    teacher = policy(torch.full((4, 2), 50.0), torch.ones(4, 2))
    student_mean = torch.tensor([[-500.0, 3.0]] * 4, requires_grad=True)
    value = gciql.IRUActor.divergence(teacher, policy(student_mean, torch.ones(4, 2)))
    assert (value <= 2.0).all()
    value.sum().backward()
    assert student_mean.grad[:, 0].abs().max() < 1e-6  # saturated: no push to grow further


def test_normalised_kl_cannot_be_cut_by_inflating_the_student_scale():
    teacher = policy(torch.randn(64, 4), torch.rand(64, 4) + 0.5)
    student_mean, student_std = torch.randn(64, 4), torch.rand(64, 4) + 0.5
    base = gciql.IRUActor.divergence(teacher, policy(student_mean, student_std))
    raw_base = raw_gaussian_kl(teacher, policy(student_mean, student_std))
    for factor in [1.5, 3.0, 10.0, 1e3]:
        inflated = policy(student_mean, student_std * factor)
        assert (gciql.IRUActor.divergence(teacher, inflated) >= base - 1e-6).all()
        # the raw KL, by contrast, can be lowered that way (the degeneracy the normalised KL avoids)
        if factor == 3.0:
            assert raw_gaussian_kl(teacher, inflated).mean() < raw_base.mean()


def test_depth_loss_gradient_reaches_only_the_shallower_depth():
    depth, batch, action_dim = 3, 4, 2
    means = [torch.randn(batch, action_dim, requires_grad=True) for _ in range(depth)]
    policies = torch.stack([policy(m, torch.ones(batch, action_dim)) for m in means])  # (K, B, 2, A)
    loss = gciql.flexloop_depth_loss(policies)
    loss.backward()
    assert means[-1].grad is None or torch.all(means[-1].grad == 0)  # the deepest depth is only a teacher
    # d/d mu_k of mean_{k, rows, j} (tanh mu_{k+1} - tanh mu_k)^2 / 2
    #   = -(tanh mu_{k+1} - tanh mu_k) (1 - tanh^2 mu_k) / ((K - 1) B A)
    for k in range(depth - 1):
        deeper, shallower = torch.tanh(means[k + 1]).detach(), torch.tanh(means[k]).detach()
        expected = -(deeper - shallower) * (1 - shallower ** 2) / ((depth - 1) * batch * action_dim)
        torch.testing.assert_close(means[k].grad, expected)


# ------------------------------------------------------------------------------------- IRU and the actor


def layer_norm(x, weight, bias):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + 1e-5) * weight + bias


@pytest.mark.parametrize("variant", ["residual", "paper"])
def test_iru_equations_against_hand_computation(variant):
    torch.manual_seed(0)
    net = gciql.IRU(in_dim=3, out_dim=2, depth=3, hidden_dim=2, variant=variant, members=2)
    assert torch.all(net.gates.bias[..., :2] == 1.0)  # forget-gate bias +1
    with torch.no_grad():
        for p in net.parameters():  # LayerNorm affine away from its 1/0 init, so it is exercised too
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(4, 3)
    state = net.start(x)
    for member in range(2):
        W = {name: p[member].detach() for name, p in net.named_parameters()}
        x_emb = layer_norm(x @ W["embed.weight"] + W["embed.bias"], W["embed_norm.weight"], W["embed_norm.bias"])
        c, h = torch.zeros(4, 2), torch.zeros(4, 2)
        s = state
        for _ in range(3):
            carried = h if variant == "residual" else torch.tanh(c)
            z = layer_norm(torch.cat([x_emb, carried], -1), W["gate_norm.weight"], W["gate_norm.bias"])
            gates = z @ W["gates.weight"] + W["gates.bias"]
            f, i = torch.sigmoid(gates[:, :2]), torch.tanh(gates[:, 2:])
            c = f * c + (1 - f) * i
            h = h + torch.tanh(c)
            out = (h if variant == "residual" else c) @ W["head.weight"] + W["head.bias"]
            s = net.advance(s)
            torch.testing.assert_close(net.output(s)[member], out)
    torch.testing.assert_close(net(x), net.output(s))


@pytest.mark.parametrize("backbone", ["iru", "lstm"])
def test_flax_init_is_the_authors_layer_by_layer(data_dir, backbone):
    """--init flax: lecun_normal kernels (std sqrt(1 / fan_in)) and zero biases, the forget-gate bias +1, V and Q
    heads orthogonal (a unit vector per member), the actor's mean head uniform within sqrt(3 * 0.01 / fan_avg)."""
    torch.manual_seed(0)
    args = tiny_args(data_dir, "unused", hidden_dim=64, backbone=backbone, init="flax")
    agent = gciql.build_network(args, "cpu")
    for net in (agent.value, agent.critic, agent.actor.iru):
        for layer in (net.embed, net.gates):
            expected_std = (1 / layer.in_features) ** 0.5
            assert layer.weight.std().item() == pytest.approx(expected_std, rel=0.1)
            assert layer.weight.abs().max() <= 2 * expected_std / 0.87962566103423978 + 1e-6  # truncated at 2 std
        forget = slice(64, 128) if backbone == "lstm" else slice(0, 64)
        assert torch.all(net.gates.bias[..., forget] == 1.0)
        assert net.gates.bias.sum().item() == 64 * net.members  # every other gate bias 0
        assert torch.all(net.embed.bias == 0) and torch.all(net.head.bias == 0)
    for head in (agent.value.head, agent.critic.head):
        torch.testing.assert_close(head.weight.norm(dim=1), torch.ones(head.weight.shape[0], 1))
    head = agent.actor.iru.head
    limit = (3 * 0.01 / ((64 + head.out_features) / 2)) ** 0.5
    assert 0.8 * limit < head.weight.abs().max() <= limit


def test_init_flag_default_keeps_pytorchs_init_and_a_checkpoint_keeps_its_weights(data_dir):
    torch.manual_seed(0)
    args = tiny_args(data_dir, "unused", hidden_dim=64)
    assert args.init == "pytorch"
    agent = gciql.build_network(args, "cpu")
    bound = 1 / 64 ** 0.5  # nn.Linear's uniform init, biases included
    assert agent.actor.iru.head.weight.abs().max() > 0.9 * bound and agent.actor.iru.head.bias.abs().max() > 0
    flax = gciql.build_network(replace(args, init="flax"), "cpu")
    checkpoint = {"args": vars(replace(args, init="flax")), "model": flax.state_dict()}
    actor, _ = gciql.network_from_checkpoint(checkpoint)  # rebuilt with the flax init, then its own weights
    for name, weight in actor.state_dict().items():
        torch.testing.assert_close(weight, flax.actor.state_dict()[name])


def test_target_critic_moves_towards_the_critic_before_adams_step(data_dir):
    """As OGBench's target_update (and the authors'), the Polyak step reads the critic as the losses saw it."""
    torch.manual_seed(0)
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", tau=0.5))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False)
    agent, target_critic = gciql.build_network(args, "cpu"), gciql.build_network(args, "cpu").critic
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-2)
    critic_before = copy.deepcopy(agent.critic.state_dict())
    target_before = copy.deepcopy(target_critic.state_dict())
    update = gciql.make_update(args, agent, target_critic, optimizer, dataset, torch.Generator().manual_seed(0),
                               torch.tensor(0.0), torch.zeros(len(gciql.LOSS_NAMES)))
    update()
    for name, target in target_critic.state_dict().items():
        torch.testing.assert_close(target, 0.5 * target_before[name] + 0.5 * critic_before[name])
    assert any(not torch.equal(agent.critic.state_dict()[n], critic_before[n]) for n in critic_before)  # Adam moved it


def test_actor_depth_protocol():
    torch.manual_seed(0)
    actor = gciql.IRUActor(obs_dim=3, action_dim=2, depth=4, hidden_dim=8)
    obs, goal = torch.randn(6, 3), torch.randn(6, 3)
    policies = actor.all_depths(obs, goal)
    assert policies.shape == (4, 6, 2, 2)
    assert torch.all(policies[:, :, 1] == gciql.ACTOR_STD)
    state = actor.start(obs, goal)
    rows = torch.tensor([4, 1])
    for k in range(4):
        state = actor.advance(state)
        torch.testing.assert_close(actor.decide(state), policies[k])
        # adaptive inference continues only some rows: gathering commutes with advancing
        gathered = actor.advance(actor.gather(state, rows))
        if k < 3:
            torch.testing.assert_close(actor.decide(gathered), policies[k + 1][rows])
    # acting: the mean clipped to the action box; sampling is seeded
    wide = policy([[3.0, -0.25], [-2.0, 0.5]], 1.0)
    torch.testing.assert_close(actor.act(wide), torch.tensor([[1.0, -0.25], [-1.0, 0.5]]))
    a = actor.act(wide, torch.Generator().manual_seed(1), deterministic=False)
    b = actor.act(wide, torch.Generator().manual_seed(1), deterministic=False)
    assert torch.equal(a, b) and not torch.equal(a, actor.act(wide)) and a.abs().max() <= 1
    # delta_k uses the same D as training
    delta = actor.divergence(policies[1], policies[0])
    assert delta.shape == (6,) and torch.all(delta >= 0)


def test_each_loss_trains_only_its_own_network(data_dir):
    """The actor's Q(s, g, mu) must not train the critic, and the value/critic targets must stay fixed."""
    torch.manual_seed(0)
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", depth=3))
    assert args.alpha == 0.003 and args.lambda_depth == 0.3  # pointmaze's values from docs/reference.md, OGBench
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False)
    agent, target_critic = gciql.build_network(args, "cpu"), gciql.build_network(args, "cpu").critic
    batch = dataset.sample(32, torch.Generator().manual_seed(0))
    loss, terms = gciql.flexloop_losses(agent, target_critic, batch, args, torch.tensor(0.3))
    grads = torch.autograd.grad(loss, list(agent.parameters()))
    grad = dict(zip([n for n, _ in agent.named_parameters()], grads))

    # the same losses, each computed on its own
    obs, actions, g = batch["observations"], batch["actions"], batch["value_goals"]
    target_q = gciql.critics_at(target_critic, obs, g, actions).min(0).values.detach()
    value_loss = gciql.expectile_loss(target_q - gciql.value_at(agent.value, obs, g), args.expectile).mean()
    next_v = gciql.value_at(agent.value, batch["next_observations"], g).detach()
    y = gciql.critic_target(batch["rewards"], batch["masks"], next_v, args.gamma)
    critic_loss = ((gciql.critics_at(agent.critic, obs, g, actions) - y) ** 2).mean(1).sum()
    for module, own_loss in [("value", value_loss), ("critic", critic_loss)]:
        names = [n for n, _ in agent.named_parameters() if n.startswith(module + ".")]
        own = torch.autograd.grad(own_loss, [dict(agent.named_parameters())[n] for n in names])
        for n, expected in zip(names, own):
            torch.testing.assert_close(grad[n], expected)
    assert all(grad[n].abs().sum() > 0 for n in grad if n.startswith("actor.iru.head"))
    torch.testing.assert_close(torch.stack([terms["losses/value_loss"], terms["losses/critic_loss"]]).detach(),
                               torch.stack([value_loss, critic_loss]).detach())


def test_iql_learns_goal_values(data_dir):
    """A few hundred updates on pointmaze data: V(s, s) (already at the goal, reward 0, no bootstrap) ends up
    well above V(s, far goal), whose targets accumulate -1 per step."""
    torch.manual_seed(0)
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", hidden_dim=32, batch_size=128))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False)
    agent, target_critic = gciql.build_network(args, "cpu"), gciql.build_network(args, "cpu").critic
    target_critic.load_state_dict(agent.critic.state_dict())
    optimizer = torch.optim.Adam(agent.parameters(), lr=1e-3)
    update = gciql.make_update(replace(args, tau=0.05), agent, target_critic, optimizer, dataset,
                               torch.Generator().manual_seed(0), torch.tensor(0.0),
                               torch.zeros(len(gciql.LOSS_NAMES)))
    for _ in range(300):
        update()

    obs = dataset.observations[dataset.valid_idxs]
    far = obs.flip(0)  # states from other trajectories, mostly far away in the maze
    with torch.no_grad():
        v_at_goal = gciql.value_at(agent.value, obs, obs).mean()
        v_far = gciql.value_at(agent.value, obs, far).mean()
    assert v_at_goal > v_far + 1.0, (v_at_goal, v_far)


# ---------------------------------------------------------------------------------------------- evaluation


def pointmaze_oracle():
    """A policy_fn that walks the maze's BFS path to the goal (from the env's own oracle)."""
    maze = ogbench_data.make_eval_env(PM).unwrapped
    batch_sizes = []

    def policy_fn(obs, goal, policy_index):
        batch_sizes.append(len(obs))
        actions = []
        for xy, goal_xy in zip(obs, goal):
            subgoal, _ = maze.get_oracle_subgoal(xy, goal_xy)
            if maze.xy_to_ij(subgoal) == maze.xy_to_ij(xy):  # in the goal's cell: head for the goal itself
                subgoal = goal_xy
            direction = subgoal - xy
            actions.append(direction / (np.linalg.norm(direction) + 1e-6))
        return np.array(actions) * np.where(policy_index[:, None] == 0, 1.0, 0.0)  # policy 1 stands still

    return policy_fn, batch_sizes


def test_rollout_runs_tasks_side_by_side_and_scores_final_success():
    policy_fn, batch_sizes = pointmaze_oracle()
    vector_env = gciql.make_eval_vector_env(PM, 10, async_envs=False)
    success = gciql.rollout(policy_fn, vector_env, episodes=1, num_policies=2, seed=0)
    vector_env.close()
    assert success.shape == (2, 5, 1)
    assert np.all(success[0] == 1.0)  # the oracle reaches every task's goal
    assert np.all(success[1] == 0.0)  # standing still reaches none
    assert max(batch_sizes) == 10  # all ten episodes (2 policies x 5 tasks) advance in one batch


def test_worker_processes_run_the_same_episodes_as_this_process():
    """EvalWorkers (3 envs over 2 processes) against EvalEnvs in this process: the same observations at every step
    and the same success, with episodes of different lengths reusing the envs."""
    def recording(policy_fn, seen):
        def record(obs, goal, policy_index):
            seen.append((obs.copy(), goal.copy(), policy_index.copy()))
            return policy_fn(obs, goal, policy_index)
        return record

    results = []
    for vector_env in (EvalEnvs(PM, 3), EvalWorkers(PM, 3, workers=2)):
        seen = []
        success = gciql.rollout(recording(pointmaze_oracle()[0], seen), vector_env, task_ids=(1, 2), episodes=2,
                                num_policies=2, seed=5)
        vector_env.close()
        results.append((success, seen))
    (local_success, local_seen), (worker_success, worker_seen) = results
    np.testing.assert_array_equal(worker_success, local_success)
    assert local_success[0].all() and not local_success[1].any()  # the oracle reaches its goals; standing still not
    assert len(worker_seen) == len(local_seen)
    for (obs, goal, index), (local_obs, local_goal, local_index) in zip(worker_seen, local_seen):
        np.testing.assert_array_equal(obs, local_obs)
        np.testing.assert_array_equal(goal, local_goal)
        np.testing.assert_array_equal(index, local_index)


def test_rollout_steps_only_the_envs_running_an_episode():
    """An env with no episode left to run is neither reset nor stepped: the physics steps add up to the episodes'
    own lengths, and an episode's observations are those of the same episode run alone in a fresh env."""
    policy_fn, _ = pointmaze_oracle()
    vector_env = EvalEnvs(PM, 4)  # more envs than the 3 episodes
    steps, first_rows = [0] * 4, []
    for i, env in enumerate(vector_env.envs):
        def counted(action, step=env.step, i=i):
            steps[i] += 1
            return step(action)
        env.step = counted

    def record_first_episode(obs, goal, policy_index):
        first_rows.append(obs[0].copy())  # row 0 is episode 0 (task 1) for its first steps
        return policy_fn(obs, goal, policy_index)

    success = gciql.rollout(record_first_episode, vector_env, task_ids=(1, 3, 4), episodes=1, num_policies=1,
                            seed=7)
    vector_env.close()
    assert success.shape == (1, 3, 1) and success.all()
    assert steps[3] == 0  # the fourth env never had an episode

    alone, lengths = ogbench_data.make_eval_env(PM), []  # the three episodes (task, seed) run by hand
    for task_id, episode_seed in ((1, 7), (3, 8), (4, 9)):
        obs, info = ogbench_data.reset_episode(alone, episode_seed, task_id)
        goal = info["goal"].astype(np.float32)[None]
        for t in range(alone.spec.max_episode_steps):
            obs = obs.astype(np.float32)  # as rollout passes it
            if task_id == 1 and t < 5:
                np.testing.assert_array_equal(obs, first_rows[t])
            obs, _, terminated, truncated, _ = alone.step(policy_fn(obs[None], goal, np.zeros(1))[0])
            if terminated or truncated:
                break
        lengths.append(t + 1)
    alone.close()
    assert sorted(steps[:3]) == sorted(lengths)  # each env stepped its own episode to its end, and no further


def test_an_episode_seed_gives_the_same_start_and_goal_whatever_numpys_global_state():
    """OGBench's mazes add their start and goal noise from numpy's global generator: reset_episode seeds it from
    the episode's seed and then puts the caller's state back."""
    starts = []
    for global_seed in (0, 1):
        np.random.seed(global_seed)
        env = ogbench_data.make_eval_env(PM)
        before = np.random.get_state()[1].copy()
        obs, info = ogbench_data.reset_episode(env, 3, 2)
        starts.append((obs, info["goal"]))
        np.testing.assert_array_equal(np.random.get_state()[1], before)  # the caller's stream goes on untouched
        env.close()
    np.testing.assert_array_equal(starts[0][0], starts[1][0])
    np.testing.assert_array_equal(starts[0][1], starts[1][1])
    env = ogbench_data.make_eval_env(PM)
    other, _ = ogbench_data.reset_episode(env, 4, 2)
    env.close()
    assert not np.array_equal(other, starts[0][0])  # another seed, another start


def test_eval_workers_refuse_empty_sizes_close_twice_and_raise_a_workers_error():
    with pytest.raises(ValueError, match="num_envs >= 1 and workers >= 1"):
        EvalWorkers(PM, 0, workers=2)
    with pytest.raises(ValueError, match="num_envs >= 1"):
        EvalEnvs(PM, 0)
    envs = EvalWorkers(PM, 2, workers=4)  # more workers than envs: one env each
    assert len(envs.processes) == 2 and envs.num_envs == 2
    envs.close()
    envs.close()
    with pytest.raises(RuntimeError, match="evaluation worker failed(.|\n)*no-such-env-v0"):
        EvalWorkers("no-such-env-v0", 2, workers=2)  # a worker's error comes back with its traceback


def test_policy_acts_on_one_torch_thread_while_workers_step_the_envs():
    """With the envs in worker processes, the policy's torch threads would compete with the workers for the cores:
    rollout calls the policy on one thread and gives the caller's count back; in this process it leaves it alone."""
    oracle, _ = pointmaze_oracle()
    threads_seen = []

    def counting_policy(obs, goal, policy_index):
        threads_seen.append(torch.get_num_threads())
        return oracle(obs, goal, policy_index)

    torch.set_num_threads(2)  # the module's fixture restores the count it found
    for vector_env, expected in ((EvalWorkers(PM, 2, workers=2), 1), (EvalEnvs(PM, 2), 2)):
        gciql.rollout(counting_policy, vector_env, task_ids=(1,), episodes=1, num_policies=1, seed=0)
        vector_env.close()
        assert set(threads_seen) == {expected}, type(vector_env).__name__
        assert torch.get_num_threads() == 2
        threads_seen.clear()


def test_evaluation_env_count_is_every_episode_on_a_gpu_where_envs_are_small_and_50_otherwise():
    """A GPU call costs about the same from 50 to 800 rows, a CPU call by the row, and a manipulation env takes
    about 160 MB: by default an actor on a GPU steps every episode of a maze evaluation at once (episodes x 5 tasks x
    depths); one on a CPU (a background evaluation's copy included), or manipulation envs, 50; --eval-envs sets the
    count anywhere."""
    args = gciql.Args(env_name=PM, depth=5, eval_episodes=50)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert args.eval_envs is None
    assert gciql.eval_env_count(args, cuda) == 50 * 5 * 5
    assert gciql.eval_env_count(replace(args, env_name="antmaze-medium-stitch-v0"), cuda) == 50 * 5 * 5
    assert gciql.eval_env_count(replace(args, eval_episodes=2, depth=3), cuda) == 2 * 5 * 3
    assert gciql.eval_env_count(args, cpu) == 50
    assert gciql.eval_env_count(replace(args, eval_in_background=True), cuda) == 50
    for manipulation in ("cube-double-play-v0", "scene-play-v0", "puzzle-4x4-play-v0"):
        assert gciql.eval_env_count(replace(args, env_name=manipulation), cuda) == 50
    for device in (cpu, cuda):
        assert gciql.eval_env_count(replace(args, eval_envs=7), device) == 7
    gciql.check_args(args)  # the default passes the positive-flags check
    with pytest.raises(ValueError, match="--eval-envs must be positive"):
        gciql.check_args(replace(args, eval_envs=0))


def test_rollout_reuses_envs_for_waiting_episodes_in_subprocesses():
    policy_fn, _ = pointmaze_oracle()
    vector_env = gciql.make_eval_vector_env(PM, 3, async_envs=True)  # fewer envs than episodes
    success = gciql.rollout(policy_fn, vector_env, task_ids=(1, 3), episodes=2, num_policies=1, seed=0)
    vector_env.close()
    assert success.shape == (1, 2, 2) and np.all(success == 1.0)


# ------------------------------------------------------------------------------- smoke runs and checkpoints


@pytest.fixture(scope="module")
def smoke_run(data_dir, tmp_path_factory):
    """Both phases with tiny flags: 6 pretraining updates, then 6 FlexLoop updates."""
    run_dir = gciql.train(tiny_args(data_dir, tmp_path_factory.mktemp("runs")))
    return run_dir


def test_gpu_speedups_are_on_by_default_and_ignored_on_cpu(data_dir, tmp_path, no_torch_compile):
    # On a GPU the losses are compiled and the update graphed; a CPU run with the same defaults must neither
    # compile nor fail on the GPU-only flags.
    args = tiny_args(data_dir, tmp_path)
    assert args.compile and args.cuda_graph
    assert (Path(gciql.train(args)) / "final.pt").exists()


def test_cuda_streams_flag_is_ignored_on_cpu(data_dir, tmp_path):
    args = tiny_args(data_dir, tmp_path, cuda_streams=True, pretrain_steps=2, total_steps=2)
    assert (Path(gciql.train(args)) / "final.pt").exists()


def test_evaluating_more_often_leaves_the_training_unchanged(data_dir, tmp_path):
    """Evaluation draws from no training generator, so --eval-every and --eval-episodes may change when a run
    resumes (RESUME_FLAGS): runs that evaluate every 4 updates or never end with equal weights."""
    finals, evaluations = [], []
    for name, evaluation in (("often", dict(eval_every=4)), ("never", dict(eval_episodes=0))):
        run_dir = gciql.train(tiny_args(data_dir, tmp_path / name, **evaluation))
        finals.append(torch.load(Path(run_dir) / "final.pt", weights_only=False)["model"])
        evaluations.append(sum("eval/success_depth_1" in record for record in read_metrics(run_dir)))
    assert evaluations[0] >= 3 and evaluations[1] == 0  # 12 updates, every 4th one evaluated
    often, never = finals
    assert often.keys() == never.keys()
    for key in often:
        torch.testing.assert_close(often[key], never[key], rtol=0, atol=0, msg=key)


def test_evaluating_in_background_gives_the_weights_and_numbers_of_blocking_evaluations(data_dir, tmp_path,
                                                                                        monkeypatch):
    """--eval-in-background evaluates a copy of the actor in a thread while training goes on: the final weights are
    those of blocking evaluations, and each evaluation, logged later with the step it evaluated
    (charts/evaluated_step), has the numbers a blocking evaluation logged at that step. The evaluation here
    reads the actor's weights slowly, so training moves on while it runs."""
    def weights_read_slowly(actor, vector_env, episodes, device, seed=0):
        first = sum(p.sum().item() for p in actor.parameters())
        time.sleep(0.3)
        return {f"eval/success_depth_{k}": first + sum(p.sum().item() for p in actor.parameters()) * k
                for k in range(1, actor.depth + 1)}
    monkeypatch.setattr(gciql, "evaluate", weights_read_slowly)
    finals, evaluations = [], []
    for name, background in (("blocking", False), ("background", True)):
        run_dir = gciql.train(tiny_args(data_dir, tmp_path / name, eval_every=4, eval_in_background=background))
        finals.append(torch.load(Path(run_dir) / "final.pt", weights_only=False)["model"])
        rows = [r for r in read_metrics(run_dir) if "eval/success_depth_1" in r]
        evaluations.append({r.get("charts/evaluated_step", r["global_step"]):
                            {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows})
    blocking, background = evaluations
    assert len(blocking) >= 3 and len(set(map(str, blocking.values()))) == len(blocking)  # the weights moved
    assert background == blocking  # 12 updates: every 4th one and each phase's end
    for key in finals[0]:
        torch.testing.assert_close(finals[0][key], finals[1][key], rtol=0, atol=0, msg=key)


def test_a_background_evaluation_runs_the_real_episodes(data_dir, tmp_path):
    run_dir = gciql.train(tiny_args(data_dir, tmp_path, eval_in_background=True))  # each phase's end: 6, 12
    rows = [r for r in read_metrics(run_dir) if "eval/success_depth_1" in r]
    assert [(r["phase"], r["charts/evaluated_step"]) for r in rows] == [("pretrain", 6), ("flexloop", 12)]
    assert all(0 <= r[f"eval/task_{t}/success_depth_{k}"] <= 1 for r in rows for t in gciql.TASK_IDS for k in (1, 2))


def test_wandb_draws_background_evaluations_at_the_update_they_evaluated(data_dir, tmp_path, monkeypatch):
    """With a stand-in wandb module: eval/* is plotted against charts/evaluated_step, which each evaluation's
    record carries."""
    logged, defined = [], {}

    class Run:
        id = "stand-in"
        settings = types.SimpleNamespace(mode="online")

        def define_metric(self, name, step_metric):
            defined[name] = step_metric

        def log(self, record, step):
            logged.append(dict(record))  # as W&B, which sends it at once

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    gciql.train(tiny_args(data_dir, tmp_path, eval_in_background=True, track=True))
    assert defined == {"eval/*": "charts/evaluated_step"}
    assert [r["charts/evaluated_step"] for r in logged if "eval/success_depth_1" in r] == [6, 12]


@pytest.mark.parametrize("cuda", [False, pytest.param(True, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="on a GPU the resumed run compiles and captures its update first"))])
def test_a_stop_during_a_background_evaluation_saves_latest_at_once_and_the_resumed_run_evaluates_it(
        data_dir, tmp_path, monkeypatch, cuda):
    """SIGTERM while an evaluation runs in the background: the run writes latest.pt at once, the evaluation
    unlogged. Seen on a GPU: scene-play's evaluations, minutes long, were lost at every stop. latest.pt holds the
    weights being evaluated, and the resumed run evaluates them first, logged at the update they were taken."""
    real_evaluate, evaluated_weights = gciql.evaluate, []

    def stopped_while_evaluating(actor, vector_env, episodes, device, seed=0):
        evaluated_weights.append(copy.deepcopy(actor.state_dict()))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    monkeypatch.setattr(gciql, "evaluate", stopped_while_evaluating)
    start = time.perf_counter()
    run_dir = Path(gciql.train(tiny_args(data_dir, tmp_path, eval_every=4, eval_in_background=True, cuda=cuda)))
    assert time.perf_counter() - start < (60 if cuda else 20)  # a GPU run compiles first
    assert (run_dir / "latest.pt").exists() and not (run_dir / "final.pt").exists()
    assert not any("eval/success_depth_1" in r for r in read_metrics(run_dir))
    checkpoint = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    assert checkpoint["unfinished_evaluation"]["taken"]["charts/evaluated_step"] == 4

    def recording(actor, *args, **kwargs):
        evaluated_weights.append(copy.deepcopy(actor.state_dict()))
        return real_evaluate(actor, *args, **kwargs)
    monkeypatch.setattr(gciql, "evaluate", recording)
    gciql.train(gciql.Args(resume=str(run_dir / "latest.pt")))
    rows = [r for r in read_metrics(run_dir) if "eval/success_depth_1" in r]
    assert [r["charts/evaluated_step"] for r in rows] == [4, 6, 8, 12]  # the unfinished one first, then as due
    for name, value in evaluated_weights[0].items():  # the weights the stop cut off, not the resumed run's
        assert torch.equal(evaluated_weights[1][name], value), name
    assert not torch.equal(evaluated_weights[2]["iru.gates.weight"], evaluated_weights[0]["iru.gates.weight"])
    slim = tmp_path / "slim.pt"
    flexloop_run.slim_checkpoint(run_dir / "latest.pt", slim)
    assert "unfinished_evaluation" not in flexloop_run.load_checkpoint(slim)


def test_the_resumed_run_starts_the_unfinished_evaluation_after_its_first_update(data_dir, tmp_path, monkeypatch):
    """Seen on an H100: the resumed run's first update compiled while the unfinished evaluation ran in its thread,
    and the compiler's tracing, which patches every module call, broke the evaluation ("module is not installed
    as a submodule"). The evaluation waits for the first update. Here the first update is slow, so an evaluation
    started before it would see no update done."""
    real_make_update, real_evaluate, updates_done, updates_seen = gciql.make_update, gciql.evaluate, [], []

    def stopped_while_evaluating(actor, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    monkeypatch.setattr(gciql, "evaluate", stopped_while_evaluating)
    run_dir = Path(gciql.train(tiny_args(data_dir, tmp_path, eval_every=4, eval_in_background=True)))
    assert flexloop_run.load_checkpoint(run_dir / "latest.pt")["unfinished_evaluation"] is not None

    def slow_first_update(*args, **kwargs):
        update = real_make_update(*args, **kwargs)

        def counted():
            if not updates_done:
                time.sleep(1.0)
            losses = update()
            updates_done.append(1)
            return losses
        return counted

    def recording(actor, *args, **kwargs):
        updates_seen.append(len(updates_done))
        return real_evaluate(actor, *args, **kwargs)
    monkeypatch.setattr(gciql, "make_update", slow_first_update)
    monkeypatch.setattr(gciql, "evaluate", recording)
    gciql.train(gciql.Args(resume=str(run_dir / "latest.pt")))
    assert updates_seen and updates_seen[0] >= 1
    first = next(r for r in read_metrics(run_dir) if "eval/success_depth_1" in r)
    assert first["charts/evaluated_step"] == 4  # still logged with the step it was taken at


def test_a_run_stopped_in_its_final_background_evaluation_evaluates_it_once_when_resumed(data_dir, tmp_path,
                                                                                          monkeypatch):
    """The final evaluation cut off in the background: latest.pt is at the last update and holds the weights. The
    resumed run evaluates them once (not again as a final evaluation owed), then writes final.pt."""
    run_dir = Path(gciql.train(tiny_args(data_dir, tmp_path, eval_in_background=True)))
    finished = flexloop_run.load_checkpoint(run_dir / "final.pt")
    actor = {name[len("actor."):]: value for name, value in finished["model"].items() if name.startswith("actor.")}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    (run_dir / "metrics.jsonl").write_text("".join(line + "\n" for line in lines if "eval/success_depth_1" not in
                                                   json.loads(line) or json.loads(line)["charts/evaluated_step"] < 12))
    stopped = {**finished, "unfinished_evaluation": {"taken": {"phase": "flexloop", "charts/evaluated_step": 12},
                                                     "iteration": 12, "weights": actor}}
    flexloop_run.save_checkpoint(run_dir / "latest.pt", stopped)
    (run_dir / "final.pt").unlink()

    real_evaluate, calls = gciql.evaluate, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real_evaluate(*args, **kwargs)
    monkeypatch.setattr(gciql, "evaluate", counted)
    gciql.train(gciql.Args(resume=str(run_dir / "latest.pt")))
    assert calls == [1]
    rows = [r for r in read_metrics(run_dir) if "eval/success_depth_1" in r]
    assert [r["charts/evaluated_step"] for r in rows] == [6, 12]
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["unfinished_evaluation"] is None


def test_a_stop_during_an_evaluation_saves_latest_and_closes_the_eval_envs(data_dir, tmp_path, monkeypatch):
    """SIGTERM in the middle of a (blocking) evaluation drops it, writes latest.pt and still closes the eval envs:
    worker processes left open would keep the process from exiting."""
    closed = []

    class RecordingEnvs:
        def close(self):
            closed.append(True)

    def stopped_while_evaluating(actor, vector_env, episodes, device, seed=0):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    monkeypatch.setattr(gciql, "make_eval_vector_env", lambda *args: RecordingEnvs())
    monkeypatch.setattr(gciql, "evaluate", stopped_while_evaluating)
    start = time.perf_counter()
    run_dir = Path(gciql.train(tiny_args(data_dir, tmp_path, eval_every=4)))
    assert time.perf_counter() - start < 20
    assert (run_dir / "latest.pt").exists() and not (run_dir / "final.pt").exists()
    assert closed == [True]


def test_a_run_stopped_in_its_final_evaluation_evaluates_again_when_resumed(data_dir, tmp_path, monkeypatch):
    """Seen on a GPU: a stop in the final evaluation saved latest.pt after the last update, and --resume then wrote
    final.pt at once, with no final evaluation in metrics.jsonl. Resumed, the run evaluates its last weights, once."""
    real_evaluate, calls = gciql.evaluate, []

    def stopped_in_the_final_evaluation(actor, vector_env, episodes, device, seed=0):
        calls.append(seed)
        if len(calls) == 2:  # the phase change's evaluation runs; the final one is stopped
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        return real_evaluate(actor, vector_env, episodes, device, seed=seed)
    monkeypatch.setattr(gciql, "evaluate", stopped_in_the_final_evaluation)
    run_dir = Path(gciql.train(tiny_args(data_dir, tmp_path)))
    assert not (run_dir / "final.pt").exists()
    assert flexloop_run.load_checkpoint(run_dir / "latest.pt")["iteration"] == 12  # after the last update

    monkeypatch.setattr(gciql, "evaluate", real_evaluate)
    gciql.train(gciql.Args(resume=str(run_dir / "latest.pt")))
    evaluated = [r["global_step"] for r in read_metrics(run_dir) if "eval/success_depth_1" in r]
    assert evaluated == [6, 12]  # the phase change's, then the final one
    assert "eval/success_depth_2" in flexloop_run.load_checkpoint(run_dir / "final.pt")["metrics"]

    def never(*args, **kwargs):
        raise AssertionError("a finished run's folder holds final.pt: resuming its latest.pt evaluates nothing")
    monkeypatch.setattr(gciql, "evaluate", never)
    gciql.train(gciql.Args(resume=str(run_dir / "latest.pt")))


def test_eval_workers_die_on_sigterm_and_leave_ctrl_c_to_the_parent():
    """A forked worker does not keep a training run's signal handlers: SIGTERM ends it (the parent's exit waits
    for its workers), and Ctrl-C, which a terminal sends to every process of the group, is the parent's to act on."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as a training run's StopSignals does
    envs = EvalWorkers(PM, 2, workers=2)
    try:
        first, second = envs.processes
        os.kill(second.pid, signal.SIGINT)
        os.kill(first.pid, signal.SIGTERM)
        first.join(timeout=10)
        assert not first.is_alive() and first.exitcode == -signal.SIGTERM
        time.sleep(0.5)
        assert second.is_alive()  # and still answers
        envs.connections[1].send(("reset", (np.array([0]), np.array([True]), np.array([1]))))
        error, (obs, goal) = envs.connections[1].recv()
        assert error is None and obs.shape == (1, envs.single_observation_space.shape[0])
    finally:
        envs.close()
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA run's background evaluation")
def test_a_cuda_runs_background_evaluation_acts_on_a_cpu_copy(data_dir, tmp_path, monkeypatch):
    """On a GPU the copy acts on the CPU: the thread never waits for the updates queued on the GPU."""
    seen = []

    def where(actor, vector_env, episodes, device, seed=0):
        seen.append((device.type, {p.device.type for p in actor.parameters()}))
        return {f"eval/success_depth_{k}": 0.0 for k in range(1, actor.depth + 1)}
    monkeypatch.setattr(gciql, "evaluate", where)
    gciql.train(tiny_args(data_dir, tmp_path, cuda=True, eval_in_background=True))
    assert seen == [("cpu", {"cpu"})] * 2


def test_an_error_in_a_background_evaluation_stops_the_run_with_it(data_dir, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("the eval env died")
    monkeypatch.setattr(gciql, "evaluate", broken)
    with pytest.raises(RuntimeError, match="the eval env died"):
        gciql.train(tiny_args(data_dir, tmp_path, eval_every=4, eval_in_background=True))


def train_updates(args, dataset, device, updates=3, captured=False, **update_kwargs):
    """The weights and loss sums after `updates` calls of make_update's update from seed 0 (captured: `updates`
    replays of its CUDA graph, after the capture's warm-up updates)."""
    torch.manual_seed(0)
    agent = gciql.build_network(args, device)
    target_critic = copy.deepcopy(agent.critic).requires_grad_(False)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, capturable=on_cuda, fused=on_cuda)
    generator = torch.Generator(device).manual_seed(0)
    loss_sums = torch.zeros(len(gciql.LOSS_NAMES), device=device)
    update = gciql.make_update(args, agent, target_critic, optimizer, dataset, generator,
                               torch.tensor(0.3, device=device), loss_sums, **update_kwargs)
    if captured:
        update = flexloop_run.capture_cuda_graph(update, [generator])
    for _ in range(updates):
        update()
    return [p.detach().clone() for p in agent.parameters()], loss_sums.clone()


def test_prefetched_batches_train_as_batches_sampled_in_place(data_dir):
    """prefetch: each update trains on the batch drawn during the one before. The draws come in the same order
    from the same generator, so the weights and loss sums are those of sampling in place."""
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", depth=3, hidden_dim=16))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False)
    (weights, sums), (prefetched_weights, prefetched_sums) = [
        train_updates(args, dataset, torch.device("cpu"), prefetch=prefetch) for prefetch in (False, True)]
    assert torch.equal(prefetched_sums, sums) and (sums != 0).all()
    for got, expected in zip(prefetched_weights, weights):
        assert torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
@pytest.mark.parametrize("bf16", [False, True])
def test_prefetch_on_its_cuda_stream_trains_as_sampling_in_place(data_dir, bf16):
    """On a GPU the next batch is sampled on a stream of its own inside the captured update (what train() runs
    with --cuda-streams): the same weights and loss sums as sampling in place, one stream, captured."""
    device = torch.device("cuda")
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", depth=3, hidden_dim=32, cuda=True, bf16=bf16))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False, device=device)
    in_place = train_updates(args, dataset, device, captured=True)
    streams = train_updates(args, dataset, device, captured=True, prefetch=True,
                            losses=gciql.on_cuda_streams(gciql.LOSS_BRANCHES, device))
    torch.testing.assert_close(streams[1], in_place[1])
    for got, expected in zip(streams[0], in_place[0]):
        torch.testing.assert_close(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA streams need a GPU")
@pytest.mark.parametrize("bf16", [False, True])
def test_loss_branches_on_cuda_streams_train_as_on_one_stream(data_dir, bf16):
    """--cuda-streams: the value, critic and actor branches on three streams, the update captured in a CUDA
    graph, give the weights and loss sums of the same update on one stream, in TF32 and under bf16 autocast."""
    device = torch.device("cuda")
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, "unused", depth=3, hidden_dim=32, cuda=True, bf16=bf16))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False, device=device)
    weights, sums = train_updates(args, dataset, device, captured=True)
    stream_weights, stream_sums = train_updates(args, dataset, device, captured=True,
                                                losses=gciql.on_cuda_streams(gciql.LOSS_BRANCHES, device))
    torch.testing.assert_close(stream_sums, sums)
    for got, expected in zip(stream_weights, weights):
        torch.testing.assert_close(got, expected)
    assert (sums != 0).all()


def assert_evaluated_at_each_phase_end(records, pretrain_end, end):
    """One evaluation as each phase ends, with every task's success at each of the 2 depths, and finite losses."""
    evals = [r for r in records if "eval/success_depth_1" in r]
    assert [(r["global_step"], r["phase"]) for r in evals] == [(pretrain_end, "pretrain"), (end, "flexloop")]
    for k in (1, 2):
        for t in gciql.TASK_IDS:
            assert evals[-1][f"eval/task_{t}/success_depth_{k}"] in (0.0, 1.0)
    assert all(math.isfinite(v) for r in records for k, v in r.items() if k.startswith("losses/"))


def test_smoke_run_two_phases(smoke_run):
    assert {"pretrained.pt", "latest.pt", "final.pt", "metrics.jsonl"} <= {p.name for p in smoke_run.iterdir()}
    records = read_metrics(smoke_run)
    train_records = [r for r in records if "losses/critic_loss" in r]
    assert [(r["global_step"], r["phase"], r["charts/lambda_depth"]) for r in train_records] == \
        [(3, "pretrain", 0.0), (6, "pretrain", 0.0), (9, "flexloop", 0.3), (12, "flexloop", 0.3)]
    assert_evaluated_at_each_phase_end(records, pretrain_end=6, end=12)

    checkpoint = flexloop_run.load_checkpoint(smoke_run / "final.pt")
    assert checkpoint["global_step"] == 12 and checkpoint["phase"] == "flexloop"
    assert checkpoint["env_id"] == PM and checkpoint["depth"] == 2 and checkpoint["algorithm"] == "gciql"
    assert checkpoint["args"]["lambda_depth"] == 0.3 and checkpoint["args"]["alpha"] == 0.003
    assert flexloop_run.load_checkpoint(smoke_run / "pretrained.pt")["global_step"] == 6


@pytest.mark.slow  # one episode of each task at each depth, twice, in real MuJoCo envs
@pytest.mark.parametrize("env_name", ["cube-double-play-v0", "scene-play-v0", "puzzle-4x4-play-v0",
                                      "antmaze-medium-stitch-v0"])
def test_the_other_four_datasets_train_both_phases_and_evaluate(env_name, tmp_path):
    """The smoke run above uses pointmaze; the protocol's other four datasets differ in their observations and
    goals, in scene's and puzzle's button states and in their evaluation envs (antmaze generates with the
    committed ant expert). Each trains both phases on tiny generated data and evaluates every task at each depth."""
    ogbench_data.generate_dataset(env_name, str(tmp_path / "data"), episodes=2, episode_steps=40, progress=False)
    args = tiny_args(tmp_path / "data", tmp_path / "runs", env_name=env_name, pretrain_steps=2, total_steps=2)
    run_dir = Path(gciql.train(args))
    records = read_metrics(run_dir)
    assert_evaluated_at_each_phase_end(records, pretrain_end=2, end=4)
    checkpoint = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert checkpoint["env_id"] == env_name and checkpoint["global_step"] == 4 and checkpoint["phase"] == "flexloop"


def test_checkpoint_loads_in_a_fresh_process(smoke_run):
    checkpoint = flexloop_run.load_checkpoint(smoke_run / "final.pt")
    actor, _ = gciql.network_from_checkpoint(checkpoint)
    x = torch.linspace(-1, 1, 8).view(4, 2)
    expected = actor.all_depths(x, x.flip(0)).tolist()
    code = ("import json, torch, flexloop_gciql as m, flexloop_run\n"
            f"actor, args = m.network_from_checkpoint(flexloop_run.load_checkpoint({str(smoke_run / 'final.pt')!r}))\n"
            "x = torch.linspace(-1, 1, 8).view(4, 2)\n"
            "print(json.dumps([actor.depth, args.env_name, actor.all_depths(x, x.flip(0)).tolist()]))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=SUBPROCESS_ENV, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    depth, env_name, policies = json.loads(result.stdout.strip().splitlines()[-1])
    assert depth == 2 and env_name == PM
    np.testing.assert_allclose(policies, expected, rtol=1e-5, atol=1e-6)


def test_policy_step_bench_times_the_protocols_policies_per_row_count(smoke_run):
    """bench/ogbench_policy_step.py: one JSON line per thread count and row count, for the protocol's K fixed
    depths and 11 thresholds, with the time a row consistent with the time a call."""
    result = subprocess.run([sys.executable, str(REPO / "bench" / "ogbench_policy_step.py"), "--checkpoint",
                             str(smoke_run / "final.pt"), "--rows", "3", "7", "--threads", "1", "--seconds", "0.05"],
                            cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(line["rows"], line["threads"]) for line in lines] == [(3, 1), (7, 1)]
    for line in lines:
        assert line["policies"] == 2 + 11 and line["env_id"] == PM and line["calls"] > 0
        assert line["us_per_row"] == pytest.approx(line["ms_per_call"] * 1e3 / line["rows"], rel=0.01, abs=0.01)


def test_resume_from_pretrained_checkpoint_continues_the_run(smoke_run, tmp_path):
    # pretrained.pt is a full checkpoint at update 6: resuming from a copy re-runs the FlexLoop phase
    run_copy = tmp_path / smoke_run.name
    run_copy.mkdir()
    for name in ["pretrained.pt", "metrics.jsonl"]:
        (run_copy / name).write_bytes((smoke_run / name).read_bytes())
    # on the CPU, as the smoke run ran: on a GPU machine the default would move it and draw other batches
    args = gciql.Args(resume=str(run_copy / "pretrained.pt"), run_dir="ignored-on-resume", cuda=False)
    checkpoint = flexloop_run.load_checkpoint(run_copy / "pretrained.pt")
    checkpoint["args"]["run_dir"] = str(tmp_path)
    flexloop_run.save_checkpoint(run_copy / "pretrained.pt", checkpoint)
    assert gciql.train(args) == run_copy
    steps = [r["global_step"] for r in read_metrics(run_copy) if "losses/critic_loss" in r]
    assert steps == [3, 6, 9, 12]  # nothing repeated or lost
    resumed = flexloop_run.load_checkpoint(run_copy / "final.pt")
    original = flexloop_run.load_checkpoint(smoke_run / "final.pt")
    for name, tensor in original["model"].items():  # the same RNG streams and data give the same weights
        torch.testing.assert_close(resumed["model"][name], tensor)


def test_init_checkpoint_runs_flexloop_only_and_checks_shapes(smoke_run, data_dir, tmp_path):
    run_dir = gciql.train(tiny_args(data_dir, tmp_path, init_checkpoint=str(smoke_run / "pretrained.pt")))
    assert not (run_dir / "pretrained.pt").exists()
    records = [r for r in read_metrics(run_dir) if "losses/critic_loss" in r]
    assert [(r["global_step"], r["phase"]) for r in records] == [(3, "flexloop"), (6, "flexloop")]
    with pytest.raises(ValueError, match="--depth 2"):
        gciql.train(tiny_args(data_dir, tmp_path, depth=3, init_checkpoint=str(smoke_run / "pretrained.pt")))


def test_init_checkpoint_takes_a_slim_checkpoint_and_its_target_critic_from_a_full_one(smoke_run, data_dir,
                                                                                       tmp_path):
    full_path, slim_path = smoke_run / "pretrained.pt", tmp_path / "slim" / "pretrained.pt"
    assert "target_model" in flexloop_run.slim_checkpoint(full_path, slim_path)
    full, slim = flexloop_run.load_checkpoint(full_path), flexloop_run.load_checkpoint(slim_path)
    network = gciql.build_network(gciql.Args(**full["args"]), torch.device("cpu"))
    network.load_state_dict(full["model"])
    critic = network.critic.state_dict()
    assert any(not torch.equal(full["target_model"][name], critic[name]) for name in critic)  # they differ
    from_full = gciql.initial_target_critic(network, full).state_dict()
    from_slim = gciql.initial_target_critic(network, slim).state_dict()
    for name in from_full:  # the run's own target from a full checkpoint, the loaded critic from a slim one
        torch.testing.assert_close(from_full[name], full["target_model"][name])
        torch.testing.assert_close(from_slim[name], critic[name])
    run_dir = gciql.train(tiny_args(data_dir, tmp_path / "runs", init_checkpoint=str(slim_path)))
    records = [r for r in read_metrics(run_dir) if "losses/critic_loss" in r]
    assert [(r["global_step"], r["phase"]) for r in records] == [(3, "flexloop"), (6, "flexloop")]


def test_init_optimizer_continues_the_pretraining_adam_state_and_refuses_a_slim_checkpoint(smoke_run, data_dir,
                                                                                           tmp_path):
    full = flexloop_run.load_checkpoint(smoke_run / "pretrained.pt")
    network = gciql.build_network(gciql.Args(**full["args"]), torch.device("cpu"))
    optimizer = torch.optim.Adam(network.parameters(), lr=1e-5)
    optimizer.load_state_dict(gciql.initial_optimizer_state(full, optimizer))
    loaded, saved = optimizer.state_dict(), full["optimizer"]
    assert loaded["state"][0]["step"].item() == saved["state"][0]["step"].item() > 0  # pretraining's step count
    for index in saved["state"]:  # Adam's moments as pretraining left them
        torch.testing.assert_close(loaded["state"][index]["exp_avg"], saved["state"][index]["exp_avg"])
        torch.testing.assert_close(loaded["state"][index]["exp_avg_sq"], saved["state"][index]["exp_avg_sq"])
    assert [group["lr"] for group in loaded["param_groups"]] == [1e-5]  # this run's learning rate, not the saved one

    run_dir = gciql.train(tiny_args(data_dir, tmp_path / "runs", init_checkpoint=str(smoke_run / "pretrained.pt"),
                                    init_optimizer=True))
    records = [r for r in read_metrics(run_dir) if "losses/critic_loss" in r]
    assert [(r["global_step"], r["phase"]) for r in records] == [(3, "flexloop"), (6, "flexloop")]
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")  # Adam counted on from pretraining's steps
    assert final["optimizer"]["state"][0]["step"].item() == saved["state"][0]["step"].item() + 6

    slim_path = tmp_path / "slim" / "pretrained.pt"
    flexloop_run.slim_checkpoint(smoke_run / "pretrained.pt", slim_path)
    with pytest.raises(ValueError, match="needs a full checkpoint"):
        gciql.train(tiny_args(data_dir, tmp_path / "refused", init_checkpoint=str(slim_path), init_optimizer=True))
    assert not (tmp_path / "refused").exists()  # refused before any run folder


def test_action_drift_bench_measures_movement_and_saturation(smoke_run, data_dir, capsys):
    spec = importlib.util.spec_from_file_location("action_drift", REPO / "bench" / "action_drift.py")
    action_drift = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action_drift)
    pretrained, final = str(smoke_run / "pretrained.pt"), str(smoke_run / "final.pt")
    report = action_drift.main(["--env-name", PM, "--dataset-dir", str(data_dir), "--states", "256",
                                "--pairs", pretrained, final, final, final])
    assert json.loads(capsys.readouterr().out) == report  # what it prints is the JSON it returns
    moved, still = (pair["mean_action_change"] for pair in report["pairs"])
    assert still == [0.0, 0.0] and max(moved) > 0  # a checkpoint against itself has not moved; FlexLoop moved
    for path in (pretrained, final):
        checkpoint = report["checkpoints"][path]
        assert len(checkpoint["outside_box"]) == 2 and all(0 <= f <= 1 for f in checkpoint["outside_box"])
    with pytest.raises(SystemExit):
        action_drift.main(["--env-name", PM, "--dataset-dir", str(data_dir), "--pairs", pretrained])
    assert "two by two" in capsys.readouterr().err


@pytest.mark.slow
def test_iru_pretrain_gciql_subcommand(data_dir, tmp_path):
    command = [sys.executable, "iru_pretrain.py", "gciql", "--env-name", PM, "--dataset-dir", str(data_dir),
               "--no-download", "--run-dir", str(tmp_path), "--no-cuda", "--depth", "2", "--hidden-dim", "16",
               "--batch-size", "32", "--pretrain-steps", "4", "--log-every", "2", "--save-every", "2",
               "--eval-episodes", "1", "--eval-envs", "5", "--no-eval-async"]
    result = subprocess.run(command, cwd=REPO, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    (run_dir,) = tmp_path.iterdir()
    assert "iru_pretrain_gciql" in run_dir.name
    checkpoint = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert checkpoint["global_step"] == 4 and checkpoint["phase"] == "pretrain"
    assert checkpoint["args"]["lambda_depth"] == 0.0 and checkpoint["args"]["total_steps"] == 0


# --------------------------------------------------------------------------------------------- bad input


def test_missing_dataset_fails_before_any_work(tmp_path):
    runs = tmp_path / "runs"
    args = gciql.Args(env_name=PM, dataset_dir=str(tmp_path / "empty"), download=False, run_dir=str(runs),
                      cuda=False)
    with pytest.raises(FileNotFoundError, match=f"python -m envs.ogbench_data generate --env {PM}"):
        gciql.train(args)
    assert not runs.exists()


@pytest.mark.parametrize("overrides, message", [
    (dict(depth=1), "--depth must be at least 2"),
    (dict(lambda_depth=-0.1), "--lambda-depth must be >= 0"),
    (dict(env_name="cube-single-play-v0"), "is not a dataset of gciql; choose one of"),
    (dict(expectile=1.0), "--expectile"),
    (dict(batch_size=0), "--batch-size must be positive"),
    (dict(resume="a.pt", init_checkpoint="b.pt"), "not both"),
    (dict(init_optimizer=True), "--init-optimizer takes the Adam state of an --init-checkpoint"),
])
def test_bad_flags(overrides, message):
    with pytest.raises(ValueError, match=message):
        gciql.check_args(replace(gciql.Args(), **overrides))


def test_bad_checkpoints(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        flexloop_run.load_checkpoint(tmp_path / "missing.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is a text file, not a FlexLoop checkpoint"):
        flexloop_run.load_checkpoint(tmp_path / "junk.pt")
    torch.save({"format": flexloop_run.CHECKPOINT_FORMAT, "algorithm": "gcdqn", "args": {}, "env_id": "BoxPick-Exact-4-v0",
                "depth": 5, "model": {}}, tmp_path / "dqn.pt")
    with pytest.raises(ValueError, match="flexloop_gcdqn.py"):
        flexloop_run.load_checkpoint(tmp_path / "dqn.pt", gciql.ALGORITHM)


def updates_with_and_without_bf16(data_dir, tmp_path, device, updates):
    """The same network trained for `updates` updates on the same batches with --bf16 and with --no-bf16: for each,
    its weights before and after, and its summed losses."""
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, tmp_path, depth=3, hidden_dim=32))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False, device=device)
    results = []
    for bf16 in (True, False):
        torch.manual_seed(0)
        network = gciql.build_network(args, device)
        target_critic = gciql.initial_target_critic(network, None)
        optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate)
        loss_sums = torch.zeros(len(gciql.LOSS_NAMES), device=device)
        update = gciql.make_update(replace(args, bf16=bf16), network, target_critic, optimizer, dataset,
                                   torch.Generator(device).manual_seed(0), torch.tensor(0.3, device=device), loss_sums)
        before = [p.detach().clone() for p in network.parameters()]
        for _ in range(updates):
            update()
        results.append({"before": before, "after": [p.detach().clone() for p in network.parameters()],
                        "losses": loss_sums})
    return results


def test_bf16_is_the_default_on_a_gpu_and_a_cpu_update_stays_float32(data_dir, tmp_path):
    """--bf16 (on by default since it learned as well as TF32) autocasts the update on a GPU only: on a CPU two
    updates with and without it leave exactly the same weights, so CPU runs and the CPU tests keep float32."""
    assert gciql.Args().bf16
    half, full = updates_with_and_without_bf16(data_dir, tmp_path, "cpu", updates=2)
    assert not all(torch.equal(a, b) for a, b in zip(half["before"], half["after"]))  # the updates did change them
    assert all(torch.equal(a, b) for a, b in zip(half["after"], full["after"]))


def test_update_autocast_keeps_no_cache_of_cast_weights(data_dir):
    """Autocast's cache of cast weights is shared by the CUDA streams of --cuda-streams, where a branch could read
    another stream's cast before it is written, and CUDA graph capture asks for it off: the update's autocast
    turns it off (it does so on any device, so a CPU checks the rule)."""
    args = tiny_args(data_dir, "unused", bf16=True)
    assert torch.is_autocast_cache_enabled()  # torch's default
    with gciql.bf16_autocast(args, torch.device("cpu")):
        assert not torch.is_autocast_cache_enabled()
    assert torch.is_autocast_cache_enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_bf16_on_a_gpu_trains_in_bf16_close_to_float32(data_dir, tmp_path):
    """On a GPU, --bf16 (the default) does change the update's arithmetic, and its losses only by bf16's rounding."""
    half, full = updates_with_and_without_bf16(data_dir, tmp_path, "cuda", updates=1)
    assert not all(torch.equal(a, b) for a, b in zip(half["after"], full["after"]))  # the matmuls did run in bf16
    torch.testing.assert_close(half["losses"], full["losses"], rtol=0.05, atol=0.05)  # the same batch, the same losses


@pytest.mark.slow
def test_bf16_update_keeps_heads_in_float32_and_the_loss_close(data_dir, tmp_path):
    """--bf16 runs the networks' matmuls in bf16 but every head (V, Q, the actor's mean) in float32, so the loss
    stays within bf16's precision of the float32 one, and a run trains end to end."""
    torch.manual_seed(0)
    args = gciql.resolve_dataset_defaults(tiny_args(data_dir, tmp_path, depth=3, hidden_dim=32))
    dataset = ogbench_data.load_dataset(PM, dataset_dir=str(data_dir), download=False)
    agent, target_critic = gciql.build_network(args, "cpu"), gciql.build_network(args, "cpu").critic
    batch = dataset.sample(32, torch.Generator().manual_seed(0))
    full, _ = gciql.flexloop_losses(agent, target_critic, batch, args, torch.tensor(0.3))
    with torch.autocast("cpu", torch.bfloat16):
        half, terms = gciql.flexloop_losses(agent, target_critic, batch, replace(args, bf16=True), torch.tensor(0.3))
        value_in = torch.zeros(1, agent.value.embed.weight.shape[1])
        assert agent.value.output(agent.value.start(value_in)).dtype == torch.float32
    assert half.dtype == torch.float32 and all(t.dtype == torch.float32 for t in terms.values())
    torch.testing.assert_close(half, full, rtol=0.05, atol=0.05)
    assert not torch.equal(half, full)  # the matmuls did run in bf16
    run_dir = gciql.train(replace(tiny_args(data_dir, tmp_path), bf16=True))
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["args"]["bf16"] is True
