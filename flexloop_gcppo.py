"""FlexLoop post-training of an IRU GC-PPO on LightsOut-4x5 (one file, CleanRL style).

    python flexloop_gcppo.py                                           # pretrain IRU-5, then FlexLoop
    python flexloop_gcppo.py --init-checkpoint runs/X/pretrained.pt   # FlexLoop from a pretrained IRU-5

The actor and the critic share one IRU trunk. The loss is PPO's at the full depth K plus
    lambda_depth * mean_{k<K} KL(sg[pi_{k+1}] || pi_k)
on the minibatch states, where pi_k is the actor read out after k recurrent steps (REFERENCE.md §1, §3).
In the FlexLoop phase the value loss regresses V_K onto a frozen teacher's values V_teacher(s, g) instead of
the GAE returns; the policy loss keeps the GAE advantages from the student's own values. The teacher is the
--init-checkpoint model, or in a two-phase run (no --init-checkpoint) the pretrained model at the switch.
"""

import copy
import io
import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro
from tqdm.auto import tqdm

import envs
from envs.lightsout import NUM_LIGHTS, SPLITS

ALGORITHM = "gcppo"
CHECKPOINT_FORMAT = "flexloop-checkpoint-v1"


@dataclass
class Args:
    exp_name: str = "flexloop_gcppo"
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """use CUDA when it is available (see `require_cuda` to make its absence an error)"""
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
    """continue the run whose checkpoint is at this path (its run folder and W&B id are reused)"""
    init_checkpoint: Optional[str] = None
    """start FlexLoop post-training from this pretrained IRU-K checkpoint (skips pretraining; it is the teacher)"""

    # Environment
    env_id: str = "LightsOut-4x5-v0"
    """the env id (LightsOut-4x5-v0)"""
    max_episode_steps: int = 20
    """an episode ends on success or after this many steps"""
    train_max_presses: int = 9
    """largest minimal-solution length of training tasks (the reference's 9; lower it for an easier stream)"""

    # IRU actor-critic
    depth: int = 5
    """K, the number of recurrent steps of the IRU"""
    hidden_dim: int = 64
    """IRU width d"""
    iru_variant: Literal["residual", "paper"] = "residual"
    """residual: the public code (gates and heads read h = sum tanh(c)); paper: the paper's equation (tanh(c), c)"""
    backbone: Literal["iru", "lstm"] = "iru"
    """iru: the IRU cell; lstm: an LSTM cell unrolled over depth (the paper's backbone ablation, §5.4)"""

    # GC-PPO
    pretrain_timesteps: int = 50_000_000
    """IRU-K pretraining env steps (lambda = 0) when no --init-checkpoint is given"""
    total_timesteps: int = 50_000_000
    """FlexLoop post-training env steps"""
    learning_rate: float = 1e-4
    """Adam learning rate (constant)"""
    num_envs: int = 2048
    """parallel envs, stepped together on the device"""
    num_steps: int = 160
    """steps per env per rollout"""
    num_minibatches: int = 32
    """minibatches per update epoch"""
    update_epochs: int = 8
    """passes over each rollout"""
    gamma: float = 0.99
    """discount"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    norm_adv: bool = True
    """normalise the advantages (where: --advantage-norm)"""
    advantage_norm: Literal["minibatch", "rollout"] = "minibatch"
    """with --norm-adv: per minibatch (CleanRL; ours) or once over the whole rollout before the epochs
    (the authors' lightsout/ppo.py)"""
    minibatch_layout: Literal["rows", "time-rows"] = "rows"
    """rows: random (step, env) rows (CleanRL; ours); time-rows: whole time steps of all envs, num_steps /
    num_minibatches steps per minibatch, reshuffled every epoch (the authors' code: 5 steps x 2048 envs)"""
    obs_norm_update: Literal["after-epochs", "before-epochs"] = "after-epochs"
    """when the running obs normaliser takes in a rollout: after its update epochs (ours: each update's first
    ratio is exactly 1), or before them and before the bootstrap values of GAE (the authors' code)"""
    timeout_bootstrap: Literal["value", "zero"] = "value"
    """a step truncated at max_episode_steps bootstraps from V(final obs) (ours; the value cannot see the clock),
    or from 0, as at a success (the authors' code in effect: its auto-reset wrapper replaces the state's info with
    the reset's, so the `truncation` flag its GAE reads is always 0 and a time-out counts as a termination)"""
    hard_reset_every: int = 0
    """every this many iterations, reset every env to a fresh task, cutting the episodes in flight; the obs
    normaliser is kept (0: never, ours; the authors' code: 3, from num_reset_steps = 50 over 152 iterations)"""
    clip_coef: float = 0.3
    """PPO's surrogate clipping coefficient (also clips the value change when clip_vloss)"""
    clip_vloss: bool = True
    """clipped value loss (CleanRL's default)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient (CleanRL's default; REFERENCE.md gives none)"""
    max_grad_norm: float = 0.5
    """gradient clipping norm (CleanRL's default; REFERENCE.md gives none)"""
    obs_clip: float = 10.0
    """normalised inputs are clipped to [-obs_clip, obs_clip]"""

    # FlexLoop
    lambda_depth: float = 0.05
    """weight of the adjacent-depth KL (0 = plain IRU-K training)"""
    depth_target: Literal["adjacent", "final"] = "adjacent"
    """adjacent: KL(sg[pi_{k+1}] || pi_k) (FlexLoop); final: every depth distilled from depth K, KL(sg[pi_K] || pi_k)"""
    teacher_value_targets: bool = True
    """in the FlexLoop phase, regress V_K onto the frozen teacher's values instead of the GAE returns (paper)"""

    # Evaluation, logging, speed
    eval_every: int = 10
    """evaluate every depth on both splits every this many iterations (and at the end of each phase)"""
    num_eval_envs: int = 128
    """envs per split for evaluation (one deterministic episode each, the same tasks at every depth)"""
    log_every: int = 1
    """log training metrics every this many iterations"""
    save_every: int = 10
    """write the latest checkpoint every this many iterations"""
    compile: bool = False
    """torch.compile the minibatch update"""
    cuda_graph: bool = False
    """capture the minibatch update in a CUDA graph and replay it (GPU only)"""


def check_args(args: Args):
    """Refuse bad flags before any work starts, naming the fix."""
    if args.depth < 2:
        raise ValueError(f"--depth must be at least 2 for FlexLoop's adjacent-depth loss, got {args.depth}")
    if args.lambda_depth < 0:
        raise ValueError(f"--lambda-depth must be >= 0, got {args.lambda_depth}")
    if args.env_id != envs.LIGHTSOUT_ID:
        raise ValueError(f"--env-id {args.env_id!r} is not supported; GC-PPO runs on {envs.LIGHTSOUT_ID}")
    for name in ["num_envs", "num_steps", "num_minibatches", "update_epochs", "hidden_dim", "num_eval_envs",
                 "eval_every", "log_every", "save_every", "max_episode_steps", "learning_rate", "clip_coef"]:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    low, high = SPLITS["train"]
    if not low <= args.train_max_presses <= high:
        raise ValueError(f"--train-max-presses must lie in [{low}, {high}], got {args.train_max_presses}")
    batch_size = args.num_envs * args.num_steps
    if batch_size % args.num_minibatches:
        raise ValueError(f"--num-minibatches {args.num_minibatches} does not divide the rollout of num_envs x "
                         f"num_steps = {batch_size} steps; pick a divisor or change --num-envs/--num-steps")
    if batch_size // args.num_minibatches < 2:
        raise ValueError(f"minibatches of {batch_size // args.num_minibatches} step(s) are too small to normalise "
                         "advantages; lower --num-minibatches")
    for name in ["pretrain_timesteps", "total_timesteps"]:
        steps = getattr(args, name)
        if steps < 0 or 0 < steps < batch_size:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 or at least one rollout "
                             f"(num_envs x num_steps = {batch_size}), got {steps}")
    if args.minibatch_layout == "time-rows" and args.num_steps % args.num_minibatches:
        raise ValueError(f"--minibatch-layout time-rows needs --num-minibatches {args.num_minibatches} to divide "
                         f"--num-steps {args.num_steps} (whole time steps per minibatch); pick a divisor")
    if args.hard_reset_every < 0:
        raise ValueError(f"--hard-reset-every must be 0 (never) or positive, got {args.hard_reset_every}")
    if args.pretrain_timesteps == 0 and args.total_timesteps == 0:
        raise ValueError("both --pretrain-timesteps and --total-timesteps are 0: nothing to train")
    if args.init_checkpoint is None and args.pretrain_timesteps == 0 and not args.resume:
        raise ValueError("FlexLoop post-training needs a pretrained IRU-K: pass --init-checkpoint PATH or a "
                         "positive --pretrain-timesteps")
    if args.require_cuda and not torch.cuda.is_available():
        raise RuntimeError("--require-cuda was given but no CUDA GPU is visible; drop the flag or use --no-cuda")
    if args.cuda_graph and not (args.cuda and torch.cuda.is_available()):
        raise ValueError("--cuda-graph needs a CUDA GPU; drop the flag on CPU")
    if args.resume and args.init_checkpoint:
        raise ValueError("give either --resume (continue a run) or --init-checkpoint (start post-training), not both")
    if args.backbone == "lstm" and args.iru_variant != "residual":
        raise ValueError("--iru-variant applies to the IRU backbone only; drop it with --backbone lstm")


# ---------------------------------------------------------------------------------------------------------
# IRU actor-critic: one IRU trunk, an actor head and a value head read out at every depth.
# ---------------------------------------------------------------------------------------------------------
class IRUActorCritic(nn.Module):
    """pi_k(a | s, g) and V_k(s, g) read out after each of K recurrent steps of one shared IRU.

        x     = clip((concat[obs, goal] - running mean) / running std)     (40 inputs)
        x_emb = LayerNorm(Linear(x))
        z     = LayerNorm(concat[x_emb, h])            (paper variant: concat[x_emb, tanh(c)])
        f     = sigmoid(Linear_forget(z)),  i = tanh(Linear_input(z))
        c     = f * c + (1 - f) * i
        h     = h + tanh(c)                              (residual across steps)
        logits_k = Actor(h),  V_k = Value(h)             (paper variant: read c)

    The running mean and variance of the inputs are buffers, so checkpoints and evaluation carry them.

    Depth protocol (shared with the other scripts and eval_adaptive.py):
        state = start(obs, goal)          depth 0, zero recurrent state
        state = advance(state)            depth k -> k + 1
        logits = decide(state)            pi_k's logits (20)
        all_depths(obs, goal)             logits (K, B, 20) and values (K, B) of every depth at once
        divergence(p_logits, q_logits)    KL(p || q) per row: the training loss and delta_k at inference
        gather(state, rows)               the recurrent state of some batch rows (adaptive inference)
        act(logits, generator, deterministic=False)   a sample of pi_k, or its mode (evaluation)
    The state is a tuple of tensors shaped (batch, d).
    """

    def __init__(self, depth=5, hidden_dim=64, variant="residual", obs_clip=10.0, input_dim=2 * NUM_LIGHTS,
                 num_actions=NUM_LIGHTS):
        super().__init__()
        self.depth, self.hidden_dim, self.variant, self.obs_clip = depth, hidden_dim, variant, obs_clip
        self.register_buffer("obs_mean", torch.zeros(input_dim))
        self.register_buffer("obs_var", torch.ones(input_dim))
        self.register_buffer("obs_count", torch.tensor(1e-4))  # CleanRL's RunningMeanStd starts at 1e-4
        self.embed = nn.Linear(input_dim, hidden_dim)
        self.embed_norm = nn.LayerNorm(hidden_dim)
        self.gate_norm = nn.LayerNorm(2 * hidden_dim)
        self.gates = nn.Linear(2 * hidden_dim, 2 * hidden_dim)  # forget and input gates, one matmul
        with torch.no_grad():
            self.gates.bias[:hidden_dim] = 1.0  # forget-gate bias +1: remember by default
        self.actor = nn.Linear(hidden_dim, num_actions)
        self.critic = nn.Linear(hidden_dim, 1)
        # CleanRL's PPO head init: a near-uniform first policy, a unit-scale value.
        nn.init.orthogonal_(self.actor.weight, 0.01)
        nn.init.zeros_(self.actor.bias)
        nn.init.orthogonal_(self.critic.weight, 1.0)
        nn.init.zeros_(self.critic.bias)

    def normalize(self, obs, goal):
        x = torch.cat([obs, goal], -1).float()
        return ((x - self.obs_mean) / torch.sqrt(self.obs_var + 1e-8)).clamp(-self.obs_clip, self.obs_clip)

    @torch.no_grad()
    def update_normalizer(self, obs, goal):
        """Fold a batch of raw inputs into the running mean and variance (Chan et al.'s parallel update)."""
        x = torch.cat([obs, goal], -1).float()
        batch_count = x.shape[0]
        batch_mean, batch_var = x.mean(0), x.var(0, unbiased=False)
        total = self.obs_count + batch_count
        delta = batch_mean - self.obs_mean
        m2 = self.obs_var * self.obs_count + batch_var * batch_count + delta ** 2 * self.obs_count * batch_count / total
        self.obs_mean.add_(delta * batch_count / total)
        self.obs_var.copy_(m2 / total)
        self.obs_count.copy_(total)

    def start(self, obs, goal):
        x_emb = self.embed_norm(self.embed(self.normalize(obs, goal)))
        zeros = torch.zeros_like(x_emb)
        return x_emb, zeros, zeros  # (x_emb, c, h)

    def advance(self, state):
        x_emb, c, h = state
        carried = h if self.variant == "residual" else torch.tanh(c)
        z = self.gate_norm(torch.cat([x_emb, carried], -1))
        forget_logits, input_logits = self.gates(z).chunk(2, -1)
        forget, candidate = torch.sigmoid(forget_logits), torch.tanh(input_logits)
        c = forget * c + (1 - forget) * candidate
        h = h + torch.tanh(c)
        return x_emb, c, h

    def readout(self, state):
        _, c, h = state
        return h if self.variant == "residual" else c

    def decide(self, state):
        return self.actor(self.readout(state))

    def value(self, state):
        return self.critic(self.readout(state)).squeeze(-1)

    def full_depth(self, obs, goal):
        """Logits and value at depth K."""
        state = self.start(obs, goal)
        for _ in range(self.depth):
            state = self.advance(state)
        return self.decide(state), self.value(state)

    def all_depths(self, obs, goal):
        state = self.start(obs, goal)
        logits, values = [], []
        for _ in range(self.depth):
            state = self.advance(state)
            logits.append(self.decide(state))
            values.append(self.value(state))
        return torch.stack(logits), torch.stack(values)  # (K, B, A), (K, B)

    @staticmethod
    def divergence(p_logits, q_logits):
        """KL(p || q) between the categorical policies softmax(p_logits) and softmax(q_logits), per row."""
        p_log = F.log_softmax(p_logits, -1)
        return (p_log.exp() * (p_log - F.log_softmax(q_logits, -1))).sum(-1)

    @staticmethod
    def gather(state, rows):
        return tuple(t[rows] for t in state)

    @staticmethod
    def act(logits, generator=None, deterministic=False):
        """A sample of softmax(logits) (Gumbel-max, no host sync), or its mode when deterministic."""
        if deterministic:
            return logits.argmax(-1)
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(1e-12, 1.0)
        return (logits - torch.log(-torch.log(uniform))).argmax(-1)


class LSTMActorCritic(IRUActorCritic):
    """The same actor-critic with an LSTM cell in place of the IRU cell, unrolled over depth for a fixed input:

        i, f, g, o = Linear(concat[x_emb, h])            (forget-gate bias initialised to +1)
        c = sigmoid(f) * c + sigmoid(i) * tanh(g),   h = sigmoid(o) * tanh(c),   heads read h

    The input pipeline, the heads, the state (x_emb, c, h) and the depth protocol are the IRU's."""

    def __init__(self, depth=5, hidden_dim=64, obs_clip=10.0, input_dim=2 * NUM_LIGHTS, num_actions=NUM_LIGHTS):
        # variant "residual": the inherited readout is h, the LSTM's output
        super().__init__(depth, hidden_dim, "residual", obs_clip, input_dim, num_actions)
        del self.gate_norm  # a plain LSTM cell: no normalisation inside
        self.gates = nn.Linear(2 * hidden_dim, 4 * hidden_dim)  # input, forget, cell, output
        with torch.no_grad():
            self.gates.bias[hidden_dim:2 * hidden_dim] = 1.0

    def advance(self, state):
        x_emb, c, h = state
        input_gate, forget_gate, cell, output_gate = self.gates(torch.cat([x_emb, h], -1)).chunk(4, -1)
        c = torch.sigmoid(forget_gate) * c + torch.sigmoid(input_gate) * torch.tanh(cell)
        h = torch.sigmoid(output_gate) * torch.tanh(c)
        return x_emb, c, h


# ---------------------------------------------------------------------------------------------------------
# Losses: GAE, PPO at depth K, and FlexLoop's adjacent-depth KL.
# ---------------------------------------------------------------------------------------------------------
def compute_gae(rewards, values, terminated, truncated, final_values, next_value, gamma, gae_lambda):
    """Advantages and returns of a rollout, all (T, N) except next_value (N,) = V(obs after the last step).

    An episode that ends at step t cuts the recursion there. Its bootstrap value is 0 when it terminated
    (success) and V(final_obs) when it was truncated by the step limit, since the value cannot see the clock.
    Otherwise the bootstrap is the value of the next step's state, which is the same episode's."""
    num_steps = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    last_advantage = torch.zeros_like(next_value)
    for t in reversed(range(num_steps)):
        done = terminated[t] | truncated[t]
        following_value = next_value if t == num_steps - 1 else values[t + 1]
        bootstrap = torch.where(done, truncated[t] * final_values[t], following_value)
        delta = rewards[t] + gamma * bootstrap - values[t]
        last_advantage = delta + gamma * gae_lambda * (~done) * last_advantage
        advantages[t] = last_advantage
    return advantages, advantages + values


def ppo_loss(logits, values, actions, old_logprobs, old_values, advantages, value_targets, clip_coef,
             clip_vloss=True, norm_adv=True):
    """CleanRL's PPO losses for one minibatch at depth K: (policy loss, value loss, entropy, approx KL, clipfrac)."""
    log_probs = F.log_softmax(logits, -1)
    new_logprobs = log_probs.gather(-1, actions[:, None]).squeeze(-1)
    log_ratio = new_logprobs - old_logprobs
    ratio = log_ratio.exp()
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    if clip_vloss:
        clipped_values = old_values + (values - old_values).clamp(-clip_coef, clip_coef)
        value_loss = 0.5 * torch.max((values - value_targets) ** 2, (clipped_values - value_targets) ** 2).mean()
    else:
        value_loss = 0.5 * ((values - value_targets) ** 2).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1).abs() > clip_coef).float().mean()
    return policy_loss, value_loss, entropy, approx_kl, clipfrac


def flexloop_depth_loss(logits_per_depth, target="adjacent"):
    """mean_{k=1..K-1} KL(sg[pi_{k+1}] || pi_k) from logits (K, B, A); with target="final",
    mean_{k=1..K-1} KL(sg[pi_K] || pi_k) instead.

    The deeper policy is the target (detached), so only the shallower depth moves towards it."""
    deeper = logits_per_depth[1:] if target == "adjacent" else logits_per_depth[-1:].expand_as(logits_per_depth[:-1])
    kl = IRUActorCritic.divergence(deeper.detach(), logits_per_depth[:-1])  # (K-1, B)
    return kl.mean()


# ---------------------------------------------------------------------------------------------------------
# Rollouts and per-depth evaluation
# ---------------------------------------------------------------------------------------------------------
def make_rollout_buffers(num_steps, num_envs, device):
    """(T, N, ...) tensors, allocated once so a captured update can read them."""
    lights = lambda: torch.zeros(num_steps, num_envs, NUM_LIGHTS, device=device)  # noqa: E731
    steps = lambda dtype=torch.float32: torch.zeros(num_steps, num_envs, dtype=dtype, device=device)  # noqa: E731
    return dict(obs=lights(), goal=lights(), final_obs=lights(), final_goal=lights(), actions=steps(torch.long),
                logprobs=steps(), values=steps(), rewards=steps(), terminated=steps(torch.bool),
                truncated=steps(torch.bool), advantages=steps(), value_targets=steps())


def epoch_order(layout, num_steps, num_envs, generator, device):
    """One epoch's order of the flattened (T * N) rollout rows (row t * N + n is step t of env n); consecutive
    slices of it are the minibatches. rows: a random permutation of all rows. time-rows: a random permutation
    of the time steps, each step's N rows kept together, so a minibatch holds whole time steps of every env."""
    if layout == "rows":
        return torch.randperm(num_steps * num_envs, generator=generator, device=device)
    steps = torch.randperm(num_steps, generator=generator, device=device)
    return (steps[:, None] * num_envs + torch.arange(num_envs, device=device)).flatten()


@torch.no_grad()
def collect_rollout(network, env, obs, buffers, generator, episode_sums):
    """num_steps steps of every env with the depth-K policy, written into buffers. Continues from obs (the
    envs auto-reset) and returns the obs after the last step. episode_sums (4,) gathers the finished episodes'
    count, successes, returns and lengths on the device."""
    for t in range(buffers["obs"].shape[0]):
        buffers["obs"][t], buffers["goal"][t] = obs["observation"], obs["desired_goal"]
        logits, value = network.full_depth(obs["observation"], obs["desired_goal"])
        action = network.act(logits, generator)
        buffers["actions"][t] = action
        buffers["logprobs"][t] = F.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1)
        buffers["values"][t] = value
        obs, reward, terminated, truncated, info = env.step(action)
        buffers["rewards"][t], buffers["terminated"][t], buffers["truncated"][t] = reward, terminated, truncated
        buffers["final_obs"][t] = info["final_obs"]["observation"]
        buffers["final_goal"][t] = info["final_obs"]["desired_goal"]
        done = info["episode_done"].float()
        episode_sums += torch.stack([done.sum(), (done * info["episode_success"]).sum(),
                                     (done * info["episode_return"]).sum(), (done * info["episode_length"]).sum()])
    return obs


@torch.no_grad()
def evaluate(network, eval_envs, seed):
    """Deterministic (argmax) success at every depth 1..K on each split: one episode per env, on the same
    tasks at every depth (the env is reseeded), as device tensors."""
    results = {}
    for i, (split, env) in enumerate(eval_envs.items()):
        for depth in range(1, network.depth + 1):
            obs, _ = env.reset(seed=seed + i)
            alive = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
            success = torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
            for _ in range(env.max_steps):
                state = network.start(obs["observation"], obs["desired_goal"])
                for _ in range(depth):
                    state = network.advance(state)
                obs, _, terminated, truncated, _ = env.step(network.act(network.decide(state), deterministic=True))
                success |= alive & terminated
                alive &= ~(terminated | truncated)
            results[f"eval/{split}/success_depth_{depth}"] = success.float().mean()
    return results


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


def build_network(args: Args, device):
    if args.backbone == "lstm":
        return LSTMActorCritic(args.depth, args.hidden_dim, args.obs_clip).to(device)
    return IRUActorCritic(args.depth, args.hidden_dim, args.iru_variant, args.obs_clip).to(device)


def frozen_copy(network):
    """The teacher: a copy that no optimiser or normaliser update touches."""
    return copy.deepcopy(network).requires_grad_(False).eval()


def network_from_checkpoint(checkpoint, device="cpu"):
    """Rebuild the network (its observation normaliser included) from a checkpoint alone."""
    args = Args(**checkpoint["args"])
    network = build_network(args, device)
    network.load_state_dict(checkpoint["model"])
    return network, args


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
def make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums):
    """One minibatch update: the rows minibatch_index of the rollout, PPO at depth K + lambda * adjacent-depth
    KL, gradient clipping, Adam. No host sync, fixed shapes: it can be captured in a CUDA graph."""
    flat = {name: tensor.flatten(0, 1) for name, tensor in buffers.items()}  # views: (T * N, ...)

    def update():
        rows = minibatch_index
        logits, values = network.all_depths(flat["obs"][rows], flat["goal"][rows])  # (K, B, A), (K, B)
        policy_loss, value_loss, entropy, approx_kl, clipfrac = ppo_loss(
            logits[-1], values[-1], flat["actions"][rows], flat["logprobs"][rows], flat["values"][rows],
            flat["advantages"][rows], flat["value_targets"][rows], args.clip_coef, args.clip_vloss,
            args.norm_adv and args.advantage_norm == "minibatch")
        depth_loss = flexloop_depth_loss(logits, args.depth_target)
        loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss + lambda_depth * depth_loss
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        nn.utils.clip_grad_norm_(network.parameters(), args.max_grad_norm)
        optimizer.step()
        loss_sums.add_(torch.stack([policy_loss, value_loss, entropy, depth_loss, approx_kl, clipfrac]).detach())

    return update


@torch.no_grad()
def prepare_targets(network, teacher, buffers, next_obs, args):
    """After a rollout: GAE advantages from the student's own values, and the value loss's targets, which are
    the GAE returns, or V_teacher(s, g) at depth K when a teacher is given. Written into buffers."""
    flat = lambda name: buffers[name].flatten(0, 1)  # noqa: E731
    shape = buffers["values"].shape
    if args.timeout_bootstrap == "value":
        final_values = network.full_depth(flat("final_obs"), flat("final_goal"))[1].view(shape)
    else:  # a time-out ends the episode as a success does: nothing to bootstrap from
        final_values = torch.zeros_like(buffers["values"])
    next_value = network.full_depth(next_obs["observation"], next_obs["desired_goal"])[1]
    advantages, returns = compute_gae(buffers["rewards"], buffers["values"], buffers["terminated"],
                                      buffers["truncated"], final_values, next_value, args.gamma, args.gae_lambda)
    if args.norm_adv and args.advantage_norm == "rollout":  # once here, so the minibatches see the same scale
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    buffers["advantages"].copy_(advantages)
    if teacher is None:
        buffers["value_targets"].copy_(returns)
    else:
        buffers["value_targets"].copy_(teacher.full_depth(flat("obs"), flat("goal"))[1].view(shape))


def train(args: Args):
    check_args(args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    checkpoint = load_checkpoint(args.resume) if args.resume else None
    if checkpoint is not None:
        missing = [k for k in ("run_name", "teacher_model", "optimizer", "rng", "interval", "updates", "global_step")
                   if k not in checkpoint]
        if missing:
            raise ValueError(f"--resume {args.resume} lacks {missing}, which resuming needs; start a new run from "
                             "its weights with --init-checkpoint instead")
        # A resumed run keeps its own flags: only the checkpoint path comes from the command line.
        resume_path, args = args.resume, Args(**checkpoint["args"])
        args.resume = resume_path
    init = load_checkpoint(args.init_checkpoint) if args.init_checkpoint and checkpoint is None else None
    if init is not None:
        check_compatible(init, args)

    run_name = checkpoint["run_name"] if checkpoint else \
        f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
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

    # Envs: one for collection, one per split for evaluation (reseeded at each evaluation: fixed task sets).
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=args.seed, split="train",
                        max_steps=args.max_episode_steps, max_presses=args.train_max_presses,
                        check_actions=False).unwrapped
    eval_envs = {split: envs.make_vec(args.env_id, args.num_eval_envs, device=device, split=split,
                                      max_steps=args.max_episode_steps, check_actions=False).unwrapped
                 for split in ["train", "unseen"]}
    eval_seed = args.seed + 1000
    generators = {"actions": torch.Generator(device).manual_seed(args.seed),
                  "minibatch": torch.Generator(device).manual_seed(args.seed + 1),
                  "env": env.generator}

    network = build_network(args, device)
    if init is not None:
        network.load_state_dict(init["model"])
    teacher = frozen_copy(network) if init is not None else None
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, eps=1e-5,
                                 capturable=device.type == "cuda")
    buffers = make_rollout_buffers(args.num_steps, args.num_envs, device)
    batch_size = args.num_envs * args.num_steps
    minibatch_size = batch_size // args.num_minibatches

    # Phases: IRU-K pretraining (lambda = 0, GAE value targets) unless a pretrained network was given, then
    # FlexLoop. Budgets are whole rollouts.
    phases = [] if init is not None else [("pretrain", args.pretrain_timesteps // batch_size, 0.0)]
    phases.append(("flexloop", args.total_timesteps // batch_size, args.lambda_depth))
    phases = [p for p in phases if p[1] > 0]
    total_iterations = sum(p[1] for p in phases)
    iteration, updates, global_step, last_metrics, wandb_id = 0, 0, 0, {}, None
    if checkpoint is not None:
        network.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        if checkpoint["teacher_model"] is not None:
            teacher = frozen_copy(network)
            teacher.load_state_dict(checkpoint["teacher_model"])
        set_rng_state(checkpoint["rng"], generators)
        iteration, updates, global_step = checkpoint["interval"], checkpoint["updates"], checkpoint["global_step"]
        last_metrics, wandb_id = checkpoint.get("metrics", {}), checkpoint.get("wandb_id")
        print(f"resuming {run_name} at iteration {iteration}/{total_iterations} (the envs restart their episodes)")

    wandb_run = None
    if args.track:
        import wandb
        wandb_run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, group=args.wandb_group,
                               tags=list(args.wandb_tags), config=asdict(args), name=run_name,
                               id=wandb_id, resume="allow", dir=str(run_dir))
        wandb_id = wandb_run.id
    metrics_log = MetricsLog(run_dir / "metrics.jsonl", resume_step=global_step if checkpoint else None,
                             wandb_run=wandb_run)

    def phase_at(i):
        start = 0
        for name, length, lam in phases:
            if i < start + length:
                return name, lam
            start += length
        return phases[-1][0], phases[-1][2]

    def make_checkpoint():
        # Weights a NaN/inf has reached are never saved: the losses summed since the last log are checked first.
        check_finite(dict(zip(["losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/depth_kl"],
                              loss_sums)), updates)
        # "interval" is the project's name for one collect + update round: here a PPO iteration.
        return {"format": CHECKPOINT_FORMAT, "algorithm": ALGORITHM, "args": asdict(args), "env_id": args.env_id,
                "depth": args.depth, "run_name": run_name, "model": network.state_dict(),
                "teacher_model": None if teacher is None else teacher.state_dict(),
                "optimizer": optimizer.state_dict(), "interval": iteration, "updates": updates,
                "global_step": global_step, "phase": phase_at(iteration)[0], "rng": rng_state(generators),
                "metrics": last_metrics, "wandb_id": wandb_id}

    lambda_depth = torch.zeros((), device=device)  # a tensor, so one captured graph serves both phases
    minibatch_index = torch.zeros(minibatch_size, dtype=torch.long, device=device)
    # policy, value, entropy, depth KL, approx KL, clipfrac: summed on the device between logs
    loss_sums = torch.zeros(6, device=device)
    episode_sums = torch.zeros(4, device=device)  # finished episodes: count, successes, returns, lengths
    update = make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums)
    if args.compile:
        update = torch.compile(update)
    run_update = update
    pbar = tqdm(total=total_iterations, initial=iteration, desc=run_name, dynamic_ncols=True)
    interrupted = []
    signal.signal(signal.SIGTERM, lambda *_: interrupted.append(True))  # SLURM preemption: save, then exit

    obs, _ = env.reset()
    start_time, start_step, updates_since_log = time.time(), global_step, 0
    while iteration < total_iterations:
        phase, lam = phase_at(iteration)
        if phase == "flexloop" and teacher is None:
            teacher = frozen_copy(network)  # two-phase run: the pretrained model at the switch
        lambda_depth.fill_(lam)
        network.train()
        obs = collect_rollout(network, env, obs, buffers, generators["actions"], episode_sums)
        global_step += batch_size
        if args.obs_norm_update == "before-epochs":  # the authors' order: GAE and the epochs see this rollout's stats
            network.update_normalizer(buffers["obs"].flatten(0, 1), buffers["goal"].flatten(0, 1))
        use_teacher = phase == "flexloop" and args.teacher_value_targets
        prepare_targets(network, teacher if use_teacher else None, buffers, obs, args)

        if run_update is update and args.cuda_graph:
            minibatch_index.copy_(torch.randperm(batch_size, generator=generators["minibatch"],
                                                 device=device)[:minibatch_size])
            run_update = capture_cuda_graph(update)
            updates += CUDA_GRAPH_WARMUP  # the capture's warm-up runs real updates
            updates_since_log += CUDA_GRAPH_WARMUP
        for _ in range(args.update_epochs):
            permutation = epoch_order(args.minibatch_layout, args.num_steps, args.num_envs, generators["minibatch"],
                                      device)
            for start in range(0, batch_size, minibatch_size):
                minibatch_index.copy_(permutation[start:start + minibatch_size])
                run_update()
        updates += args.update_epochs * args.num_minibatches
        updates_since_log += args.update_epochs * args.num_minibatches
        if args.obs_norm_update == "after-epochs":  # ours: the rollout's own ratios start at exactly 1
            network.update_normalizer(buffers["obs"].flatten(0, 1), buffers["goal"].flatten(0, 1))
        iteration += 1
        pbar.update(1)
        if args.hard_reset_every and iteration % args.hard_reset_every == 0:
            obs, _ = env.reset()  # fresh tasks for all envs; GAE above already bootstrapped from the old obs

        if iteration % args.log_every == 0 or iteration == total_iterations:
            losses = loss_sums / updates_since_log
            episodes = episode_sums[0].clamp(min=1)
            targets, values = buffers["value_targets"], buffers["values"]
            metrics = {"phase": phase, "charts/iteration": iteration, "charts/updates": updates,
                       "charts/learning_rate": args.learning_rate, "charts/lambda_depth": lam,
                       "losses/policy_loss": losses[0], "losses/value_loss": losses[1], "losses/entropy": losses[2],
                       "losses/depth_kl": losses[3], "losses/approx_kl": losses[4], "losses/clipfrac": losses[5],
                       "losses/explained_variance": 1 - (targets - values).var() / targets.var(),
                       "charts/episodes": episode_sums[0], "charts/train_success": episode_sums[1] / episodes,
                       "charts/episodic_return": episode_sums[2] / episodes,
                       "charts/episodic_length": episode_sums[3] / episodes,
                       "charts/SPS": int((global_step - start_step) / (time.time() - start_time))}
            check_finite(metrics, updates)
            last_metrics = metrics_log.write(metrics, global_step)
            loss_sums.zero_()
            episode_sums.zero_()
            updates_since_log = 0
            pbar.set_postfix(success=f"{last_metrics['charts/train_success']:.3f}",
                             kl=f"{last_metrics['losses/depth_kl']:.3g}")
        if iteration % args.eval_every == 0 or iteration == total_iterations or phase_at(iteration)[0] != phase:
            network.eval()
            results = metrics_log.write({"phase": phase, **evaluate(network, eval_envs, eval_seed)}, global_step)
            last_metrics.update(results)
            pbar.write(format_eval(results, args.depth, iteration))
        if phase == "pretrain" and phase_at(iteration)[0] != phase:
            save_checkpoint(run_dir / "pretrained.pt", make_checkpoint())  # the IRU-K baseline
        if iteration % args.save_every == 0 or iteration == total_iterations or interrupted:
            save_checkpoint(run_dir / "latest.pt", make_checkpoint())
        if interrupted:
            pbar.write(f"SIGTERM: saved {run_dir / 'latest.pt'} at iteration {iteration}; resume with "
                       f"--resume {run_dir / 'latest.pt'}")
            break
    pbar.close()
    if not interrupted:
        save_checkpoint(run_dir / "final.pt", make_checkpoint())
    metrics_log.file.close()
    if wandb_run is not None:
        wandb_run.finish()
    return run_dir


def check_compatible(init, args):
    """A pretrained checkpoint must match this run's env and network shape."""
    theirs = {"backbone": "iru", **init["args"]}  # checkpoints from before --backbone hold IRUs
    for key in ["depth", "hidden_dim", "iru_variant", "backbone"]:
        if theirs[key] != getattr(args, key):
            raise ValueError(f"--init-checkpoint was trained with {key}={theirs[key]!r} but this run has "
                             f"{key}={getattr(args, key)!r}; pass --{key.replace('_', '-')} {theirs[key]}")
    if init["env_id"] != args.env_id:
        raise ValueError(f"--init-checkpoint was trained on {init['env_id']} but this run is on {args.env_id}; "
                         f"pass --env-id {init['env_id']}")


def check_finite(metrics, updates):
    for name in ["losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/depth_kl"]:
        value = metrics[name]
        if not torch.isfinite(value).all():
            raise FloatingPointError(f"{name} became {value.item()} in the updates before update {updates}; "
                                     "stopping. The last checkpoint written (latest.pt) is from before this.")


def format_eval(results, depth, iteration):
    lines = [f"iteration {iteration} success by depth 1..{depth}:"]
    for split in ["train", "unseen"]:
        values = " ".join(f"{results[f'eval/{split}/success_depth_{k}']:.3f}" for k in range(1, depth + 1))
        lines.append(f"  {split:7s} {values}")
    return "\n".join(lines)


CUDA_GRAPH_WARMUP = 3


def capture_cuda_graph(update):
    """Record one minibatch update in a CUDA graph (forward, backward, clipping, Adam) and return its replay.
    Warm-up runs on a side stream first, as torch.cuda.graphs requires."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(CUDA_GRAPH_WARMUP):
            update()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        update()
    return graph.replay


if __name__ == "__main__":
    train(tyro.cli(Args))
