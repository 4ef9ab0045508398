"""FlexLoop post-training of IRU GC-IQL on an OGBench dataset (offline; one file, CleanRL style).

    python -m envs.ogbench_data generate --env pointmaze-large-stitch-v0 --out ~/.ogbench/data   # or download
    python flexloop_gciql.py --env-name pointmaze-large-stitch-v0                  # pretrain IRU-5, then FlexLoop
    python flexloop_gciql.py --env-name pointmaze-large-stitch-v0 --init-checkpoint runs/X/pretrained.pt

GC-IQL as OGBench runs it (REFERENCE.md §4), with separate IRU networks for the value V(s, g), the critic
Q(s, g, a) (an ensemble of 2) and the actor, all trained at the full depth K:
    value   expectile_0.9( min_i Q_target,i(s, g, a) - V(s, g) )
    critic  sum_i ( Q_i(s, g, a) - (r + gamma * mask * V(s', g)) )^2
    actor   -Q(s, g, clip(mu)) / sg(mean |Q|) - alpha * log pi(a | s, g)      (DDPG+BC, std fixed at 1)
Only the actor is depth-elastic. FlexLoop adds lambda_depth * mean_{k<K} D~(sg[pi_{k+1}] || pi_k) with the
normalised Gaussian KL (see `IRUActor.divergence`)
    D~(p || q) = (1/|A|) sum_j (mu_p,j - mu_q,j)^2 / (2 sigma_p,j^2),
the KL between N(mu_p, sigma_p^2) and N(mu_q, sigma_p^2): the student's std is replaced by the (detached)
teacher's, so the student cannot shrink the loss by inflating its own scale, and it is averaged over action
dimensions so that one lambda serves datasets with 2 to 8 action dimensions.
"""

import io
import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal, Optional

import gymnasium
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tqdm.auto import tqdm

from envs import ogbench_data

ALGORITHM = "gciql"
CHECKPOINT_FORMAT = "flexloop-checkpoint-v1"
TASK_IDS = (1, 2, 3, 4, 5)  # OGBench's evaluation tasks, 1-indexed as env.reset(options=dict(task_id=k)) takes them
ACTOR_STD = 1.0  # OGBench's const_std=True: the actor's Gaussian has a fixed unit std


@dataclass
class Args:
    exp_name: str = "flexloop_gciql"
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """use CUDA when it is available (see `require_cuda` to fail instead of falling back to CPU)"""
    require_cuda: bool = False
    """fail instead of falling back to CPU when no GPU is present"""
    track: bool = False
    """log to Weights & Biases (honours WANDB_MODE=offline)"""
    wandb_project_name: str = "flexloop"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    wandb_group: Optional[str] = None
    """the W&B group, to compare the runs of one study"""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags"""
    run_dir: str = "runs"
    """runs are written to <run_dir>/<run_name>/ (metrics.jsonl, checkpoints)"""
    resume: Optional[str] = None
    """continue the run whose checkpoint is at this path (its run folder, flags and W&B id are reused)"""
    init_checkpoint: Optional[str] = None
    """start FlexLoop post-training from this pretrained IRU-K checkpoint (skips pretraining)"""

    # Dataset
    env_name: str = "pointmaze-large-stitch-v0"
    """scene-play-v0, cube-double-play-v0, puzzle-4x4-play-v0, antmaze-medium-stitch-v0 or pointmaze-large-stitch-v0"""
    dataset_dir: Optional[str] = None
    """folder holding <env-name>.npz (default ~/.ogbench/data); on --resume, given here it replaces the run's"""
    dataset_path: Optional[str] = None
    """a local <env-name>.npz file, used instead of --dataset-dir (on --resume, given here it replaces the run's)"""
    download: bool = True
    """download a missing dataset into the dataset folder (ogbench's behaviour); --no-download fails at once"""

    # IRU networks (value, critic and actor alike)
    depth: int = 5
    """K, the number of recurrent steps of each IRU"""
    hidden_dim: int = 256
    """IRU width d"""
    num_critics: int = 2
    """critic ensemble size (the value and actor losses use the minimum over the ensemble)"""
    iru_variant: Literal["residual", "paper"] = "residual"
    """residual: the public code (gates and head read h = sum tanh(c)); paper: the paper's equation (tanh(c), c)"""
    backbone: Literal["iru", "lstm"] = "iru"
    """iru: the IRU cell; lstm: an LSTM cell unrolled over depth, for all three networks (§5.4's backbone ablation)"""

    # GC-IQL
    learning_rate: float = 3e-4
    """Adam learning rate (all three networks)"""
    batch_size: int = 1024
    """transitions per update"""
    gamma: float = 0.99
    """discount (also the geometric rate of the value's trajectory goals)"""
    tau: float = 0.005
    """Polyak rate of the target critic, applied every update"""
    expectile: float = 0.9
    """expectile of the value loss"""
    alpha: Optional[float] = None
    """BC weight of the DDPG+BC actor loss (default: the dataset's, REFERENCE.md §4)"""
    pretrain_steps: int = 1_000_000
    """IRU-K pretraining updates (lambda = 0) when no --init-checkpoint is given"""
    total_steps: int = 1_000_000
    """FlexLoop post-training updates"""

    # FlexLoop
    lambda_depth: Optional[float] = None
    """weight of the adjacent-depth normalised KL on the actor (default: the dataset's, REFERENCE.md §4; 0 = IRU-K)"""
    depth_target: Literal["adjacent", "final"] = "adjacent"
    """adjacent: D~(sg[pi_{k+1}] || pi_k) (FlexLoop); final: every depth distilled from depth K, D~(sg[pi_K] || pi_k)"""

    # Evaluation, logging, speed
    eval_every: int = 100_000
    """evaluate every depth on every task every this many updates (and at the end of each phase)"""
    eval_episodes: int = 50
    """episodes per task and depth (0: no evaluation during training, e.g. on a machine without MuJoCo;
    evaluate the checkpoints later with eval_adaptive.py)"""
    eval_envs: int = 50
    """OGBench envs stepped side by side during evaluation; the policy acts on all of them in one batch"""
    eval_async: bool = True
    """step the evaluation envs in subprocesses (gymnasium AsyncVectorEnv, one per env); False: in this process"""
    log_every: int = 10_000
    """log training metrics every this many updates"""
    save_every: int = 50_000
    """write the latest checkpoint every this many updates"""
    compile: bool = True
    """torch.compile the losses (CUDA only: on CPU compiling costs more than it saves)"""
    cuda_graph: bool = True
    """capture one update (sampling included) in a CUDA graph and replay it (CUDA only)"""


def check_args(args: Args):
    """Refuse bad flags before any work starts, naming the fix."""
    if args.depth < 2:
        raise ValueError(f"--depth must be at least 2 for FlexLoop's adjacent-depth loss, got {args.depth}")
    if args.lambda_depth is not None and args.lambda_depth < 0:
        raise ValueError(f"--lambda-depth must be >= 0, got {args.lambda_depth}")
    if args.alpha is not None and args.alpha < 0:
        raise ValueError(f"--alpha must be >= 0, got {args.alpha}")
    if args.env_name not in ogbench_data.DATASETS:
        raise ValueError(f"--env-name {args.env_name!r} is not one of the five datasets; choose one of "
                         f"{list(ogbench_data.DATASETS)}")
    if args.eval_episodes < 0:
        raise ValueError(f"--eval-episodes must be >= 0, got {args.eval_episodes}")
    for name in ["batch_size", "hidden_dim", "num_critics", "eval_every", "eval_envs", "log_every", "save_every"]:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.pretrain_steps < 0 or args.total_steps < 0:
        raise ValueError("--pretrain-steps and --total-steps must be >= 0")
    if not 0 < args.expectile < 1:
        raise ValueError(f"--expectile must lie in (0, 1), got {args.expectile}")
    if not 0 < args.gamma < 1:
        raise ValueError(f"--gamma must lie in (0, 1), got {args.gamma}")
    if not 0 < args.tau <= 1:
        raise ValueError(f"--tau must lie in (0, 1], got {args.tau}")
    if args.require_cuda and not torch.cuda.is_available():
        raise RuntimeError("--require-cuda was given but no CUDA GPU is visible; drop the flag or use --no-cuda")
    if args.resume and args.init_checkpoint:
        raise ValueError("give either --resume (continue a run) or --init-checkpoint (start post-training), not both")
    if args.backbone == "lstm" and args.iru_variant != "residual":
        raise ValueError("--iru-variant applies to the IRU backbone only; drop it with --backbone lstm")


def resolve_dataset_defaults(args: Args):
    """A copy of args with alpha and lambda_depth set to the dataset's values (REFERENCE.md §4) where not given,
    so that the run records the values it used."""
    spec = ogbench_data.get_spec(args.env_name)
    alpha = spec.alpha if args.alpha is None else args.alpha
    lambda_depth = spec.lambda_depth if args.lambda_depth is None else args.lambda_depth
    return replace(args, alpha=alpha, lambda_depth=lambda_depth)


# ---------------------------------------------------------------------------------------------------------
# IRU networks. One class serves all three: an ensemble of `members` IRUs evaluated as batched matmuls.
# ---------------------------------------------------------------------------------------------------------
class EnsembleLinear(nn.Module):
    """num_members independent Linear layers applied to (members, rows, in_features)."""

    def __init__(self, num_members, in_features, out_features):
        super().__init__()
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init
        self.weight = nn.Parameter(torch.empty(num_members, in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(num_members, 1, out_features).uniform_(-bound, bound))

    def forward(self, x):
        return torch.baddbmm(self.bias, x, self.weight)


class EnsembleLayerNorm(nn.Module):
    def __init__(self, num_members, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_members, 1, features))
        self.bias = nn.Parameter(torch.zeros(num_members, 1, features))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:]) * self.weight + self.bias


class IRU(nn.Module):
    """`members` IRUs side by side, each read out after every one of K recurrent steps (REFERENCE.md §1):

        x_emb = LayerNorm(Linear(x))                    x: the concatenated input
        z     = LayerNorm(concat[x_emb, h])            (paper variant: concat[x_emb, tanh(c)])
        f     = sigmoid(Linear_forget(z)),  i = tanh(Linear_input(z))      (forget bias initialised to +1)
        c     = f * c + (1 - f) * i
        h     = h + tanh(c)                              (residual across steps)
        out_k = Head(h)                                  (paper variant: Head(c)); plain Linear

    The recurrent state is a tuple (x_emb, c, h) of tensors shaped (members, rows, d), zero at depth 0.
    """

    def __init__(self, in_dim, out_dim, depth=5, hidden_dim=256, variant="residual", members=1):
        super().__init__()
        self.depth, self.hidden_dim, self.variant, self.members = depth, hidden_dim, variant, members
        self.embed = EnsembleLinear(members, in_dim, hidden_dim)
        self.embed_norm = EnsembleLayerNorm(members, hidden_dim)
        self.gate_norm = EnsembleLayerNorm(members, 2 * hidden_dim)
        self.gates = EnsembleLinear(members, 2 * hidden_dim, 2 * hidden_dim)  # forget and input, one matmul
        with torch.no_grad():
            self.gates.bias[..., :hidden_dim] = 1.0  # forget-gate bias +1: remember by default
        self.head = EnsembleLinear(members, hidden_dim, out_dim)

    def start(self, x):
        x_emb = self.embed_norm(self.embed(x.expand(self.members, -1, -1)))
        zeros = torch.zeros_like(x_emb)
        return x_emb, zeros, zeros

    def advance(self, state):
        x_emb, c, h = state
        carried = h if self.variant == "residual" else torch.tanh(c)
        z = self.gate_norm(torch.cat([x_emb, carried], -1))
        forget_logits, input_logits = self.gates(z).chunk(2, -1)
        forget = torch.sigmoid(forget_logits)
        c = forget * c + (1 - forget) * torch.tanh(input_logits)
        h = h + torch.tanh(c)
        return x_emb, c, h

    def readout(self, state):
        _, c, h = state
        return self.head(h if self.variant == "residual" else c)  # (members, rows, out_dim)

    def forward(self, x):
        """The full-depth output, (members, rows, out_dim)."""
        state = self.start(x)
        for _ in range(self.depth):
            state = self.advance(state)
        return self.readout(state)


class LSTM(IRU):
    """The IRU's drop-in replacement for the backbone ablation: an LSTM cell unrolled over depth for a fixed input,

        x_emb = LayerNorm(Linear(x)),   i, f, g, o = Linear(concat[x_emb, h])   (forget-gate bias initialised to +1)
        c = sigmoid(f) * c + sigmoid(i) * tanh(g),   h = sigmoid(o) * tanh(c),   out_k = Head(h)

    with the IRU's state (x_emb, c, h), members and methods."""

    def __init__(self, in_dim, out_dim, depth=5, hidden_dim=256, members=1):
        super().__init__(in_dim, out_dim, depth, hidden_dim, "residual", members)  # "residual": the head reads h
        del self.gate_norm  # a plain LSTM cell: no normalisation inside
        self.gates = EnsembleLinear(members, 2 * hidden_dim, 4 * hidden_dim)  # input, forget, cell, output
        with torch.no_grad():
            self.gates.bias[..., hidden_dim:2 * hidden_dim] = 1.0

    def advance(self, state):
        x_emb, c, h = state
        input_gate, forget_gate, cell, output_gate = self.gates(torch.cat([x_emb, h], -1)).chunk(4, -1)
        c = torch.sigmoid(forget_gate) * c + torch.sigmoid(input_gate) * torch.tanh(cell)
        h = torch.sigmoid(output_gate) * torch.tanh(c)
        return x_emb, c, h


def recurrent_network(backbone, in_dim, out_dim, depth, hidden_dim, variant, members=1):
    if backbone == "lstm":
        return LSTM(in_dim, out_dim, depth, hidden_dim, members)
    return IRU(in_dim, out_dim, depth, hidden_dim, variant, members)


class IRUActor(nn.Module):
    """The depth-elastic Gaussian actor pi_k(a | s, g) = N(mu_k(s, g), ACTOR_STD^2), mu_k read out at depth k.

    A policy is one tensor with the batch first, (rows, 2, action_dim): policy[:, 0] is the mean and
    policy[:, 1] the std, so eval_adaptive.py can index, gather and stack it like GC-DQN's logits.

    Depth protocol (shared with the other scripts and eval_adaptive.py):
        state = start(obs, goal)          depth 0, zero recurrent state
        state = advance(state)            depth k -> k + 1
        policy = decide(state)            pi_k as (rows, 2, action_dim): mean and std
        all_depths(obs, goal)             the policies of depths 1..K, (K, rows, 2, action_dim)
        divergence(p, q)                  the normalised KL D~(p || q) per row: training loss and delta_k
        gather(state, rows)               the recurrent state of some batch rows (adaptive inference)
        act(policy)                       the mean action clipped to [-1, 1] (a sample with deterministic=False)
    """

    def __init__(self, obs_dim, action_dim, depth=5, hidden_dim=256, variant="residual", std=ACTOR_STD,
                 backbone="iru"):
        super().__init__()
        self.depth, self.action_dim, self.std = depth, action_dim, std
        self.iru = recurrent_network(backbone, 2 * obs_dim, action_dim, depth, hidden_dim, variant)  # or an LSTM

    def start(self, obs, goal):
        return self.iru.start(torch.cat([obs, goal], -1))

    def advance(self, state):
        return self.iru.advance(state)

    def decide(self, state):
        mean = self.iru.readout(state)[0]
        return torch.stack([mean, torch.full_like(mean, self.std)], 1)

    def all_depths(self, obs, goal):
        state = self.start(obs, goal)
        policies = []
        for _ in range(self.depth):
            state = self.advance(state)
            policies.append(self.decide(state))
        return torch.stack(policies)

    @staticmethod
    def divergence(p, q):
        """Normalised Gaussian KL, per row: D~(p || q) = (1/|A|) sum_j (tanh mu_p,j - tanh mu_q,j)^2 / (2 sigma_p,j^2).

        It is KL(N(tanh mu_p, sigma_p^2) || N(tanh mu_q, sigma_p^2)) averaged over action dimensions: q's std is
        replaced by p's. The raw KL's (sigma_p^2 + (mu_p - mu_q)^2) / (2 sigma_q^2) + log(sigma_q / sigma_p) can be
        cut by inflating sigma_q, the student's scale; this cannot (q's std does not enter), and it is zero exactly
        when the means agree. The means are squashed into the action range [-1, 1] first: with unbounded means,
        pulling a shallow depth towards a deeper one through shared weights also pushes the deeper one further
        out, and on pointmaze (alpha 0.003, lambda 0.3) the means ran away to |mu| > 200 within 800 updates;
        squashed, the distance and its gradient stay bounded. In training p is the deeper, detached teacher and
        q the shallower student."""
        mean_p, std_p = torch.tanh(p[..., 0, :]), p[..., 1, :]
        mean_q = torch.tanh(q[..., 0, :])
        return ((mean_p - mean_q) ** 2 / (2 * std_p ** 2)).mean(-1)

    @staticmethod
    def gather(state, rows):
        return tuple(t[:, rows] for t in state)

    def act(self, policy, generator=None, deterministic=True):
        """The mean action (OGBench evaluates at temperature 0), or a sample, clipped to the action box."""
        mean, std = policy[..., 0, :], policy[..., 1, :]
        if not deterministic:
            mean = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)
        return mean.clamp(-1.0, 1.0)


class GCIQLAgent(nn.Module):
    """The three networks of GC-IQL: value V(s, g), critic ensemble Q_i(s, g, a) and the actor."""

    def __init__(self, obs_dim, action_dim, depth=5, hidden_dim=256, variant="residual", num_critics=2,
                 backbone="iru"):
        super().__init__()
        self.value = recurrent_network(backbone, 2 * obs_dim, 1, depth, hidden_dim, variant)
        self.critic = recurrent_network(backbone, 2 * obs_dim + action_dim, 1, depth, hidden_dim, variant,
                                        members=num_critics)
        self.actor = IRUActor(obs_dim, action_dim, depth, hidden_dim, variant, backbone=backbone)


def value_at(value, obs, goal):
    return value(torch.cat([obs, goal], -1))[0, :, 0]  # (rows,)


def critics_at(critic, obs, goal, action):
    return critic(torch.cat([obs, goal, action], -1))[..., 0]  # (critics, rows)


# ---------------------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------------------
def expectile_loss(diff, expectile):
    """|expectile - 1(diff < 0)| * diff^2: with expectile 0.9, V is pushed towards an upper expectile of Q."""
    weight = torch.where(diff >= 0, expectile, 1 - expectile)
    return weight * diff ** 2


def critic_target(rewards, masks, next_value, gamma):
    """r + gamma * mask * V(s', g); mask = 0 where s is the goal, so bootstrapping stops there."""
    return rewards + gamma * masks * next_value


def gaussian_log_prob(actions, mean, std):
    """log N(actions; mean, diag(std^2)), summed over action dimensions."""
    return (-0.5 * ((actions - mean) / std) ** 2 - torch.log(std) - 0.5 * math.log(2 * math.pi)).sum(-1)


def ddpg_bc_actor_loss(q, log_prob, alpha):
    """DDPG+BC: -Q(s, g, mu) / sg(mean |Q|) - alpha * log pi(a | s, g). Returns (loss, q_loss, bc_loss).
    Dividing by the detached mean |Q| makes the Q term scale-free, so one alpha fits any reward scale."""
    q_loss = -q.mean() / (q.abs().mean().detach() + 1e-6)
    bc_loss = -(alpha * log_prob).mean()
    return q_loss + bc_loss, q_loss, bc_loss


def flexloop_depth_loss(policies, target="adjacent"):
    """mean_{k=1..K-1} D~(sg[pi_{k+1}] || pi_k) over the stacked policies (K, rows, 2, A); with target="final",
    mean_{k=1..K-1} D~(sg[pi_K] || pi_k) instead.
    The deeper policy is the target (detached), so only the shallower depth moves towards it."""
    deeper = policies[1:] if target == "adjacent" else policies[-1:].expand_as(policies[:-1])
    return IRUActor.divergence(deeper.detach(), policies[:-1]).mean()


LOSS_NAMES = ["losses/value_loss", "losses/critic_loss", "losses/actor_loss", "losses/depth_kl", "losses/q_loss",
              "losses/bc_loss", "charts/v_mean", "charts/q_mean", "charts/actor_mse"]


def gciql_losses(agent, target_critic, batch, args, lambda_depth):
    """The summed GC-IQL + FlexLoop loss of one batch and its parts (a tensor in LOSS_NAMES order)."""
    obs, actions, value_goals, actor_goals = (batch["observations"], batch["actions"], batch["value_goals"],
                                              batch["actor_goals"])
    with torch.no_grad():
        target_q = critics_at(target_critic, obs, value_goals, actions).min(0).values
        next_v = value_at(agent.value, batch["next_observations"], value_goals)
        q_target = critic_target(batch["rewards"], batch["masks"], next_v, args.gamma)

    v = value_at(agent.value, obs, value_goals)
    value_loss = expectile_loss(target_q - v, args.expectile).mean()

    q = critics_at(agent.critic, obs, value_goals, actions)
    critic_loss = ((q - q_target) ** 2).mean(1).sum()  # MSE on each critic

    # Actor at depth K. Q(s, g, mu) trains only the actor: the critic runs with detached weights.
    policies = agent.actor.all_depths(obs, actor_goals)  # (K, B, 2, A)
    mean, std = policies[-1, :, 0], policies[-1, :, 1]
    frozen_critic = {name: p.detach() for name, p in agent.critic.named_parameters()}
    q_actor_input = torch.cat([obs, actor_goals, mean.clamp(-1.0, 1.0)], -1)
    q_actor = torch.func.functional_call(agent.critic, frozen_critic, (q_actor_input,))[..., 0].min(0).values
    actor_loss, q_loss, bc_loss = ddpg_bc_actor_loss(q_actor, gaussian_log_prob(actions, mean, std), args.alpha)
    depth_kl = flexloop_depth_loss(policies, args.depth_target)

    loss = value_loss + critic_loss + actor_loss + lambda_depth * depth_kl
    parts = torch.stack([value_loss, critic_loss, actor_loss, depth_kl, q_loss, bc_loss, v.mean(), q.mean(),
                         ((mean - actions) ** 2).mean()])
    return loss, parts.detach()


def make_update(agent, target_critic, optimizer, dataset, args, generator, lambda_depth, loss_sums,
                compile_losses=False):
    """One update, all on the device with fixed shapes and no host sync (so it can be captured in a CUDA graph):
    sample a batch, the losses, Adam, Polyak averaging of the target critic; the loss parts add to loss_sums.
    lambda_depth is a 0-d tensor, so one captured graph serves both phases."""
    losses = torch.compile(gciql_losses) if compile_losses else gciql_losses
    critic_params, target_params = list(agent.critic.parameters()), list(target_critic.parameters())

    def update():
        batch = dataset.sample(args.batch_size, generator)
        loss, parts = losses(agent, target_critic, batch, args, lambda_depth)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(target_params, critic_params, args.tau)
            loss_sums.add_(parts)

    return update


CUDA_GRAPH_WARMUP = 3


def capture_cuda_graph(update, generator):
    """Record one update in a CUDA graph (sampling, forward, backward, Adam, Polyak) and return its replay.
    Warm-up runs on a side stream first, as torch.cuda.graphs requires; they are real updates."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(CUDA_GRAPH_WARMUP):
            update()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(generator)  # each replay draws a fresh batch
    with torch.cuda.graph(graph):
        update()
    return graph.replay


# ---------------------------------------------------------------------------------------------------------
# Per-depth evaluation: OGBench's 5 tasks, episodes side by side in a gymnasium vector env.
# ---------------------------------------------------------------------------------------------------------
class TaskResetWrapper(gymnasium.Wrapper):
    """Resets to task options['task_ids'][index], so the envs of one vector env can run different tasks."""

    def __init__(self, env, index):
        super().__init__(env)
        self.index = index

    def reset(self, *, seed=None, options=None):
        task_id = int(options["task_ids"][self.index])
        return self.env.reset(seed=seed, options=dict(task_id=task_id, render_goal=False))


def make_eval_env(env_name, index):
    return TaskResetWrapper(ogbench_data.make_eval_env(env_name), index)


def make_eval_vector_env(env_name, num_envs, async_envs=True):
    """num_envs OGBench evaluation envs; async_envs steps each in its own subprocess. Episodes never auto-reset:
    `rollout` resets each env itself with the task of its next episode."""
    env_fns = [partial(make_eval_env, env_name, i) for i in range(num_envs)]
    vector_env_class = gymnasium.vector.AsyncVectorEnv if async_envs else gymnasium.vector.SyncVectorEnv
    return vector_env_class(env_fns, autoreset_mode=gymnasium.vector.AutoresetMode.DISABLED)


def rollout(policy_fn, vector_env, task_ids=TASK_IDS, episodes=50, num_policies=1, seed=0, progress=False):
    """Run `episodes` episodes of every task for each of `num_policies` policies, side by side.

    policy_fn(obs, goal, policy_index) gets float32 arrays (n, obs_dim), (n, obs_dim) and the int array (n,)
    of the policy each row follows, and returns actions (n, action_dim) as an array or tensor. It is called
    once per vector step for all running episodes together. Each env takes the next waiting episode (its task
    set at reset) as soon as its current one ends, so no env idles while episodes wait. Episode j is reset with
    seed + j, whatever the number of envs. Success is the final info['success'] of an episode (OGBench's score).

    Returns success as an array (num_policies, len(task_ids), episodes).
    """
    jobs = [(p, t, e) for p in range(num_policies) for t in range(len(task_ids)) for e in range(episodes)]
    num_envs = vector_env.num_envs
    obs_dim = vector_env.single_observation_space.shape[0]
    action_dim = vector_env.single_action_space.shape[0]
    job_of = np.full(num_envs, -1)  # the job each env runs; -1: idle
    obs = np.zeros((num_envs, obs_dim), np.float32)
    goals = np.zeros((num_envs, obs_dim), np.float32)
    success = np.zeros(len(jobs))
    next_job = 0
    pbar = tqdm(total=len(jobs), desc="eval", disable=not progress, leave=False, dynamic_ncols=True)

    def start_next_jobs(envs_to_reset):
        """Reset the given envs into the next waiting jobs (idle envs get a placeholder episode to step)."""
        nonlocal next_job
        tasks, seeds = np.full(num_envs, task_ids[0]), [0] * num_envs
        for i in np.flatnonzero(envs_to_reset):
            if next_job < len(jobs):
                job_of[i], tasks[i], seeds[i] = next_job, task_ids[jobs[next_job][1]], seed + next_job
                next_job += 1
            else:
                job_of[i] = -1
        new_obs, info = vector_env.reset(seed=seeds, options={"reset_mask": envs_to_reset, "task_ids": tasks})
        obs[envs_to_reset] = new_obs[envs_to_reset]
        goals[envs_to_reset] = info["goal"][envs_to_reset]

    start_next_jobs(np.ones(num_envs, bool))
    policy_of_job = np.array([p for p, _, _ in jobs] or [0])
    while (job_of >= 0).any():
        running = job_of >= 0
        actions = np.zeros((num_envs, action_dim), np.float32)
        chosen = policy_fn(obs[running], goals[running], policy_of_job[job_of[running]])
        actions[running] = chosen.cpu().numpy() if torch.is_tensor(chosen) else np.asarray(chosen)
        new_obs, _, terminated, truncated, info = vector_env.step(actions)
        obs[:] = new_obs
        done = terminated | truncated
        for i in np.flatnonzero(done & running):
            success[job_of[i]] = float(info["success"][i])
            pbar.update(1)
        if done.any():
            start_next_jobs(done)
    pbar.close()
    return success.reshape(num_policies, len(task_ids), episodes)


def depth_policy_fn(actor, device):
    """A rollout policy_fn in which policy index i acts with the mean action of depth i + 1 (one forward pass
    computes every depth; each row keeps its own)."""

    @torch.no_grad()
    def policy_fn(obs, goal, policy_index):
        obs, goal = torch.as_tensor(obs, device=device), torch.as_tensor(goal, device=device)
        policies = actor.all_depths(obs, goal)  # (K, rows, 2, A)
        rows = torch.arange(obs.shape[0], device=device)
        return actor.act(policies[torch.as_tensor(policy_index, device=device), rows])

    return policy_fn


def evaluate(actor, vector_env, episodes, device, seed=0, progress=False):
    """Success of every depth 1..K on every task: eval/task_<t>/success_depth_<k>, and the mean over tasks
    eval/success_depth_<k>."""
    was_training = actor.training
    actor.eval()
    success = rollout(depth_policy_fn(actor, device), vector_env, TASK_IDS, episodes, actor.depth, seed, progress)
    actor.train(was_training)
    results = {}
    for k in range(1, actor.depth + 1):
        for t, task_id in enumerate(TASK_IDS):
            results[f"eval/task_{task_id}/success_depth_{k}"] = float(success[k - 1, t].mean())
        results[f"eval/success_depth_{k}"] = float(success[k - 1].mean())
    return results


def format_eval(results, depth, step):
    values = " ".join(f"{results[f'eval/success_depth_{k}']:.3f}" for k in range(1, depth + 1))
    return f"step {step} success by depth 1..{depth} (mean over tasks): {values}"


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (self-contained, atomic, weights_only) and metrics
# ---------------------------------------------------------------------------------------------------------
def save_checkpoint(path, payload):
    """Serialise in memory, write a temp file, then os.replace: a kill, a crash or a full disk never leaves a
    broken checkpoint or a stray temp file, and the previous checkpoint stays as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    buffer = io.BytesIO()
    torch.save(payload, buffer)  # in memory first: a full disk then fails in write() as an OSError, not deep in torch
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # also an interrupt mid-write: no half-written temp file stays behind
        tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        raise OSError(error.errno, f"could not write checkpoint {path} ({error}); the previous checkpoint is intact. "
                      "Free disk space or point --run-dir at a writable folder.") from error


def load_checkpoint(path, algorithm=ALGORITHM):
    """Load with weights_only=True (a checkpoint cannot run code) and check that it is ours."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # unpickling refused, truncated or not a torch file
        raise ValueError(f"{path} is not a loadable FlexLoop checkpoint: it is corrupt, truncated, not a checkpoint, "
                         f"or carries code that weights_only loading refuses ({type(error).__name__}: "
                         f"{str(error)[:200]})") from error
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a FlexLoop checkpoint (no '{CHECKPOINT_FORMAT}' format tag)")
    missing = [k for k in ("algorithm", "args", "env_id", "depth", "model") if k not in checkpoint]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}; it was not written by a FlexLoop script")
    if checkpoint["algorithm"] != algorithm:
        raise ValueError(f"checkpoint {path} is from {checkpoint['algorithm']!r}, not {algorithm!r}; "
                         f"use flexloop_{checkpoint['algorithm']}.py for it")
    return checkpoint


def build_agent(args: Args, device):
    spec = ogbench_data.get_spec(args.env_name)
    return GCIQLAgent(spec.obs_dim, spec.action_dim, args.depth, args.hidden_dim, args.iru_variant,
                      args.num_critics, args.backbone).to(device)


def network_from_checkpoint(checkpoint, device="cpu"):
    """Rebuild the policy network (the IRUActor) from a checkpoint alone (used by eval_adaptive.py)."""
    args = Args(**checkpoint["args"])
    agent = build_agent(args, device)
    agent.load_state_dict(checkpoint["model"])
    return agent.actor, args


def parses(line):
    """Whether a metrics.jsonl line is a whole JSON record: a kill mid-write can leave the last one cut short."""
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


class MetricsLog:
    """runs/<name>/metrics.jsonl, always; W&B too when tracked. On resume, records past the checkpoint's step
    (written by the run that was killed) are dropped, so the file has no duplicate or missing steps."""

    def __init__(self, path, resume_step=None, wandb_run=None):
        self.path, self.wandb_run = Path(path), wandb_run
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if parses(line) and json.loads(line)["global_step"] <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")

    def write(self, metrics, global_step):
        record = {"global_step": global_step, **{k: (v.item() if torch.is_tensor(v) else v) for k, v in metrics.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=global_step)
        return record


def rng_state(generators):
    state = {"python": random.getstate()[1], "numpy": np.random.get_state()[1].tolist(), "torch": torch.get_rng_state()}
    state.update({name: g.get_state() for name, g in generators.items()})
    return state


def set_rng_state(state, generators):
    random.setstate((3, tuple(state["python"]), None))
    np_state = np.random.get_state()
    np.random.set_state((np_state[0], np.array(state["numpy"], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    for name, g in generators.items():
        g.set_state(state[name])


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
def train(args: Args):
    check_args(args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    checkpoint = load_checkpoint(args.resume) if args.resume else None
    if checkpoint is not None:
        missing = [k for k in ("run_name", "target_model", "optimizer", "rng", "global_step") if k not in checkpoint]
        if missing:
            raise ValueError(f"--resume {args.resume} lacks {missing}, which resuming needs; start a new run from "
                             "its weights with --init-checkpoint instead")
        # A resumed run keeps its own flags; only the checkpoint path (and the data's location) come from the
        # command line.
        saved = Args(**checkpoint["args"])
        args = replace(saved, resume=args.resume, dataset_dir=args.dataset_dir or saved.dataset_dir,
                       dataset_path=args.dataset_path or saved.dataset_path)
    args = resolve_dataset_defaults(args)
    init = load_checkpoint(args.init_checkpoint) if args.init_checkpoint and checkpoint is None else None
    if init is not None:
        check_compatible(init, args)

    # The dataset first: a missing one fails here, before any run folder or network exists. It is data, not
    # state, so a resumed run simply reloads it.
    dataset = ogbench_data.load_dataset(args.env_name, dataset_dir=args.dataset_dir, dataset_path=args.dataset_path,
                                        device=device, download=args.download, gamma=args.gamma)

    run_name = checkpoint["run_name"] if checkpoint else \
        f"{args.env_name}__{args.exp_name}__{args.seed}__{int(time.time())}"
    # A resumed run continues in the folder its checkpoint lies in, wherever that folder has moved.
    run_dir = Path(args.resume).resolve().parent if checkpoint else Path(args.run_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    if not os.access(run_dir, os.W_OK):
        raise PermissionError(f"run folder {run_dir} is not writable; point --run-dir at a writable folder")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cuda.matmul.allow_tf32 = True
    generators = {"sample": torch.Generator(device).manual_seed(args.seed)}

    agent = build_agent(args, device)
    if init is not None:
        agent.load_state_dict(init["model"])
    target_critic = build_agent(args, device).critic
    target_critic.load_state_dict(init["target_model"] if init is not None else agent.critic.state_dict())
    target_critic.requires_grad_(False)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, capturable=on_cuda, fused=on_cuda)

    # Phases: IRU-K pretraining (lambda = 0) unless a pretrained network was given, then FlexLoop.
    phases = [] if init is not None else [("pretrain", args.pretrain_steps, 0.0)]
    phases.append(("flexloop", args.total_steps, args.lambda_depth))
    phases = [p for p in phases if p[1] > 0]
    total_updates = sum(p[1] for p in phases)
    global_step, last_metrics, wandb_id = 0, {}, None
    if checkpoint is not None:
        agent.load_state_dict(checkpoint["model"])
        target_critic.load_state_dict(checkpoint["target_model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        set_rng_state(checkpoint["rng"], generators)
        global_step = checkpoint["global_step"]
        last_metrics, wandb_id = checkpoint.get("metrics", {}), checkpoint.get("wandb_id")
        print(f"resuming {run_name} at update {global_step}/{total_updates}")

    wandb_run = None
    if args.track:
        import wandb
        wandb_run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, group=args.wandb_group,
                               tags=list(args.wandb_tags), config=asdict(args), name=run_name,
                               id=wandb_id, resume="allow", dir=str(run_dir))
        wandb_id = wandb_run.id
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", resume_step=global_step if checkpoint else None,
                             wandb_run=wandb_run)

    def phase_at(step):
        start = 0
        for name, length, lam in phases:
            if step < start + length:
                return name, lam
            start += length
        return phases[-1][0], phases[-1][2]

    def make_checkpoint():
        # Weights a NaN/inf has reached are never saved: the losses summed since the last log are checked first.
        check_finite(dict(zip(LOSS_NAMES, loss_sums)), global_step)
        return {"format": CHECKPOINT_FORMAT, "algorithm": ALGORITHM, "args": asdict(args), "env_id": args.env_name,
                "depth": args.depth, "run_name": run_name, "model": agent.state_dict(),
                "target_model": target_critic.state_dict(), "optimizer": optimizer.state_dict(),
                "updates": global_step, "global_step": global_step, "phase": phase_at(global_step)[0],
                "rng": rng_state(generators), "metrics": last_metrics, "wandb_id": wandb_id}

    lambda_depth = torch.zeros((), device=device)
    loss_sums = torch.zeros(len(LOSS_NAMES), device=device)  # summed on the device between logs
    update = make_update(agent, target_critic, optimizer, dataset, args, generators["sample"], lambda_depth,
                         loss_sums, compile_losses=args.compile and on_cuda)
    run_update = update
    eval_env = None  # the evaluation vector env, made at the first evaluation and kept
    pbar = tqdm(total=total_updates, initial=global_step, desc=run_name, dynamic_ncols=True)
    interrupted = []
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))  # SLURM preemption: save, then exit

    train_time, updates_since_log, tick, lambda_depth_now = 0.0, 0, time.time(), 0.0
    while global_step < total_updates:
        phase, lam = phase_at(global_step)
        if lam != lambda_depth_now:
            lambda_depth.fill_(lam)
            lambda_depth_now = lam
        if run_update is update and args.cuda_graph and on_cuda:
            run_update = capture_cuda_graph(update, generators["sample"])
            global_step += CUDA_GRAPH_WARMUP  # the capture's warm-up runs real updates
            updates_since_log += CUDA_GRAPH_WARMUP
        run_update()
        global_step += 1
        updates_since_log += 1
        phase_ends = phase_at(global_step)[0] != phase or global_step >= total_updates
        if global_step % 100 == 0 or phase_ends:
            pbar.update(global_step - pbar.n)

        if global_step % args.log_every == 0 or phase_ends:
            if on_cuda:
                torch.cuda.synchronize()
            train_time += time.time() - tick
            means = loss_sums / updates_since_log
            metrics = {"phase": phase, "charts/updates": global_step, "charts/lambda_depth": lam,
                       **dict(zip(LOSS_NAMES, means)),
                       "charts/SPS": int(updates_since_log / max(train_time, 1e-9))}  # updates/s, eval excluded
            check_finite(metrics, global_step)
            loss_sums.zero_()
            updates_since_log, train_time = 0, 0.0
            last_metrics = metrics_log.write(metrics, global_step)
            pbar.set_postfix(v=f"{last_metrics['losses/value_loss']:.3g}", q=f"{last_metrics['losses/critic_loss']:.3g}",
                             kl=f"{last_metrics['losses/depth_kl']:.3g}")
            tick = time.time()
        if args.eval_episodes > 0 and (global_step % args.eval_every == 0 or phase_ends):
            if on_cuda:
                torch.cuda.synchronize()
            train_time += time.time() - tick  # the clock of charts/SPS stops while evaluating
            if eval_env is None:
                eval_env = make_eval_vector_env(args.env_name, args.eval_envs, args.eval_async)
            results = evaluate(agent.actor, eval_env, args.eval_episodes, device, seed=args.seed + 1000)
            last_metrics.update(metrics_log.write({"phase": phase, **results}, global_step))
            pbar.write(format_eval(results, args.depth, global_step))
            tick = time.time()
        if phase == "pretrain" and phase_at(global_step)[0] != phase:
            save_checkpoint(run_dir / "pretrained.pt", make_checkpoint())  # the IRU-K baseline
        if global_step % args.save_every == 0 or global_step >= total_updates or interrupted:
            save_checkpoint(run_dir / "latest.pt", make_checkpoint())
        if interrupted:
            pbar.write(f"SIGTERM: saved {run_dir / 'latest.pt'} at update {global_step}; resume with "
                       f"--resume {run_dir / 'latest.pt'}")
            break
    pbar.close()
    if eval_env is not None:
        eval_env.close()
    if not interrupted:
        save_checkpoint(run_dir / "final.pt", make_checkpoint())
    metrics_log.file.close()
    if wandb_run is not None:
        wandb_run.finish()
    return run_dir


def check_compatible(init, args):
    """A pretrained checkpoint must match this run's dataset, depth and network shape."""
    theirs = {"backbone": "iru", **init["args"]}  # checkpoints from before --backbone hold IRUs
    for key in ["depth", "hidden_dim", "num_critics", "iru_variant", "backbone"]:
        if theirs[key] != getattr(args, key):
            raise ValueError(f"--init-checkpoint was trained with {key}={theirs[key]!r} but this run has "
                             f"{key}={getattr(args, key)!r}; pass --{key.replace('_', '-')} {theirs[key]}")
    if init["env_id"] != args.env_name:
        raise ValueError(f"--init-checkpoint was trained on {init['env_id']} but this run is on {args.env_name}; "
                         f"pass --env-name {init['env_id']}")


def check_finite(metrics, step):
    for name, value in metrics.items():
        if torch.is_tensor(value) and not torch.isfinite(value).all():
            raise FloatingPointError(f"{name} became {value.item()} in the updates before update {step}; "
                                     "stopping. The last checkpoint written (latest.pt) is from before this.")


if __name__ == "__main__":
    train(tyro.cli(Args))
