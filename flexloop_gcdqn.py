"""FlexLoop post-training of an IRU GC-DQN on BoxPick (one file, CleanRL style):
    python flexloop_gcdqn.py --lambda-depth 1.0                        # pretrain IRU-5, then FlexLoop
    python flexloop_gcdqn.py --init-checkpoint runs/X/pretrained.pt   # FlexLoop from a pretrained IRU-5

The loss is GC-DQN's TD loss at the full depth K plus
    lambda_depth * mean_{k<K} KL(sg[pi_{k+1}] || pi_k),   pi_k = softmax(Q_k / tau),
where Q_k is the ensemble-mean Q-value read out after k recurrent steps (docs/reference.md: the IRU, BoxPick).

The paper's ablations and variants (§5.4, appendix C; docs/reference.md, adaptive inference) are flags of the FlexLoop phase:
    --ablation distill-only             no TD loss: every depth distils the pretrained full-depth policy
    --lambda-depth 0                    Self-TD Only: the TD loss at depth K alone
    --ablation anyk-td --lambda-depth 0 AnyK-TD: the TD loss at every depth (mean over k), no KL
    --depth-target final                distil every depth straight from depth K: KL(sg[pi_K] || pi_k)
    --backbone lstm --hidden-dim 184    an LSTM cell unrolled over depth instead of the IRU
    --teacher-checkpoint PATH           FlexLoop from scratch with an output-only teacher (appendix C.1)

Copy and modify: copy this file, change it and run the copy; eval_adaptive.py rebuilds the copy's checkpoints with the
copy's own network. Its stopping rule calls the network's `divergence` method, so a copy that changes the depth loss's
D should change `divergence` to match, and changing `divergence` changes the rule.
"""

import copy
import math
import sys
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import envs
import flexloop_run
from envs.boxpick import NUM_ACTIONS, NUM_CELLS, NUM_CODES, goal_reached, remove_agent


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
    log_every: int = 10
    """log training metrics every this many iterations"""
    save_every: int = 10
    """write the latest checkpoint every this many iterations"""
    save_every_minutes: float = 15.0
    """also write it every this many minutes, between updates (0: never)"""
    debug: bool = False
    """show the full traceback of an error (also FLEXLOOP_DEBUG=1)"""


@dataclass
class EnvironmentArgs:
    """environment"""
    env_id: str = "BoxPick-Exact-4-v0"
    """BoxPick-Exact-3-v0, BoxPick-Exact-4-v0, BoxPick-Generalize-4-1-v0 or BoxPick-Generalize-4-2-v0"""
    episode_length: int = 100
    """steps per episode (episodes never end early on success)"""
    quarter_filter: bool = False
    """truncate training episodes when the agent leaves the two quadrants' bounding box (Exact only)"""


@dataclass
class NetworkArgs:
    """network"""
    depth: int = 5
    """K, the number of recurrent steps of the IRU"""
    iru_variant: Literal["residual", "paper"] = "residual"
    """residual: the public code (gates and heads read h = sum tanh(c)); paper: the paper's equation (tanh(c), c)"""
    backbone: Literal["iru", "lstm"] = "iru"
    """iru: the IRU cell; lstm: an LSTM cell unrolled over depth (the paper's backbone ablation, §5.4)"""
    hidden_dim: int = 256
    """IRU width d of each critic (LSTM-184: --backbone lstm --hidden-dim 184, about IRU-256's parameters)"""
    num_critics: int = 2
    """ensemble size"""
    obs_encoding: Literal["codes", "onehot"] = "codes"
    """codes: the 36 cell codes as numbers (the reference); onehot: 36 x 12 one-hot cells (learns faster)"""
    init: Literal["flax", "pytorch"] = "flax"
    """flax: the reference's flax defaults, lecun_normal weights and zero biases; pytorch: nn.Linear's uniform
    weights and biases (both keep the forget-gate bias at +1). With pytorch's, Generalize-4-1 never leaves its
    early exploration collapse; with flax's, 3 of 3 seeds pass 0.9 success by 250k updates (docs/results/boxpick.md)"""


@dataclass
class AlgorithmArgs:
    """algorithm: GC-DQN"""
    pretrain_epochs: int = 50
    """IRU-K pretraining epochs (lambda = 0) when no --init-checkpoint is given"""
    num_epochs: int = 10
    """FlexLoop post-training epochs"""
    intervals_per_epoch: int = 100
    """iterations (collect + update rounds) per epoch"""
    num_envs: int = 1024
    """parallel envs; each iteration collects one episode per env"""
    updates_per_rollout: int = 1000
    """gradient updates after each collected episode"""
    batch_size: int = 1024
    """transitions per update, one from each of batch_size distinct envs"""
    learning_rate: float = 3e-4
    """Adam learning rate (critic and temperature)"""
    tau: float = 0.005
    """Polyak rate of the target network, applied every update"""
    init_alpha: float = 1.0
    """initial exploration temperature alpha (actions ~ softmax(Q / alpha))"""
    target_entropy: float = -1.1
    """alpha's loss drives the policy entropy H to -target_entropy nats"""
    alpha_loss: Literal["per-state", "batch-mean"] = "per-state"
    """per-state: mean over the batch of (H(s) + target_entropy)^2, as the reference's dqn_interp.py; batch-mean:
    (mean H + target_entropy)^2, this script's loss before 2026-11-26, which settles at a colder alpha (runs started
    with it record it in their checkpoints' args and resume with it)"""
    replay_episodes: int = 100
    """episodes kept per env (100 x 100 steps = the reference's 10,000 steps per env)"""
    future_goal_fraction: float = 0.5
    """share of the batch relabelled with a future state of its episode (the rest: another sample's state)"""
    future_discount: float = 0.99
    """future-goal offsets j > 0 have probability proportional to future_discount^j"""
    future_goal_window: int = 0
    """0: a future goal may lie anywhere later in its episode. W > 1: as the reference's replay (rb.py), whose
    batches read windows of W stored steps not aligned to episodes, it must also lie inside such a window: the
    offset is at most W - 1 - p, p uniform in 0..W-2 (shorter goals; no gain on Generalize-4-1:
    docs/results/boxpick.md)"""
    gamma: float = 0.99
    """discount"""


@dataclass
class FlexLoopArgs:
    """FlexLoop: the depth loss and where post-training starts"""
    depth_target: Literal["adjacent", "final"] = "adjacent"
    """adjacent: KL(sg[pi_{k+1}] || pi_k) (FlexLoop); final: every depth distilled from depth K, KL(sg[pi_K] || pi_k)"""
    init_checkpoint: Optional[str] = None
    """start FlexLoop post-training from this pretrained IRU-K checkpoint (skips pretraining); a {seed} in the path
    becomes --seed, so one sweep value serves every seed"""
    lambda_depth: float = 1.0
    """weight of the adjacent-depth KL (0 = plain IRU-K training)"""
    policy_temperature: float = 0.25
    """tau in pi_k = softmax(Q_k / tau)"""
    ablation: Literal["none", "distill-only", "anyk-td"] = "none"
    """the FlexLoop phase's losses: none = TD at depth K; distill-only = no TD loss, and every depth 1..K distils the
    pretrained full-depth policy, lambda_depth * mean_k KL(pi_K^pretrained || pi_k) (§5.4); anyk-td = TD at every
    depth, averaged. Self-TD Only is --lambda-depth 0. Pretraining is never changed"""
    teacher_checkpoint: Optional[str] = None
    """FlexLoop from scratch (appendix C.1): fresh weights, no pretraining; this frozen GC-DQN checkpoint is only
    queried, for the depth-K TD target r + gamma * max_a' Q_teacher(s', g, a'), and its weights are never copied
    ({seed} in the path: as --init-checkpoint)"""
    bellman_weight: float = 0.1
    """with --teacher-checkpoint: weight of the inter-depth Bellman loss on depths 1..K-2 (appendix C.1)"""


@dataclass
class EvaluationArgs:
    """evaluation"""
    num_eval_envs: int = 1024
    """envs per split for evaluation (one episode each, actions sampled as in training; the same tasks at every
    depth)"""
    eval_every: int = 100
    """evaluate every depth on both splits every this many iterations (and at the end of each phase)"""


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
    """torch.compile the update (the replay's sampling included) and the collection's policy on GPU (the update
    about 2x faster there; ignored on CPU, where it does not pay)"""
    bf16: bool = True
    """on a GPU, run the update's network passes under bf16 autocast, every head in float32 (about 1.3x the TF32 update,
    and it learns as TF32 does: docs/benchmarks.md); --no-bf16 for TF32. Ignored on CPU, where the update stays
    float32"""


@dataclass
class Args(PerformanceArgs, EvaluationArgs, FlexLoopArgs, AlgorithmArgs, NetworkArgs, EnvironmentArgs, ExperimentArgs):
    """Every flag, flat (args.lambda_depth). --help shows them in the groups above (see parse_args)."""


# What the run plumbing (flexloop_run.py) needs to know about this script.
FLEXLOOP_SCRIPT = "flexloop-script-v1"  # marks a FlexLoop script: eval_adaptive.py imports no other file
ENV_FLAG = "env_id"  # the flag naming the env: run names, checkpoints and --init-checkpoint checks read it
RESUME_FLAGS = ("resume", "cuda", "require_cuda", "save_every_minutes", "debug")  # --resume takes these as given
ALGORITHM = "gcdqn"
NETWORK_FLAGS = ("depth", "hidden_dim", "num_critics", "iru_variant", "obs_encoding", "backbone")  # an init must match
CHECKPOINT_PARTS = ("model", "target_model", "optimizer")  # the state dicts in a checkpoint (+ Distill Only's
# "pretrained_model", its frozen teacher, which older checkpoints lack)
GPU_SIZED_FLAGS = ("num_envs", "batch_size", "updates_per_rollout", "hidden_dim")  # their defaults need a GPU
PRETRAINING_ONLY = dict(lambda_depth=0.0, num_epochs=0, init_checkpoint=None, teacher_checkpoint=None)  # iru_pretrain
ENV_IDS = tuple(envs.BOXPICK_IDS)  # what check_args accepts
POSITIVE_FLAGS = ("num_envs", "batch_size", "updates_per_rollout", "intervals_per_epoch", "replay_episodes",
                  "num_eval_envs", "eval_every", "log_every", "save_every", "hidden_dim", "num_critics",
                  "episode_length")  # check_args refuses them at 0 or less


def check_args(args: Args):
    """Refuse bad flags before any work starts, naming the fix."""
    if args.depth < 2:
        raise ValueError(f"--depth must be at least 2 for FlexLoop's adjacent-depth loss, got {args.depth}")
    if args.lambda_depth < 0:
        raise ValueError(f"--lambda-depth must be >= 0, got {args.lambda_depth}")
    if args.resume and args.init_checkpoint:
        raise ValueError("give either --resume (continue a run) or --init-checkpoint (start post-training), not both")
    if args.backbone == "lstm" and args.iru_variant != "residual":
        raise ValueError("--iru-variant applies to the IRU backbone only; drop it with --backbone lstm")
    if args.env_id not in ENV_IDS:
        raise ValueError(f"--env-id {args.env_id!r} is not an env of {ALGORITHM}; choose one of {list(ENV_IDS)}")
    for name in POSITIVE_FLAGS:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.policy_temperature <= 0:
        raise ValueError(f"--policy-temperature must be > 0, got {args.policy_temperature}")
    if args.batch_size > args.num_envs:
        raise ValueError(f"--batch-size {args.batch_size} exceeds --num-envs {args.num_envs}: each batch takes one "
                         "transition from each of batch_size distinct envs; lower --batch-size or raise --num-envs")
    if not 0 <= args.future_goal_fraction <= 1:
        raise ValueError("--future-goal-fraction must lie in [0, 1]")
    if not 0 < args.future_discount < 1:
        raise ValueError(f"--future-discount must lie in (0, 1), got {args.future_discount}")
    if args.future_goal_window == 1 or args.future_goal_window < 0:
        raise ValueError(f"--future-goal-window must be 0 (off) or at least 2, got {args.future_goal_window}")
    if args.pretrain_epochs < 0 or args.num_epochs < 0:
        raise ValueError("--pretrain-epochs and --num-epochs must be >= 0")
    pretraining = 0 if args.init_checkpoint or args.teacher_checkpoint else args.pretrain_epochs
    if pretraining + args.num_epochs == 0 and not args.resume:
        raise ValueError("nothing to train: --num-epochs is 0 and there is no pretraining phase "
                         "(--pretrain-epochs 0, or --init-checkpoint / --teacher-checkpoint skips it)")
    if args.ablation == "distill-only" and args.lambda_depth == 0:
        raise ValueError("--ablation distill-only with --lambda-depth 0 trains nothing; give a positive --lambda-depth")
    if args.ablation == "distill-only" and args.depth_target != "adjacent":
        raise ValueError("--ablation distill-only always distils the pretrained full-depth policy; drop --depth-target")
    if args.bellman_weight < 0:
        raise ValueError(f"--bellman-weight must be >= 0, got {args.bellman_weight}")
    if args.teacher_checkpoint is not None:
        if args.init_checkpoint:
            raise ValueError("--teacher-checkpoint trains a student from scratch; it cannot also start from "
                             "--init-checkpoint (drop one)")
        if args.ablation != "none":
            raise ValueError("--teacher-checkpoint is FlexLoop from scratch; combine it with --ablation none only")
        if args.num_epochs == 0:
            raise ValueError("--teacher-checkpoint skips pretraining, so --num-epochs must be positive")


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


class IRUNetwork(nn.Module):
    """Q(s, g, a) read out after each of K recurrent steps of an IRU (below), for an ensemble of critics:
        x_emb  = LayerNorm(Linear(concat[obs, goal, onehot(a)]))
        Q_k    = Head(h)                  after step k (paper variant: Head(c))
    The state is a tuple of tensors shaped (critics, batch, actions, d): all 6 actions of a state go through
    at once. The embedding's action part is a row of the weight, so Linear(concat[s, g, onehot(a)]) =
    Linear_sg(concat[s, g]) + W_a[a], computed once per state. The policy pi_k = softmax(Q_k / tau):
        logits = decide(state)            pi_k's logits, Q_k / tau
        all_depths(obs, goal)             Q of every depth at once, (K, critics, batch, actions)
        act(logits, generator)            actions from pi_k's logits, sampled as in training
        policy_logits(obs, goal, k)       decide's logits after k steps, from the inputs (acting)

    The IRU step k -> k + 1 and the rest of the depth protocol, the same in every script (eval_adaptive.py uses it):
        z     = LayerNorm(concat[x_emb, h])            (paper variant: concat[x_emb, tanh(c)])
        f     = sigmoid(Linear_forget(z)),  i = tanh(Linear_input(z))      (forget-gate bias initialised to +1)
        c     = f * c + (1 - f) * i
        h     = h + tanh(c)                              (residual across steps)
        state = start(obs, goal)          depth 0: (x_emb, c = 0, h = 0)
        state = advance(state)            the IRU step
        state = state_after(obs, goal, k) start, then k steps
        divergence(p_logits, q_logits)    KL(p || q) per row: the training loss and delta_k at inference
        gather(state, rows)               the recurrent state of some batch rows (adaptive inference)
    """

    def __init__(self, depth=5, hidden_dim=256, num_critics=2, variant="residual", policy_temperature=0.25,
                 init_alpha=1.0, obs_encoding="codes", num_actions=NUM_ACTIONS):
        super().__init__()
        self.depth, self.hidden_dim, self.num_critics, self.variant = depth, hidden_dim, num_critics, variant
        self.num_actions, self.policy_temperature, self.obs_encoding = num_actions, policy_temperature, obs_encoding
        obs_dim = NUM_CELLS * (NUM_CODES if obs_encoding == "onehot" else 1)
        self.embed = EnsembleLinear(num_critics, 2 * obs_dim + num_actions, hidden_dim)
        self.embed_norm = EnsembleLayerNorm(num_critics, hidden_dim)
        self.gate_norm = EnsembleLayerNorm(num_critics, 2 * hidden_dim)
        self.gates = EnsembleLinear(num_critics, 2 * hidden_dim, 2 * hidden_dim)  # forget and input gates, one matmul
        with torch.no_grad():
            self.gates.bias[..., :hidden_dim] = 1.0  # forget-gate bias +1: remember by default
        self.head = EnsembleLinear(num_critics, hidden_dim, 1)
        # The exploration temperature travels with the network so evaluation acts exactly as training did.
        self.log_alpha = nn.Parameter(torch.tensor(math.log(init_alpha)))

    def start(self, obs, goal, action=None):
        """Depth 0 for all actions, or with `action` (B,) for that action alone: (critics, batch, 1, d)."""
        state_goal = torch.cat([obs, goal], -1)
        if self.obs_encoding == "onehot":
            state_goal = F.one_hot(state_goal.long(), NUM_CODES).flatten(1)
        state_goal = state_goal.float()  # by default the codes as numbers, as in the reference
        sg_weight, action_weight = self.embed.weight[:, :-self.num_actions], self.embed.weight[:, -self.num_actions:]
        x = torch.bmm(state_goal.expand(self.num_critics, -1, -1), sg_weight)
        x = x + self.embed.bias.to(x.dtype)  # (E, B, d)
        if action is None:
            x = x[:, :, None, :] + action_weight[:, None, :, :]  # (E, B, A, d)
        else:
            x = (x + action_weight[:, action])[:, :, None, :]  # (E, B, 1, d)
        x_emb = self.embed_norm(x)
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

    def decide(self, state):
        return self.q_values(state).mean(0) / self.policy_temperature

    def q_values(self, state):
        """Q of the current depth for every critic: (E, B, A)."""
        return self.read_heads(self.readout(state))

    def read_heads(self, readout):
        """Q from readouts whose first dimension is the critics. In float32 also under --bf16: the Q values feed
        the TD target and a softmax at a small temperature, where bf16's 3 digits would show."""
        with torch.autocast(readout.device.type, enabled=False):
            return self.head(readout.float())[..., 0]

    def all_depths(self, obs, goal, action=None):
        """Q of every depth, (K, E, B, A); with `action` (B,), Q at that action alone, (K, E, B, 1). The head reads
        the K states stacked, so it is one matmul over all depths (forward and backward) instead of K small ones."""
        state = self.start(obs, goal, action)
        readouts = []
        for _ in range(self.depth):
            state = self.advance(state)
            readouts.append(self.readout(state))
        stacked = torch.stack(readouts, 1)  # (E, K, B, A, d): the head's critics stay the first dimension
        return self.read_heads(stacked).transpose(0, 1)

    def state_after(self, obs, goal, depth):
        """The recurrent state after `depth` steps, without reading the heads on the way."""
        state = self.start(obs, goal)
        for _ in range(depth):
            state = self.advance(state)
        return state

    def full_depth(self, obs, goal):
        """The heads at depth K alone, without the shallower ones."""
        state = self.state_after(obs, goal, self.depth)
        return self.q_values(state)  # (E, B, A)

    def policy_logits(self, obs, goal, depth):
        """decide's logits after `depth` steps, from the inputs: acting, the part torch.compile can fuse into few
        kernels (act's sampling stays outside, since a draw from a named torch.Generator breaks a compiled graph)."""
        return self.decide(self.state_after(obs, goal, depth))

    @staticmethod
    def divergence(p_logits, q_logits):
        """KL(p || q) between the categorical policies softmax(p_logits) and softmax(q_logits), per row."""
        p_log = F.log_softmax(p_logits, -1)
        return (p_log.exp() * (p_log - F.log_softmax(q_logits, -1))).sum(-1)

    @staticmethod
    def gather(state, rows):
        return tuple(t[:, rows] for t in state)

    def act(self, logits, generator=None):
        """Sample from softmax(Q / alpha), the training-time exploration policy (Gumbel-max, no host sync)."""
        q = logits * self.policy_temperature
        uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp_(1e-12, 1.0)
        return (q / self.log_alpha.exp() - torch.log(-torch.log(uniform))).argmax(-1)


class LSTMNetwork(IRUNetwork):
    """The same network with an LSTM cell in place of the IRU cell, unrolled over depth for a fixed input
    (the paper's LSTM backbones, §5.4):

        i, f, g, o = Linear(concat[x_emb, h])            (forget-gate bias initialised to +1)
        c          = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h          = sigmoid(o) * tanh(c)                  (the heads read h)

    The input embedding, the heads, the state (x_emb, c, h) and the depth protocol are the IRU's. Per critic,
    LSTM-184 has about as many parameters as IRU-256 (287k against 285k with the default inputs); LSTM-256 has
    about twice as many."""

    def __init__(self, depth=5, hidden_dim=256, num_critics=2, policy_temperature=0.25, init_alpha=1.0,
                 obs_encoding="codes", num_actions=NUM_ACTIONS):
        # variant "residual": the inherited q_values reads h, the LSTM's output
        super().__init__(depth, hidden_dim, num_critics, "residual", policy_temperature, init_alpha, obs_encoding,
                         num_actions)
        self.gates = EnsembleLinear(num_critics, 2 * hidden_dim, 4 * hidden_dim)  # input, forget, cell, output
        del self.gate_norm  # a plain LSTM cell: no normalisation inside
        with torch.no_grad():
            self.gates.bias[..., hidden_dim:2 * hidden_dim] = 1.0

    def advance(self, state):
        x_emb, c, h = state
        input_gate, forget_gate, cell, output_gate = self.gates(torch.cat([x_emb, h], -1)).chunk(4, -1)
        c = torch.sigmoid(forget_gate) * c + torch.sigmoid(input_gate) * torch.tanh(cell)
        h = torch.sigmoid(output_gate) * torch.tanh(c)
        return x_emb, c, h


def build_network(args: Args, device):
    network_args = dict(depth=args.depth, hidden_dim=args.hidden_dim, num_critics=args.num_critics,
                        policy_temperature=args.policy_temperature, init_alpha=args.init_alpha,
                        obs_encoding=args.obs_encoding)
    network = LSTMNetwork(**network_args) if args.backbone == "lstm" else \
        IRUNetwork(variant=args.iru_variant, **network_args)
    return (init_like_flax(network) if args.init == "flax" else network).to(device)


def network_from_checkpoint(checkpoint, device="cpu"):
    """Rebuild the network from a checkpoint alone (used by eval_adaptive.py)."""
    args = flexloop_run.args_from_checkpoint(Args, checkpoint)
    network = build_network(args, device)
    network.load_state_dict(checkpoint["model"])
    return network, args


def init_like_flax(network):
    """flax.linen's default init, as the reference leaves it: every kernel lecun_normal (a normal of variance
    1 / fan_in truncated at 2 standard deviations), every bias 0; then the forget-gate bias +1 again."""
    with torch.no_grad():
        for layer in network.modules():
            if hasattr(layer, "in_features"):  # a Linear layer: its kernel and bias
                std = (1 / layer.in_features) ** 0.5 / 0.87962566103423978  # flax's truncation correction
                nn.init.trunc_normal_(layer.weight, std=std, a=-2 * std, b=2 * std)
                nn.init.zeros_(layer.bias)
        forget = slice(network.hidden_dim, 2 * network.hidden_dim) if isinstance(network, LSTMNetwork) \
            else slice(0, network.hidden_dim)
        network.gates.bias[..., forget] = 1.0
    return network


def load_teacher(args, device):
    """The output-only teacher of FlexLoop from scratch: a separate, frozen network built from its own
    checkpoint (any depth, width or backbone). Only its Q-values are read; no optimiser holds it and its
    weights are never copied into the student, whose checkpoints do not hold them either."""
    checkpoint = flexloop_run.load_checkpoint(args.teacher_checkpoint, ALGORITHM)
    if checkpoint["env_id"] != args.env_id:
        raise ValueError(f"--teacher-checkpoint was trained on {checkpoint['env_id']} but this run is on "
                         f"{args.env_id}; pass --env-id {checkpoint['env_id']}")
    teacher, _ = network_from_checkpoint(checkpoint, device)
    return teacher.requires_grad_(False)


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: losses
# ---------------------------------------------------------------------------------------------------------
# flexloop_losses' terms: metrics, NaN checks and checkpoints read these
LOSS_NAMES = ("losses/td_loss", "losses/depth_kl", "losses/alpha_loss", "charts/policy_entropy",
              "losses/bellman_loss")


def flexloop_depth_loss(logits_per_depth, target="adjacent"):
    """mean_{k=1..K-1} KL(sg[pi_{k+1}] || pi_k) from logits (K, B, A); with target="final",
    mean_{k=1..K-1} KL(sg[pi_K] || pi_k) instead.

    The deeper policy is the target (detached), so only the shallower depth moves towards it."""
    deeper = logits_per_depth[1:] if target == "adjacent" else logits_per_depth[-1:].expand_as(logits_per_depth[:-1])
    kl = IRUNetwork.divergence(deeper.detach(), logits_per_depth[:-1])  # (K-1, B)
    return kl.mean()


def per_depth_td_loss(q_taken, y):
    """TD_k = sum over critics of mean_batch (Q_k(s, g, a) - y)^2, for every depth: (K,). q_taken is Q at the
    taken action, (K, E, B); y is (B,), or one target per depth (K, 1, B)."""
    return ((q_taken - y) ** 2).mean(-1).sum(-1)


def taken_action(q_per_depth, action):
    """Q at each row's taken action, (K, E, B, A) -> (K, E, B)."""
    rows = torch.arange(action.shape[0], device=action.device)
    return q_per_depth[:, :, rows, action]


def td_depth_weights(ablation, depth):
    """How much the TD loss of each depth 1..K counts: K alone (FlexLoop, pretraining), every depth equally
    (AnyK-TD), or none (Distill Only)."""
    if ablation == "anyk-td":
        return [1.0 / depth] * depth
    return [0.0] * (depth - 1) + [0.0 if ablation == "distill-only" else 1.0]


def bellman_refinement_loss(q_taken, target_q_next, reward, gamma):
    """Appendix C.1: mean_{k=1..K-2} of TD(Q_{k+1}(s, g, a), sg[y_k]), y_k = r + gamma * max_a' mean_critics
    Q_target,k(s', g, a'): each extra step refines the target network's previous depth by one Bellman backup.
    The paper's rho is taken to be the squared error of the TD loss. Zero when K = 2 (no such depths)."""
    depth = q_taken.shape[0]
    if depth < 3:
        return q_taken.new_zeros(())
    y = reward + gamma * target_q_next[:depth - 2].mean(1).max(-1).values  # (K-2, B): y_1 .. y_{K-2}
    return per_depth_td_loss(q_taken[1:depth - 1], y[:, None]).mean()


def td_target(target_q_next, rewards, gamma):
    """r + gamma * max_a' mean_critics Q_target(s', g, a'), from the full-depth target Q (E, B, A)."""
    return rewards + gamma * target_q_next.mean(0).max(-1).values


def flexloop_losses(network, target_network, batch, args, lambda_depth, td_weights, teacher=None,
                    all_action_gradients=True, pretrained=None):
    """The loss of one update on a batch and its terms by LOSS_NAMES, as device tensors (no host sync):

        td        sum_k w_k TD_k with w = td_weights (K,) and the target y = r + gamma * max_a' mean_critics
                  Q(s', g, a'), Q the target network's at depth K, or the teacher's full-depth Q when given
        depth_kl  the depth KL (args.depth_target: adjacent or final); with `pretrained` (Distill Only),
                  mean_{k=1..K} KL(sg[pi_K of the frozen pretrained network] || pi_k) instead: depth K is pulled
                  too, since without a TD loss nothing else holds the full-depth policy in place
        bellman   the inter-depth Bellman refinement on depths 1..K-2 (with a teacher only; else 0)
        alpha     the temperature loss (entropy: a statistic)
    and the loss td + lambda_depth * depth_kl + bellman_weight * bellman + alpha.

    Only the depth KL needs gradients at all 6 actions. With all_action_gradients=False (a phase with
    lambda_depth = 0) the online critic runs as the reference's dqn_interp.py runs it: with gradient at the
    taken action alone, and over all 6 actions without gradient for the temperature's entropy (and the KL,
    then a statistic). The loss and its gradient are the same; the backward pass is 6x smaller.
    """
    on_gpu = batch["obs"].device.type == "cuda"  # bf16 autocast is for GPUs: on a CPU it is slower than float32
    autocast = lambda: torch.autocast("cuda", torch.bfloat16, enabled=args.bf16 and on_gpu)  # noqa: E731
    obs, goal, action = batch["obs"], batch["goal"], batch["action"]
    with torch.no_grad(), autocast():
        bootstrap_q = target_network.full_depth(batch["next_obs"], goal) if teacher is None else \
            teacher.full_depth(batch["next_obs"], goal)  # only the teacher's outputs
    y = td_target(bootstrap_q, batch["reward"], args.gamma)
    with torch.set_grad_enabled(all_action_gradients and torch.is_grad_enabled()), autocast():
        q_per_depth = network.all_depths(obs, goal)  # (K, E, B, A)
    with autocast():  # Q at the taken actions, (K, E, B): read from all actions', or computed for them alone
        q_taken = taken_action(q_per_depth, action) if all_action_gradients else \
            network.all_depths(obs, goal, action)[..., 0]
    td = (td_weights * per_depth_td_loss(q_taken, y)).sum()
    logits_per_depth = q_per_depth.mean(1) / args.policy_temperature  # pi_k = softmax(mean_critics Q_k / tau)
    if pretrained is None:
        depth_kl = flexloop_depth_loss(logits_per_depth, args.depth_target)
    else:
        with torch.no_grad(), autocast():
            pretrained_logits = pretrained.full_depth(obs, goal).mean(0) / args.policy_temperature  # (B, A)
        depth_kl = IRUNetwork.divergence(pretrained_logits.expand_as(logits_per_depth), logits_per_depth).mean()
    bellman = q_taken.new_zeros(())
    if teacher is not None:  # the student's own target network, every depth, for the inter-depth Bellman loss
        with torch.no_grad(), autocast():
            target_q_next = target_network.all_depths(batch["next_obs"], goal)
        bellman = bellman_refinement_loss(q_taken, target_q_next, batch["reward"], args.gamma)
    # Temperature: push the entropy of softmax(Q_K / alpha) towards -target_entropy, state by state (the reference).
    q_full = q_per_depth[-1].mean(0).detach()
    log_policy = F.log_softmax(q_full / network.log_alpha.exp(), -1)
    entropy = -(log_policy.exp() * log_policy).sum(-1)  # (B,)
    alpha = ((entropy + args.target_entropy) ** 2).mean() if args.alpha_loss == "per-state" else \
        (entropy.mean() + args.target_entropy) ** 2  # batch-mean
    loss = td + lambda_depth * depth_kl + args.bellman_weight * bellman + alpha
    return loss, dict(zip(LOSS_NAMES, (td, depth_kl, alpha, entropy.mean(), bellman)))


def make_update(args, network, target_network, optimizer, replay, generator, lambda_depth, loss_sums,
                td_weights=None, teacher=None, all_action_gradients=True, pretrained=None):
    """One update: sample a relabelled batch, the losses of `flexloop_losses`, Adam, Polyak. No host sync,
    fixed shapes: it can be captured in a CUDA graph. lambda_depth and td_weights are device tensors filled
    per phase (td_weights defaults to depth K alone); the teacher and the pretrained network (Distill Only) are only
    ever read. all_action_gradients=False is the faster update of a phase whose lambda_depth is 0 (see
    `flexloop_losses`)."""
    if td_weights is None:
        td_weights = torch.tensor(td_depth_weights("none", args.depth), device=lambda_depth.device)

    def update():
        batch = replay.sample(args.batch_size, generator)
        loss, terms = flexloop_losses(network, target_network, batch, args, lambda_depth, td_weights, teacher,
                                      all_action_gradients, pretrained)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            torch._foreach_lerp_(list(target_network.parameters()), list(network.parameters()), args.tau)
            loss_sums.add_(torch.stack([terms[name] for name in LOSS_NAMES]).detach())
        return batch  # (static outputs when captured: the test that each replay draws a fresh batch reads them)

    return update


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: data
# ---------------------------------------------------------------------------------------------------------
class TrajectoryReplay:
    """Episodes stored per env as int8 grids: observations (envs, episodes, L + 1, 36) and actions. A batch
    takes batch_size distinct envs and one transition (episode, t) from each. Goals are relabelled: a
    future_goal_fraction of rows take the state at t + j of the same episode, j >= 1 with probability proportional
    to future_discount^j (truncated at the episode's end, and with future_goal_window > 1 also at the end of a
    window of that many stored steps, as the reference's replay reads them); the rest take another row's current
    state. Rewards are recomputed against the new goal with the env's own rule."""

    def __init__(self, num_envs, episodes, episode_length, device, future_goal_fraction=0.5, future_discount=0.99,
                 future_goal_window=0):
        self.num_envs, self.capacity, self.episode_length, self.device = num_envs, episodes, episode_length, device
        self.future_goal_fraction, self.future_discount = future_goal_fraction, future_discount
        self.future_goal_window = future_goal_window
        self.observations = torch.zeros(num_envs, episodes, episode_length + 1, NUM_CELLS, dtype=torch.int8,
                                        device=device)
        self.actions = torch.zeros(num_envs, episodes, episode_length, dtype=torch.int8, device=device)
        self.lengths = torch.zeros(num_envs, episodes, dtype=torch.long, device=device)  # valid transitions
        self.episodes_stored = torch.zeros((), dtype=torch.long, device=device)  # a tensor: read inside graphs
        self.next_slot = 0

    def add(self, observations, actions, lengths):
        """One episode per env: observations (envs, L + 1, 36), actions (envs, L), lengths (envs,)."""
        self.observations[:, self.next_slot] = observations
        self.actions[:, self.next_slot] = actions
        self.lengths[:, self.next_slot] = lengths
        self.next_slot = (self.next_slot + 1) % self.capacity
        self.episodes_stored.clamp_(max=self.capacity - 1).add_(1)

    def sample(self, batch_size, generator):
        device = self.device
        env = torch.rand(self.num_envs, generator=generator, device=device).argsort()[:batch_size]  # distinct
        episode = (torch.rand(batch_size, generator=generator, device=device) * self.episodes_stored).long()
        length = self.lengths[env, episode]
        t = (torch.rand(batch_size, generator=generator, device=device) * length).long()
        obs = self.observations[env, episode, t]
        next_obs = self.observations[env, episode, t + 1]
        action = self.actions[env, episode, t].long()

        # Future offsets: truncated geometric on 1..(length - t) by inverse CDF.
        horizon = (length - t).float()
        if self.future_goal_window:  # the sample's place p in a window that is independent of its episode's start
            place = torch.randint(0, self.future_goal_window - 1, (batch_size,), generator=generator, device=device)
            horizon = torch.minimum(horizon, (self.future_goal_window - 1 - place).float())
        q = self.future_discount
        u = torch.rand(batch_size, generator=generator, device=device)
        offset = 1 + torch.floor(torch.log1p(-u * (1 - q ** horizon)) / math.log(q))
        offset = torch.minimum(offset, horizon).long()
        future_goal = self.observations[env, episode, t + offset]
        # Random goals: the current state of another row (a shift of 1..B-1 never lands on itself).
        shift = torch.randint(1, max(batch_size, 2), (1,), generator=generator, device=device)
        other_goal = obs[(torch.arange(batch_size, device=device) + shift) % batch_size]
        use_future = torch.arange(batch_size, device=device) < round(self.future_goal_fraction * batch_size)
        goal = torch.where(use_future[:, None], future_goal, other_goal)
        reward = goal_reached(next_obs, goal)
        return dict(obs=obs, action=action, next_obs=next_obs, goal=goal, reward=reward,
                    env=env, episode=episode, t=t, offset=offset, use_future=use_future)


# ---------------------------------------------------------------------------------------------------------
# Collection and per-depth evaluation
# ---------------------------------------------------------------------------------------------------------
def make_envs(args, device):
    """One vector env for collection, and one per split for evaluation."""
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=args.seed, split="train", check_actions=False,
                        episode_length=args.episode_length, quarter_filter=args.quarter_filter).unwrapped
    eval_envs = {split: envs.make_vec(args.env_id, args.num_eval_envs, device=device, seed=args.seed + 1000 + i,
                                      split=split, episode_length=args.episode_length, check_actions=False).unwrapped
                 for i, split in enumerate(["train", "unseen"])}
    return env, eval_envs


@torch.no_grad()
def run_episode(network, env, depth, generator, policy_logits=None):
    """One episode in every env from a fresh reset, acting at `depth`. Returns the trajectories and the
    end-of-episode statistics as device tensors (no host sync). `policy_logits` is network.policy_logits (the
    default) or, in training on a GPU, its compiled form."""
    policy_logits = policy_logits or network.policy_logits
    obs, _ = env.reset()
    observations, actions = [obs["observation"]], []
    alive = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
    length = torch.zeros(env.num_envs, dtype=torch.long, device=env.device)
    success = torch.zeros(env.num_envs, device=env.device)
    boxes = torch.zeros(env.num_envs, device=env.device)
    for _ in range(env.episode_length):
        action = network.act(policy_logits(obs["observation"], obs["desired_goal"], depth), generator)
        obs, reward, terminated, truncated, info = env.step(action)
        observations.append(info["final_obs"]["observation"])
        actions.append(action.to(torch.int8))
        # An env whose episode ended early (quarter filter) keeps its first episode's statistics.
        ended = alive & info["episode_done"]
        length = torch.where(alive, length + 1, length)
        success = torch.where(ended, info["episode_success"], success)
        boxes = torch.where(ended, info["episode_boxes_on_target"], boxes)
        alive = alive & ~info["episode_done"]
    return torch.stack(observations, 1), torch.stack(actions, 1), length, success, boxes


def cells_changed(observations, lengths):
    """Per episode, how many cells differ between its first and last observation once the agent is removed: 0 when
    no box was moved, 2 for a box carried from one cell to another. Its mean falling to 0 during training means
    exploration has collapsed: no box-moving goals enter the replay any more (docs/results/boxpick.md)."""
    last = observations[torch.arange(observations.shape[0], device=observations.device), lengths]
    return (remove_agent(last) != remove_agent(observations[:, 0])).sum(-1)


@torch.no_grad()
def evaluate(network, eval_envs, seed):
    """Success and boxes on target at every depth 1..K on each split: one episode per env, actions sampled as in
    training, on the same tasks and with the same sampling noise at every depth (the env and the sampler are
    reseeded; the splits draw different tasks), as device tensors."""
    results = {}
    for split, env in eval_envs.items():
        for depth in range(1, network.depth + 1):
            env.generator.manual_seed(seed)
            generator = torch.Generator(env.device).manual_seed(seed)
            _, _, _, success, boxes = run_episode(network, env, depth, generator)
            results[f"eval/{split}/success_depth_{depth}"] = success.mean()
            results[f"eval/{split}/boxes_on_target_depth_{depth}"] = boxes.mean()
    return results


def format_eval(results, args, iteration):
    lines = [f"iteration {iteration} success by depth 1..{args.depth}:"]
    for split in ["train", "unseen"]:
        values = " ".join(f"{results[f'eval/{split}/success_depth_{k}']:.3f}" for k in range(1, args.depth + 1))
        lines.append(f"  {split:7s} {values}")
    return "\n".join(lines)


def train(args: Args):
    # The flags checked (a resumed run's own), checkpoints read, the device picked, seeds set: flexloop_run.py
    run = flexloop_run.Run(sys.modules[__name__], args)
    args, device = run.args, run.device
    env, eval_envs = make_envs(args, device)
    network = build_network(args, device)
    if run.init is not None:
        network.load_state_dict(run.init["model"])
    lambda_depth = torch.zeros((), device=device)  # a tensor, which the captured updates read
    loss_sums = torch.zeros(len(LOSS_NAMES), device=device)  # summed on the device between logs
    generators = {"actions": torch.Generator(device).manual_seed(args.seed), "env": env.generator,
                  "replay": torch.Generator(device).manual_seed(args.seed + 1)}
    target_network = copy.deepcopy(network).requires_grad_(False)
    teacher = load_teacher(args, device) if args.teacher_checkpoint else None  # FlexLoop from scratch
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, capturable=device.type == "cuda")
    replay = TrajectoryReplay(args.num_envs, args.replay_episodes, args.episode_length, device,
                              args.future_goal_fraction, args.future_discount, args.future_goal_window)
    td_weights = torch.zeros(args.depth, device=device)  # the TD loss's weight per depth, set per phase

    # Phases: IRU-K pretraining (lambda = 0) unless a pretrained network or a teacher was given, then FlexLoop,
    # whose TD term is as --ablation says. From the flags, not run.init: a resumed run started from one has none.
    pretrain_epochs = 0 if args.init_checkpoint or teacher is not None else args.pretrain_epochs
    phases = [("pretrain", pretrain_epochs * args.intervals_per_epoch, 0.0),
              ("flexloop", args.num_epochs * args.intervals_per_epoch, args.lambda_depth)]
    phase_td_weights = {"pretrain": torch.tensor(td_depth_weights("none", args.depth), device=device),
                        "flexloop": torch.tensor(td_depth_weights(args.ablation, args.depth), device=device)}
    # Distill Only's teacher: a frozen copy of the network as FlexLoop starts (the --init-checkpoint model, else
    # made at the switch). A resumed run's is loaded into it; checkpoints hold it as "pretrained_model".
    distill_only = args.ablation == "distill-only"
    resumed_one = (run.checkpoint or {}).get("pretrained_model") is not None
    has_pretrained = distill_only and (run.init is not None or resumed_one)
    pretrained = copy.deepcopy(network).requires_grad_(False) if has_pretrained else None
    parts = {"model": network, "target_model": target_network, "optimizer": optimizer, "pretrained_model": pretrained}
    run.begin(phases, parts, generators, loss_sums, steps_per_iteration=args.num_envs * args.episode_length,
              updates_per_iteration=args.updates_per_rollout, progress="updates")
    # One training episode in every env at full depth, replayed from a CUDA graph on a GPU, the policy compiled.
    collect = run.graphed(run_episode, [generators["actions"], env.generator], network, env, args.depth,
                          generators["actions"], run.compiled(network.policy_logits))
    updates_by_phase = {}  # one update per phase: a phase with lambda = 0 needs no gradient at untaken actions
    evaluate_now = partial(evaluate, network, eval_envs)

    with run:
        while run.running():
            phase, lam = run.phase()
            lambda_depth.fill_(lam)
            td_weights.copy_(phase_td_weights[phase])  # device to device: no host sync
            if phase == "flexloop" and distill_only and pretrained is None:  # a two-phase run: the IRU-K at the switch
                pretrained = parts["pretrained_model"] = copy.deepcopy(network).requires_grad_(False)
            with run.interruptible():  # a stop ends a long CPU collection at once
                observations, actions, lengths, success, _ = collect()
            replay.add(observations, actions, lengths)

            if phase not in updates_by_phase:  # made at the phase's first iteration, once the replay holds data
                update = make_update(args, network, target_network, optimizer, replay, generators["replay"],
                                     lambda_depth, loss_sums, td_weights, teacher, all_action_gradients=lam > 0,
                                     pretrained=pretrained if phase == "flexloop" else None)
                updates_by_phase[phase] = run.graphed_update(run.compiled(update), [generators["replay"]])
            for _ in run.update_steps(args.updates_per_rollout):
                updates_by_phase[phase]()
            if not run.end_iteration():
                break  # stopped mid-iteration (SIGTERM, Ctrl-C): finish() writes latest.pt

            if run.log_due():
                run.log({"charts/lambda_depth": lam, "charts/alpha": network.log_alpha.exp(),
                         "charts/train_success": success.mean(),
                         "charts/cells_changed": cells_changed(observations, lengths).float().mean()})
            if run.evaluate_due():
                run.evaluate(evaluate_now, args.seed + 1000)
            run.save_due()
        run.evaluate_if_owed(evaluate_now, args.seed + 1000)  # resumed after a stop in the final evaluation
    return run.finish()  # final.pt, or latest.pt after a stop


if __name__ == "__main__":
    with flexloop_run.errors_in_one_line():
        train(flexloop_run.parse_args(Args, description=__doc__))
