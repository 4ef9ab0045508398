"""FlexLoop post-training of IRU GC-IQL on an OGBench dataset (offline; one file, CleanRL style):
    python -m envs.ogbench_data generate --env pointmaze-large-stitch-v0 --out ~/.ogbench/data   # or download
    python flexloop_gciql.py --env-name pointmaze-large-stitch-v0                  # pretrain IRU-5, then FlexLoop
    python flexloop_gciql.py --env-name pointmaze-large-stitch-v0 --init-checkpoint runs/X/pretrained.pt

GC-IQL as OGBench runs it (docs/reference.md, OGBench), with separate IRU networks for the value V(s, g), the critic
Q(s, g, a) (an ensemble of 2) and the actor, all trained at the full depth K:
    value   expectile_0.9( min_i Q_target,i(s, g, a) - V(s, g) )
    critic  sum_i ( Q_i(s, g, a) - (r + gamma * mask * V(s', g)) )^2
    actor   -Q(s, g, clip(mu)) / sg(mean |Q|) - alpha * log pi(a | s, g)      (DDPG+BC, std fixed at 1)
Only the actor is depth-elastic. FlexLoop adds lambda_depth * mean_{k<K} D~(sg[pi_{k+1}] || pi_k) with the
normalised Gaussian KL (see `IRUActor.divergence`)
    D~(p || q) = (1/|A|) sum_j (tanh mu_p,j - tanh mu_q,j)^2 / (2 sigma_p,j^2),
the KL between N(tanh mu_p, sigma_p^2) and N(tanh mu_q, sigma_p^2): the means squashed into the action range, and
the student's std replaced by the (detached) teacher's, so the student cannot shrink the loss by inflating its own
scale; averaged over action dimensions so that one lambda serves datasets with 2 to 8 action dimensions.

Copy and modify: copy this file, change it and run the copy; eval_adaptive.py rebuilds the copy's checkpoints with the
copy's own network. Its stopping rule calls the network's `divergence` method, so a copy that changes the depth loss's
D should change `divergence` to match, and changing `divergence` changes the rule.
"""

import copy
import math
import sys
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm.auto import tqdm

import flexloop_run
from envs import ogbench_data
from envs.eval_workers import EvalEnvs, EvalWorkers

TASK_IDS = (1, 2, 3, 4, 5)  # OGBench's evaluation tasks, 1-indexed as env.reset(options=dict(task_id=k)) takes them
ACTOR_STD = 1.0  # OGBench's const_std=True: the actor's Gaussian has a fixed unit std


@dataclass
class ExperimentArgs:
    """experiment and logging"""
    exp_name: str = Path(__file__).stem
    """the name of this experiment (part of the run name)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
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
    log_every: int = 10_000
    """log training metrics every this many iterations (here an iteration is one update)"""
    save_every: int = 50_000
    """write the latest checkpoint every this many iterations"""
    save_every_minutes: float = 15.0
    """also write it every this many minutes, between updates (0: never)"""
    debug: bool = False
    """show the full traceback of an error (also FLEXLOOP_DEBUG=1)"""


@dataclass
class EnvironmentArgs:
    """environment: the OGBench dataset"""
    env_name: str = "pointmaze-large-stitch-v0"
    """scene-play-v0, cube-double-play-v0, puzzle-4x4-play-v0, antmaze-medium-stitch-v0 or pointmaze-large-stitch-v0"""
    dataset_dir: Optional[str] = None
    """folder holding <env-name>.npz (default ~/.ogbench/data); on --resume, given here it replaces the run's"""
    dataset_path: Optional[str] = None
    """a local <env-name>.npz file, used instead of --dataset-dir (on --resume, given here it replaces the run's)"""
    download: bool = True
    """download a missing dataset into the dataset folder (ogbench's behaviour); --no-download fails at once"""


@dataclass
class NetworkArgs:
    """network: the value, critic and actor IRUs alike"""
    depth: int = 5
    """K, the number of recurrent steps of each IRU"""
    iru_variant: Literal["residual", "paper"] = "residual"
    """residual: the public code (gates and heads read h = sum tanh(c)); paper: the paper's equation (tanh(c), c)"""
    backbone: Literal["iru", "lstm"] = "iru"
    """iru: the IRU cell; lstm: an LSTM cell unrolled over depth, for all three networks (§5.4's backbone ablation)"""
    hidden_dim: int = 256
    """IRU width d"""
    num_critics: int = 2
    """critic ensemble size (the value and actor losses use the minimum over the ensemble)"""
    init: Literal["pytorch", "flax"] = "pytorch"
    """pytorch: nn.Linear's uniform +-1/sqrt(fan_in), biases too (ours, every committed run); flax: the authors'
    (their networks.py): lecun_normal kernels, zero biases, the actor's mean head at variance scale 0.01 and
    orthogonal value and critic heads. Both set the forget-gate bias to +1 (docs/reference.md, GC-IQL)"""


@dataclass
class AlgorithmArgs:
    """algorithm: GC-IQL"""
    pretrain_steps: int = 1_000_000
    """IRU-K pretraining updates (lambda = 0) when no --init-checkpoint is given"""
    total_steps: int = 1_000_000
    """FlexLoop post-training updates"""
    batch_size: int = 1024
    """transitions per update"""
    learning_rate: float = 3e-4
    """Adam learning rate (all three networks)"""
    tau: float = 0.005
    """Polyak rate of the target critic, applied every update"""
    expectile: float = 0.9
    """expectile of the value loss"""
    alpha: Optional[float] = None
    """BC weight of the DDPG+BC actor loss (default: the dataset's, DATASET_HYPERPARAMETERS)"""
    gamma: float = 0.99
    """discount (also the geometric rate of the value's trajectory goals)"""


@dataclass
class FlexLoopArgs:
    """FlexLoop: the depth loss and where post-training starts"""
    depth_target: Literal["adjacent", "final"] = "adjacent"
    """adjacent: D~(sg[pi_{k+1}] || pi_k) (FlexLoop); final: every depth distilled from depth K, D~(sg[pi_K] || pi_k)"""
    init_checkpoint: Optional[str] = None
    """start FlexLoop post-training from this pretrained IRU-K checkpoint (skips pretraining); a {seed} in the path
    becomes --seed, so one sweep value serves every seed"""
    lambda_depth: Optional[float] = None
    """weight of the adjacent-depth normalised KL on the actor (default: the dataset's; 0 = plain IRU-K training)"""
    init_optimizer: bool = False
    """also take the --init-checkpoint's Adam state (a full checkpoint's, not a slim one's), so that post-training
    continues pretraining's optimiser as restoring a whole agent does in the JAX code; off, Adam starts afresh (on
    pointmaze the inherited state moved full depth more at the start: docs/results/ogbench.md)"""


@dataclass
class EvaluationArgs:
    """evaluation"""
    eval_episodes: int = 50
    """episodes per task and depth (0: no evaluation during training, e.g. on a machine without MuJoCo;
    evaluate the checkpoints later with eval_adaptive.py)"""
    eval_envs: Optional[int] = None
    """OGBench envs stepped side by side during evaluation; the policy acts on all of them in one batch (default:
    with the actor on a GPU, every episode of an evaluation at once for the maze datasets, whose envs are small;
    otherwise 50, a background evaluation's CPU copy included)"""
    eval_async: bool = True
    """step the evaluation envs in worker processes, one per usable core, each stepping its share of the envs per
    message (envs/eval_workers.py); False: all in this process"""
    eval_every: int = 100_000
    """evaluate every depth on every task every this many iterations (and at the end of each phase)"""
    eval_in_background: bool = False
    """evaluate a CPU copy of the actor in a thread while training goes on, one evaluation at a time (training
    waits only when the next one is due before the last has ended); each is logged when it ends, with
    charts/evaluated_step naming the step (update) it evaluated"""


@dataclass
class PerformanceArgs:
    """performance: device and speed"""
    cuda: bool = True
    """use CUDA when it is available (see --require-cuda to make its absence an error)"""
    require_cuda: bool = False
    """fail instead of falling back to CPU when no GPU is present"""
    cuda_graph: bool = True
    """capture the update in a CUDA graph and replay it (GPU only; --no-cuda-graph runs it eagerly)"""
    compile: bool = True
    """torch.compile the losses on GPU (ignored on CPU, where it does not pay)"""
    bf16: bool = True
    """on a GPU, run the update's network passes under bf16 autocast, every head in float32 (1.2x the TF32 update,
    and it learns at least as well: docs/results/ogbench.md); --no-bf16 for TF32. Ignored on CPU, where the update
    stays float32"""
    cuda_streams: bool = True
    """GPU: run the value, critic and actor losses (forward and backward) on three CUDA streams, so that their small
    kernels overlap, and sample the next update's batch on a fourth: the same arithmetic, 1.46x the updates on an
    H200 (docs/benchmarks.md). Ignored on CPU; --no-cuda-streams runs it all on one stream"""


@dataclass
class Args(PerformanceArgs, EvaluationArgs, FlexLoopArgs, AlgorithmArgs, NetworkArgs, EnvironmentArgs, ExperimentArgs):
    """Every flag, flat (args.lambda_depth). --help shows them in the groups above (see parse_args)."""


class DatasetHyperparameters(NamedTuple):
    alpha: float  # the BC weight of the DDPG+BC actor loss
    lambda_depth: float  # the weight of the depth loss
    actor_goals: tuple[float, float, float]  # where the actor's goals come from: P(current, trajectory, random state)


# Per-dataset hyperparameters (docs/reference.md, OGBench); --alpha and --lambda-depth override the first two.
DATASET_HYPERPARAMETERS = {
    "scene-play-v0": DatasetHyperparameters(alpha=1.0, lambda_depth=0.05, actor_goals=(0.0, 1.0, 0.0)),
    "cube-double-play-v0": DatasetHyperparameters(alpha=1.0, lambda_depth=0.02, actor_goals=(0.0, 1.0, 0.0)),
    "puzzle-4x4-play-v0": DatasetHyperparameters(alpha=1.0, lambda_depth=0.2, actor_goals=(0.0, 1.0, 0.0)),
    "antmaze-medium-stitch-v0": DatasetHyperparameters(alpha=0.3, lambda_depth=0.03, actor_goals=(0.0, 0.5, 0.5)),
    "pointmaze-large-stitch-v0": DatasetHyperparameters(alpha=0.003, lambda_depth=0.3, actor_goals=(0.0, 0.5, 0.5)),
}


def resolve_dataset_defaults(args: Args):
    """A copy of args with alpha and lambda_depth set to the dataset's values where not given, so that the run
    records the values it used."""
    dataset = DATASET_HYPERPARAMETERS[args.env_name]
    return replace(args, alpha=dataset.alpha if args.alpha is None else args.alpha,
                   lambda_depth=dataset.lambda_depth if args.lambda_depth is None else args.lambda_depth)


# What the run plumbing (flexloop_run.py) needs to know about this script.
FLEXLOOP_SCRIPT = "flexloop-script-v1"  # marks a FlexLoop script: eval_adaptive.py imports no other file
ENV_FLAG = "env_name"  # the flag naming the env: run names, checkpoints and --init-checkpoint checks read it
# cuda_streams changes speed, not the weights (tests/test_gciql.py): a resumed run takes it from the command line.
# Evaluation draws from no training generator, so a resumed run may also evaluate less often, on fewer episodes or
# on more envs side by side (the same episodes).
RESUME_FLAGS = ("resume", "cuda", "require_cuda", "save_every_minutes", "debug", "dataset_dir", "dataset_path",
                "cuda_streams", "eval_every", "eval_episodes", "eval_envs", "eval_in_background")
ALGORITHM = "gciql"
NETWORK_FLAGS = ("depth", "hidden_dim", "num_critics", "iru_variant", "backbone")  # an --init-checkpoint must match
CHECKPOINT_PARTS = ("model", "target_model", "optimizer")  # the state dicts in a checkpoint
GPU_SIZED_FLAGS = ("batch_size", "hidden_dim", "pretrain_steps", "total_steps")  # their defaults need a GPU
# what iru_pretrain.py fixes
PRETRAINING_ONLY = dict(lambda_depth=0.0, total_steps=0, init_checkpoint=None, init_optimizer=False)
ENV_IDS = tuple(DATASET_HYPERPARAMETERS)  # what check_args accepts
POSITIVE_FLAGS = ("batch_size", "hidden_dim", "num_critics", "eval_every", "eval_envs", "log_every",
                  "save_every")  # check_args refuses them at 0 or less


def check_args(args: Args):
    """Refuse bad flags before any work starts, naming the fix."""
    if args.depth < 2:
        raise ValueError(f"--depth must be at least 2 for FlexLoop's adjacent-depth loss, got {args.depth}")
    if args.lambda_depth is not None and args.lambda_depth < 0:
        raise ValueError(f"--lambda-depth must be >= 0, got {args.lambda_depth}")
    if args.resume and args.init_checkpoint:
        raise ValueError("give either --resume (continue a run) or --init-checkpoint (start post-training), not both")
    if args.init_optimizer and not args.init_checkpoint:
        raise ValueError("--init-optimizer takes the Adam state of an --init-checkpoint; give one, or drop the flag")
    if args.backbone == "lstm" and args.iru_variant != "residual":
        raise ValueError("--iru-variant applies to the IRU backbone only; drop it with --backbone lstm")
    if args.env_name not in ENV_IDS:
        raise ValueError(f"--env-name {args.env_name!r} is not a dataset of {ALGORITHM}; choose one of {list(ENV_IDS)}")
    for name in POSITIVE_FLAGS:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.alpha is not None and args.alpha < 0:
        raise ValueError(f"--alpha must be >= 0, got {args.alpha}")
    if args.eval_episodes < 0:
        raise ValueError(f"--eval-episodes must be >= 0, got {args.eval_episodes}")
    if args.pretrain_steps < 0 or args.total_steps < 0:
        raise ValueError("--pretrain-steps and --total-steps must be >= 0")
    if not 0 < args.expectile < 1:
        raise ValueError(f"--expectile must lie in (0, 1), got {args.expectile}")
    if not 0 < args.gamma < 1:
        raise ValueError(f"--gamma must lie in (0, 1), got {args.gamma}")
    if not 0 < args.tau <= 1:
        raise ValueError(f"--tau must lie in (0, 1], got {args.tau}")


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: network
# ---------------------------------------------------------------------------------------------------------
class EnsembleLinear(nn.Module):
    """num_members independent Linear layers applied to (members, ..., in_features)."""

    def __init__(self, num_members, in_features, out_features):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # as nn.Linear's
        bound = 1 / math.sqrt(in_features)  # nn.Linear's default init
        self.weight = nn.Parameter(torch.empty(num_members, in_features, out_features).uniform_(-bound, bound))
        self.bias = nn.Parameter(torch.empty(num_members, 1, out_features).uniform_(-bound, bound))

    def forward(self, x):
        # bmm, then + bias: baddbmm would first copy the broadcast bias into a full-size output (12% of GC-DQN's
        # compiled update, docs/benchmarks.md), while an add is fused into the kernels that read the result.
        out = torch.bmm(x.flatten(1, -2), self.weight)
        return (out + self.bias.to(out.dtype)).view(*x.shape[:-1], -1)  # bf16 stays bf16 under --bf16


class EnsembleLayerNorm(nn.Module):
    def __init__(self, num_members, features):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_members, 1, features))
        self.bias = nn.Parameter(torch.zeros(num_members, 1, features))

    def forward(self, x):
        flat = x.flatten(1, -2)  # (members, rows, features)
        return (F.layer_norm(flat, flat.shape[-1:]) * self.weight + self.bias).view_as(x)


class IRU(nn.Module):
    """`members` IRUs side by side, each read out after every one of K recurrent steps (docs/reference.md, the IRU):

        x_emb = LayerNorm(Linear(x))                    x: the concatenated input
        z     = LayerNorm(concat[x_emb, h])            (paper variant: concat[x_emb, tanh(c)])
        f     = sigmoid(Linear_forget(z)),  i = tanh(Linear_input(z))      (forget-gate bias initialised to +1)
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
        self.gates = EnsembleLinear(members, 2 * hidden_dim, 2 * hidden_dim)  # forget and input gates, one matmul
        with torch.no_grad():
            self.gates.bias[..., :hidden_dim] = 1.0  # forget-gate bias +1: remember by default
        self.head = EnsembleLinear(members, hidden_dim, out_dim)

    def start(self, x):
        x_emb = self.embed_norm(self.embed(x.expand(self.members, -1, -1)))
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
        """The recurrent feature the heads read: h (paper variant: c)."""
        _, c, h = state
        return h if self.variant == "residual" else c

    def output(self, state):
        """The head's output at the current depth, (members, rows, out_dim). In float32 also under --bf16: V, Q and
        the actor's mean feed targets, a scale-free Q ratio and a log-likelihood, where bf16's 3 digits would show."""
        readout = self.readout(state)
        with torch.autocast(readout.device.type, enabled=False):
            return self.head(readout.float())

    def forward(self, x):
        """The full-depth output, (members, rows, out_dim)."""
        state = self.start(x)
        for _ in range(self.depth):
            state = self.advance(state)
        return self.output(state)


class LSTM(IRU):
    """The same network with an LSTM cell in place of the IRU cell, unrolled over depth for a fixed input
    (the paper's LSTM backbones, §5.4):

        i, f, g, o = Linear(concat[x_emb, h])            (forget-gate bias initialised to +1)
        c          = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h          = sigmoid(o) * tanh(c)                  (the heads read h)

    The input embedding, the heads, the state (x_emb, c, h), the members and the methods are the IRU's."""

    def __init__(self, in_dim, out_dim, depth=5, hidden_dim=256, members=1):
        # variant "residual": the inherited readout is h, the LSTM's output
        super().__init__(in_dim, out_dim, depth, hidden_dim, "residual", members)
        self.gates = EnsembleLinear(members, 2 * hidden_dim, 4 * hidden_dim)  # input, forget, cell, output
        del self.gate_norm  # a plain LSTM cell: no normalisation inside
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
        divergence(p, q)                  normalised KL D~(p || q) per row: the training loss and delta_k at inference
        gather(state, rows)               the recurrent state of some batch rows (adaptive inference)
        policy = decide(state)            pi_k as (rows, 2, action_dim): mean and std
        all_depths(obs, goal)             the policies of depths 1..K, (K, rows, 2, action_dim)
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
        mean = self.iru.output(state)[0]
        return torch.stack([mean, torch.full_like(mean, self.std)], -2)

    def all_depths(self, obs, goal):
        """The policies of depths 1..K, (K, rows, 2, A). The head reads the K states stacked, so it is one matmul
        over all depths (forward and backward) instead of K small ones."""
        state = self.start(obs, goal)
        states = []
        for _ in range(self.depth):
            state = self.advance(state)
            states.append(state)
        stacked = tuple(torch.stack(part, 1) for part in zip(*states))  # (members, K, rows, hidden) each
        return self.decide(stacked)

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


def build_network(args: Args, device):
    spec = ogbench_data.get_spec(args.env_name)
    agent = GCIQLAgent(spec.obs_dim, spec.action_dim, args.depth, args.hidden_dim, args.iru_variant,
                       args.num_critics, args.backbone)
    return (init_like_flax(agent) if args.init == "flax" else agent).to(device)


def init_like_flax(agent):
    """The authors' init (flax's defaults as their networks.py leaves or sets them): every kernel lecun_normal (a
    normal of variance 1 / fan_in truncated at 2 standard deviations) and every bias 0, the forget-gate bias +1;
    the V and Q heads orthogonal (one output: a unit vector), the actor's mean head variance_scaling(0.01,
    fan_avg, uniform). LayerNorms stay at scale 1 and shift 0 in both."""
    with torch.no_grad():
        for net in (agent.value, agent.critic, agent.actor.iru):
            for layer in (net.embed, net.gates):
                std = (1 / layer.in_features) ** 0.5 / 0.87962566103423978  # flax's truncation correction
                nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
                nn.init.zeros_(layer.bias)
            forget = slice(net.hidden_dim, 2 * net.hidden_dim) if isinstance(net, LSTM) else slice(0, net.hidden_dim)
            net.gates.bias[..., forget] = 1.0
            nn.init.zeros_(net.head.bias)
        for member_weight in (*agent.value.head.weight, *agent.critic.head.weight):  # (in, out) per member
            nn.init.orthogonal_(member_weight)
        head = agent.actor.iru.head
        limit = (3 * 0.01 / ((head.in_features + head.out_features) / 2)) ** 0.5
        nn.init.uniform_(head.weight, -limit, limit)
    return agent


def network_from_checkpoint(checkpoint, device="cpu"):
    """Rebuild the policy network (the IRUActor) from a checkpoint alone (used by eval_adaptive.py)."""
    args = flexloop_run.args_from_checkpoint(Args, checkpoint)
    network = build_network(args, device)
    network.load_state_dict(checkpoint["model"])
    return network.actor, args


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: losses
# ---------------------------------------------------------------------------------------------------------
# flexloop_losses' terms: metrics, NaN checks and checkpoints read these
LOSS_NAMES = ("losses/value_loss", "losses/critic_loss", "losses/actor_loss", "losses/depth_kl", "losses/q_loss",
              "losses/bc_loss", "charts/v_mean", "charts/q_mean", "charts/actor_mse")


def flexloop_depth_loss(policies, target="adjacent"):
    """mean_{k=1..K-1} D~(sg[pi_{k+1}] || pi_k) over the stacked policies (K, rows, 2, A); with target="final",
    mean_{k=1..K-1} D~(sg[pi_K] || pi_k) instead.

    The deeper policy is the target (detached), so only the shallower depth moves towards it."""
    deeper = policies[1:] if target == "adjacent" else policies[-1:].expand_as(policies[:-1])
    kl = IRUActor.divergence(deeper.detach(), policies[:-1])  # (K-1, rows)
    return kl.mean()


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


def value_branch(network, target_critic, batch, args, lambda_depth):
    """IQL's value loss: V(s, g) towards the expectile of the target critics' min Q(s, a, g)."""
    obs, value_goals = batch["observations"], batch["value_goals"]
    with torch.no_grad():
        target_q = critics_at(target_critic, obs, value_goals, batch["actions"]).min(0).values
    v = value_at(network.value, obs, value_goals)
    value_loss = expectile_loss(target_q - v, args.expectile).mean()
    return value_loss, {"losses/value_loss": value_loss, "charts/v_mean": v.mean()}


def critic_branch(network, target_critic, batch, args, lambda_depth):
    """IQL's critic loss: each critic's MSE to r + gamma * mask * V(s', g)."""
    obs, value_goals = batch["observations"], batch["value_goals"]
    with torch.no_grad():
        next_v = value_at(network.value, batch["next_observations"], value_goals)
        q_target = critic_target(batch["rewards"], batch["masks"], next_v, args.gamma)
    q = critics_at(network.critic, obs, value_goals, batch["actions"])
    critic_loss = ((q - q_target) ** 2).mean(1).sum()  # MSE on each critic
    return critic_loss, {"losses/critic_loss": critic_loss, "charts/q_mean": q.mean()}


def actor_branch(network, target_critic, batch, args, lambda_depth):
    """The DDPG+BC actor loss at depth K plus lambda_depth * the actor's depth loss. Q(s, g, mu) trains only the
    actor: the critic runs with detached weights."""
    obs, actions, actor_goals = batch["observations"], batch["actions"], batch["actor_goals"]
    policies = network.actor.all_depths(obs, actor_goals)  # (K, B, 2, A)
    mean, std = policies[-1, :, 0], policies[-1, :, 1]
    frozen_critic = {name: p.detach() for name, p in network.critic.named_parameters()}
    q_actor_input = torch.cat([obs, actor_goals, mean.clamp(-1.0, 1.0)], -1)
    q_actor = torch.func.functional_call(network.critic, frozen_critic, (q_actor_input,))[..., 0].min(0).values
    actor_loss, q_loss, bc_loss = ddpg_bc_actor_loss(q_actor, gaussian_log_prob(actions, mean, std), args.alpha)
    depth_kl = flexloop_depth_loss(policies, args.depth_target)
    return actor_loss + lambda_depth * depth_kl, {
        "losses/actor_loss": actor_loss, "losses/depth_kl": depth_kl, "losses/q_loss": q_loss,
        "losses/bc_loss": bc_loss, "charts/actor_mse": ((mean - actions) ** 2).mean()}


# Independent: each reads the others' weights only. One signature, (network, target_critic, batch, args, lambda_depth).
LOSS_BRANCHES = (value_branch, critic_branch, actor_branch)


def flexloop_losses(network, target_critic, batch, args, lambda_depth):
    """The loss of one update on a batch and its terms by LOSS_NAMES, as device tensors (no host sync): GC-IQL's
    value, critic and actor losses at depth K plus lambda_depth * the actor's depth loss, one branch each."""
    return sum_branches([branch(network, target_critic, batch, args, lambda_depth) for branch in LOSS_BRANCHES])


def sum_branches(parts):
    """The branches' (loss, terms) pairs as one loss and its terms by LOSS_NAMES."""
    loss = sum(branch_loss for branch_loss, _ in parts)
    terms = {name: value for _, branch_terms in parts for name, value in branch_terms.items()}
    return loss, {name: terms[name] for name in LOSS_NAMES}


def on_cuda_streams(branches, device):
    """flexloop_losses with each branch on a CUDA stream of its own (--cuda-streams). The three branches are
    independent and each is hundreds of small kernels that leave most of the GPU idle, so side by side they
    overlap. Autograd runs each backward kernel on its forward's stream, so the backward pass overlaps too."""
    streams = [torch.cuda.Stream(device) for _ in branches]

    def losses(network, target_critic, batch, args, lambda_depth):
        main = torch.cuda.current_stream(device)
        parts = []
        for branch, stream in zip(branches, streams):
            stream.wait_stream(main)  # the batch is ready
            with torch.cuda.stream(stream):
                parts.append(branch(network, target_critic, batch, args, lambda_depth))
        for stream in streams:
            main.wait_stream(stream)
        for loss, terms in parts:  # made on a side stream, read on the main one: keep the allocator from reusing them
            for tensor in (loss, *terms.values()):
                tensor.record_stream(main)
        return sum_branches(parts)

    return losses


def bf16_autocast(args, device):
    """The update's autocast: bf16 under --bf16 on a GPU; none on a CPU, where bf16 is slower than float32.
    Without autocast's cache of cast weights: the cache is shared across CUDA streams, so the critic branch could
    read the value net's cast before the value branch's stream wrote it, and CUDA graph capture asks for it off.
    Compiled branches cast inside their own kernels and never used it."""
    return torch.autocast(device.type, torch.bfloat16, enabled=args.bf16 and device.type == "cuda",
                          cache_enabled=False)


def make_update(args, network, target_critic, optimizer, dataset, generator, lambda_depth, loss_sums,
                losses=flexloop_losses, prefetch=False):
    """One update: sample a batch, the losses of `flexloop_losses`, Polyak averaging of the target critic, Adam.
    No host sync, fixed shapes: it can be captured in a CUDA graph. lambda_depth is a 0-d tensor, so one captured
    graph serves both phases; the loss parts add to loss_sums. With --bf16 on a GPU the losses' network passes run
    under bf16 autocast; the backward pass runs outside it, as torch.autocast advises. `losses` is flexloop_losses,
    compiled or not, or `on_cuda_streams` (the update around it is captured, not compiled).

    prefetch: each update trains on the batch sampled during the previous one and samples the next, on a CUDA
    stream of its own on a GPU, so that the sampler's few dozen small kernels run beside the losses instead of
    before them. The batches are the same, drawn in the same order from the same generator, one update early."""
    critic_params, target_params = list(network.critic.parameters()), list(target_critic.parameters())
    sampler_stream = torch.cuda.Stream(dataset.device) if prefetch and dataset.device.type == "cuda" else None
    ready = {}  # prefetch: the batch the next update trains on, in the same buffers every time

    def sample_next():
        if sampler_stream is None:
            return dataset.sample(args.batch_size, generator)
        sampler_stream.wait_stream(torch.cuda.current_stream())  # joins a graph capture; orders eager calls
        with torch.cuda.stream(sampler_stream):
            return dataset.sample(args.batch_size, generator)

    def update():
        if prefetch and not ready:  # the first call (a capture's warm-up): after --resume restored the generator
            ready.update(dataset.sample(args.batch_size, generator))
        batch = ready if prefetch else dataset.sample(args.batch_size, generator)
        upcoming = sample_next() if prefetch else None
        with bf16_autocast(args, dataset.device):
            loss, terms = losses(network, target_critic, batch, args, lambda_depth)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        with torch.no_grad():  # the target moves towards the critic before this step, as OGBench's target_update
            torch._foreach_lerp_(target_params, critic_params, args.tau)
        optimizer.step()
        with torch.no_grad():
            loss_sums.add_(torch.stack([terms[name] for name in LOSS_NAMES]).detach())
            if prefetch:  # the next batch into the buffers the next update reads (after this backward read them)
                if sampler_stream is not None:
                    torch.cuda.current_stream().wait_stream(sampler_stream)
                    for tensor in upcoming.values():
                        tensor.record_stream(torch.cuda.current_stream())
                torch._foreach_copy_(list(ready.values()), list(upcoming.values()))

    return update


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: data
# ---------------------------------------------------------------------------------------------------------
def load_dataset(args, device):
    """The dataset on the device, with OGBench's goal-conditioned sampling and the dataset's actor goals."""
    return ogbench_data.load_dataset(args.env_name, dataset_dir=args.dataset_dir, dataset_path=args.dataset_path,
                                     device=device, download=args.download, gamma=args.gamma,
                                     actor_goals=DATASET_HYPERPARAMETERS[args.env_name].actor_goals)


# ---------------------------------------------------------------------------------------------------------
# Collection and per-depth evaluation
# ---------------------------------------------------------------------------------------------------------
# Offline: no collection. Evaluation runs OGBench's 5 tasks, episodes side by side in a batch of envs.
def eval_env_count(args, device):
    """--eval-envs, else every episode of an evaluation (episodes x tasks x depths) for an actor on a GPU where the
    envs are small, 50 otherwise (docs/benchmarks.md: a GPU call costs about the same from 50 to 800 rows, a CPU
    call by the row, and a manipulation env takes about 160 MB)."""
    if args.eval_envs is not None:
        return args.eval_envs
    actor_on_gpu = device.type == "cuda" and not args.eval_in_background  # a background evaluation acts on a CPU
    if actor_on_gpu and ogbench_data.envs_are_small(args.env_name):
        return args.eval_episodes * len(TASK_IDS) * args.depth
    return 50


def make_eval_vector_env(env_name, num_envs, async_envs=True):
    """num_envs OGBench evaluation envs (envs/eval_workers.py). async_envs: stepped in batches by one worker
    process per usable core, the same episodes as in this process. Episodes never auto-reset: `rollout` resets
    each env itself with the task of its next episode."""
    if async_envs:
        return EvalWorkers(env_name, num_envs, workers=ogbench_data.usable_cores())
    return EvalEnvs(env_name, num_envs)


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


def rollout(policy_fn, vector_env, task_ids=TASK_IDS, episodes=50, num_policies=1, seed=0, progress=False):
    """Run `episodes` episodes of every task for each of `num_policies` policies, side by side.

    policy_fn(obs, goal, policy_index) gets float32 arrays (n, obs_dim), (n, obs_dim) and the int array (n,)
    of the policy each row follows, and returns actions (n, action_dim) as an array or tensor. It is called
    once per vector step for all running episodes together. Each env takes the next waiting episode (its task
    set at reset) as soon as its current one ends, so no env idles while episodes wait. Episode j is reset with
    seed + j, whatever the number of envs. Success is the final info['success'] of an episode (OGBench's score).

    Returns success as an array (num_policies, len(task_ids), episodes).
    """
    # worker processes step the envs on every core, and a policy's torch threads on a CPU would compete with them
    # (docs/benchmarks.md: one thread is faster on 2 cores and on 16); a policy on a GPU uses the CPU only to copy
    # tensors, so it gets one too (as fast as 16 threads there: docs/benchmarks.md)
    threads = torch.get_num_threads()
    if isinstance(vector_env, EvalWorkers):
        torch.set_num_threads(1)
    try:
        return run_episodes(policy_fn, vector_env, task_ids, episodes, num_policies, seed, progress)
    finally:
        torch.set_num_threads(threads)


def run_episodes(policy_fn, vector_env, task_ids, episodes, num_policies, seed, progress):
    """rollout's episode loop (rollout sets the torch threads around it)."""
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

    def start_next_jobs(free_envs):
        """Reset the given envs into the next waiting jobs; an env left without one goes idle and is not stepped."""
        nonlocal next_job
        tasks, seeds = np.full(num_envs, task_ids[0]), [0] * num_envs
        for i in np.flatnonzero(free_envs):
            if next_job < len(jobs):
                job_of[i], tasks[i], seeds[i] = next_job, task_ids[jobs[next_job][1]], seed + next_job
                next_job += 1
            else:
                job_of[i] = -1
        starting = free_envs & (job_of >= 0)
        if starting.any():
            new_obs, info = vector_env.reset(seed=seeds, options={"reset_mask": starting, "task_ids": tasks})
            obs[starting] = new_obs[starting]
            goals[starting] = info["goal"][starting]

    start_next_jobs(np.ones(num_envs, bool))
    policy_of_job = np.array([p for p, _, _ in jobs] or [0])
    while (job_of >= 0).any():
        running = job_of >= 0
        actions = np.zeros((num_envs, action_dim), np.float32)
        chosen = policy_fn(obs[running], goals[running], policy_of_job[job_of[running]])
        actions[running] = chosen.cpu().numpy() if torch.is_tensor(chosen) else np.asarray(chosen)
        new_obs, _, terminated, truncated, info = vector_env.step(actions, running)
        obs[running] = new_obs[running]
        done = (terminated | truncated) & running
        for i in np.flatnonzero(done):
            success[job_of[i]] = float(info["success"][i])
            pbar.update(1)
        if done.any():
            start_next_jobs(done)
    pbar.close()
    return success.reshape(num_policies, len(task_ids), episodes)


def cpu_copy(actor):
    """A frozen CPU copy for a background evaluation: its steps never wait behind the updates queued on a GPU."""
    return copy.deepcopy(actor).requires_grad_(False).cpu()


def evaluate(actor, vector_env, episodes, device, seed=0, progress=False):
    """Success of every depth 1..K on every task: eval/task_<t>/success_depth_<k>, and the mean over tasks
    eval/success_depth_<k>."""
    was_training = actor.training
    actor.eval()
    try:
        success = rollout(depth_policy_fn(actor, device), vector_env, TASK_IDS, episodes, actor.depth, seed, progress)
    finally:
        actor.train(was_training)
    results = {}
    for k in range(1, actor.depth + 1):
        for t, task_id in enumerate(TASK_IDS):
            results[f"eval/task_{task_id}/success_depth_{k}"] = float(success[k - 1, t].mean())
        results[f"eval/success_depth_{k}"] = float(success[k - 1].mean())
    return results


def format_eval(results, args, iteration):
    values = " ".join(f"{results[f'eval/success_depth_{k}']:.3f}" for k in range(1, args.depth + 1))
    return f"update {iteration} success by depth 1..{args.depth} (mean over tasks): {values}"


def initial_target_critic(network, init=None):
    """The target critic a run starts from: an --init-checkpoint's own when it holds one (a run's full checkpoint),
    else a copy of the critic as loaded (a slim checkpoint, `flexloop_run.py slim`, holds no target)."""
    target_critic = copy.deepcopy(network.critic).requires_grad_(False)
    if init is not None and init.get("target_model") is not None:
        target_critic.load_state_dict(init["target_model"])
    return target_critic


def initial_optimizer_state(init, optimizer):
    """--init-optimizer: the Adam state of a full --init-checkpoint, with this run's learning rate and device flags.
    A slim checkpoint holds none: refused, naming the fix."""
    if init.get("optimizer") is None:
        raise ValueError("--init-optimizer needs a full checkpoint (a run's final.pt or latest.pt as written), but "
                         "this --init-checkpoint is slim and holds no Adam state; give the full one or drop the flag")
    state = flexloop_run.on_this_device(init["optimizer"], optimizer)
    groups = [{**saved, "lr": now["lr"]} for saved, now in zip(state["param_groups"], optimizer.param_groups)]
    return {**state, "param_groups": groups}


def train(args: Args):
    # The flags checked (a resumed run's own), checkpoints read, the device picked, seeds set: flexloop_run.py
    run = flexloop_run.Run(sys.modules[__name__], args)
    args = run.args = resolve_dataset_defaults(run.args)
    device = run.device
    # The dataset first: a missing one fails here, before any run folder exists. It is data, not state, so a
    # resumed run simply reloads it.
    dataset = load_dataset(args, device)
    network = build_network(args, device)
    if run.init is not None:
        network.load_state_dict(run.init["model"])
    lambda_depth = torch.zeros((), device=device)  # a tensor, so one captured graph serves both phases
    loss_sums = torch.zeros(len(LOSS_NAMES), device=device)  # summed on the device between logs
    generators = {"sample": torch.Generator(device).manual_seed(args.seed)}
    target_critic = initial_target_critic(network, run.init)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, capturable=on_cuda, fused=on_cuda)
    if args.init_optimizer and run.init is not None:  # a resumed run restores its own optimiser instead
        optimizer.load_state_dict(initial_optimizer_state(run.init, optimizer))
    if args.cuda_streams and on_cuda:
        losses = on_cuda_streams([run.compiled(branch) for branch in LOSS_BRANCHES], device)
    else:
        losses = run.compiled(flexloop_losses)
    update = make_update(args, network, target_critic, optimizer, dataset, generators["sample"], lambda_depth,
                         loss_sums, losses=losses, prefetch=args.cuda_streams and on_cuda)

    # Phases: IRU-K pretraining (lambda = 0) unless a pretrained network was given, then FlexLoop. An iteration
    # is one update. From the flags, not run.init: a resumed run started from one has none.
    pretrain_steps = 0 if args.init_checkpoint else args.pretrain_steps
    phases = [("pretrain", pretrain_steps, 0.0),
              ("flexloop", args.total_steps, args.lambda_depth)]
    parts = {"model": network, "target_model": target_critic, "optimizer": optimizer}
    run.begin(phases, parts, generators, loss_sums, steps_per_iteration=1, updates_per_iteration=1,
              progress="updates")
    graphed_update, eval_env = None, None  # the evaluation vector env is made at the first evaluation, then kept
    open_eval_env = partial(make_eval_vector_env, args.env_name, eval_env_count(args, device), args.eval_async)
    lambda_depth_now = None

    with run:
        if run.unfinished_evaluation is not None:  # a stop came during a background evaluation: those weights first
            eval_env = open_eval_env()
            run.evaluate_unfinished_in_background(evaluate, cpu_copy(network.actor), eval_env, args.eval_episodes,
                                                  torch.device("cpu"), seed=args.seed + 1000)
        while run.running():
            phase, lam = run.phase()
            if lam != lambda_depth_now:  # a fill on the device at phase changes only: an iteration is one update
                lambda_depth.fill_(lam)
                lambda_depth_now = lam

            graphed_update = graphed_update or run.graphed_update(update, [generators["sample"]])
            for _ in run.update_steps(1):
                graphed_update()
            if not run.end_iteration():
                break  # stopped mid-iteration (SIGTERM, Ctrl-C): finish() writes latest.pt

            if run.log_due():
                run.log({"charts/lambda_depth": lam})
            run.log_background_evaluation()
            if args.eval_episodes > 0 and run.evaluate_due():
                eval_env = eval_env or open_eval_env()
                if args.eval_in_background:
                    run.evaluate_in_background(evaluate, cpu_copy(network.actor), eval_env, args.eval_episodes,
                                               torch.device("cpu"), seed=args.seed + 1000)
                else:
                    run.evaluate(evaluate, network.actor, eval_env, args.eval_episodes, device, seed=args.seed + 1000)
            run.save_due()
        if run.stop.reason is None:
            run.log_background_evaluation(wait=True)  # logged before final.pt holds the metrics
        if args.eval_episodes > 0 and run.final_evaluation_owed:  # resumed after a stop in the final evaluation
            eval_env = eval_env or open_eval_env()
            run.evaluate(evaluate, network.actor, eval_env, args.eval_episodes, device, seed=args.seed + 1000)
    if eval_env is not None:  # here, not in the block, which a stop can leave in the middle of an evaluation
        eval_env.close()
    return run.finish()  # final.pt, or latest.pt after a stop


if __name__ == "__main__":
    with flexloop_run.errors_in_one_line():
        train(flexloop_run.parse_args(Args, description=__doc__))
