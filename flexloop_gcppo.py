"""FlexLoop post-training of an IRU GC-PPO on LightsOut-4x5 (one file, CleanRL style):
    python flexloop_gcppo.py                                           # pretrain IRU-5, then FlexLoop
    python flexloop_gcppo.py --init-checkpoint runs/X/pretrained.pt   # FlexLoop from a pretrained IRU-5

The actor and the critic share one IRU trunk. The loss is PPO's at the full depth K plus
    lambda_depth * mean_{k<K} KL(sg[pi_{k+1}] || pi_k)
on the minibatch states, where pi_k is the actor read out after k recurrent steps (docs/reference.md: the IRU, LightsOut).
In the FlexLoop phase the value loss regresses V_K onto a frozen teacher's values V_teacher(s, g) instead of
the GAE returns; the policy loss keeps the GAE advantages from the student's own values. The teacher is the
--init-checkpoint model, or in a two-phase run (no --init-checkpoint) the pretrained model at the switch.

Copy and modify: copy this file, change it and run the copy; eval_adaptive.py rebuilds the copy's checkpoints with the
copy's own network. Its stopping rule calls the network's `divergence` method, so a copy that changes the depth loss's
D should change `divergence` to match, and changing `divergence` changes the rule.
"""

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import envs
import flexloop_run
from envs.lightsout import NUM_LIGHTS, SPLITS


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
    log_every: int = 1
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
    env_id: str = "LightsOut-4x5-v0"
    """the env id (LightsOut-4x5-v0)"""
    max_episode_steps: int = 20
    """an episode ends on success or after this many steps"""
    train_max_presses: int = 9
    """largest minimal-solution length of training tasks (the reference's 9; lower it for an easier stream)"""


@dataclass
class NetworkArgs:
    """network"""
    depth: int = 5
    """K, the number of recurrent steps of the IRU"""
    iru_variant: Literal["residual", "paper"] = "residual"
    """residual: the public code (gates and heads read h = sum tanh(c)); paper: the paper's equation (tanh(c), c)"""
    backbone: Literal["iru", "lstm"] = "iru"
    """iru: the IRU cell; lstm: an LSTM cell unrolled over depth (the paper's backbone ablation, §5.4)"""
    hidden_dim: int = 64
    """IRU width d of the trunk that the actor and the critic share"""
    init: Literal["cleanrl", "flax"] = "cleanrl"
    """cleanrl: PyTorch's Linear init, orthogonal heads at 0.01 (actor) and 1.0 (critic) (ours); flax: flax's
    defaults, lecun_normal kernels and zero biases everywhere (the authors' lightsout/models/ppo.py). Both set
    the forget-gate bias to +1. Ours stays the default: with --adam-eps 1e-8 the authors' init reached 0.38
    full-depth success at 50M against 0.51 (docs/results/lightsout.md)"""


@dataclass
class AlgorithmArgs:
    """algorithm: GC-PPO"""
    pretrain_timesteps: int = 50_000_000
    """IRU-K pretraining env steps (lambda = 0) when no --init-checkpoint is given"""
    total_timesteps: int = 50_000_000
    """FlexLoop post-training env steps"""
    num_envs: int = 2048
    """parallel envs, stepped together on the device"""
    num_steps: int = 160
    """steps per env per rollout: each iteration collects num_envs x num_steps env steps"""
    num_minibatches: int = 32
    """minibatches per update epoch"""
    update_epochs: int = 8
    """passes over each rollout"""
    learning_rate: float = 1e-4
    """Adam learning rate (constant)"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    norm_adv: bool = True
    """normalise the advantages (where: --advantage-norm)"""
    advantage_norm: Literal["minibatch", "rollout"] = "rollout"
    """with --norm-adv: once over the whole rollout before the epochs (the authors' lightsout/ppo.py, the default)
    or per minibatch (CleanRL's). The authors' choice is the default because ours showed no gain (with
    --hard-reset-every and --minibatch-layout: docs/results/lightsout.md)"""
    minibatch_layout: Literal["rows", "time-rows"] = "time-rows"
    """time-rows: whole time steps of all envs, num_steps / num_minibatches steps per minibatch, reshuffled every
    epoch (the authors' code: 5 steps x 2048 envs; the default, see --advantage-norm); rows: random (step, env)
    rows (CleanRL's)"""
    obs_norm_update: Literal["after-epochs", "before-epochs"] = "after-epochs"
    """when the running obs normaliser takes in a rollout: after its update epochs (ours: each update's first
    ratio is exactly 1), or before them and before the bootstrap values of GAE (the authors' code). Ours stays the
    default: before-epochs reached 0.39 full-depth success at 50M against 0.51 (docs/results/lightsout.md)"""
    timeout_bootstrap: Literal["value", "zero"] = "value"
    """a step truncated at max_episode_steps bootstraps from V(final obs) (ours; the value cannot see the clock),
    or from 0, as at a success (the authors' code in effect: its auto-reset wrapper replaces the state's info with
    the reset's, so the `truncation` flag its GAE reads is always 0 and a time-out counts as a termination)"""
    hard_reset_every: int = 3
    """every this many iterations, reset every env to a fresh task, cutting the episodes in flight; the obs
    normaliser is kept (the authors' code: 3, from num_reset_steps = 50 over 152 iterations, the default, see
    --advantage-norm; 0: never, CleanRL's)"""
    clip_coef: float = 0.3
    """PPO's surrogate clipping coefficient (also clips the value change when clip_vloss)"""
    clip_vloss: bool = True
    """clipped value loss (CleanRL's default, ours). The authors' code does not clip it; with no gradient clipping
    either, that reached 0.39 full-depth success at 50M against our 0.51 (docs/results/lightsout.md)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient (CleanRL's default; the paper gives none)"""
    max_grad_norm: float = 0.5
    """gradient clipping norm (CleanRL's default, ours; the paper gives none). The authors' code does not clip
    (--max-grad-norm inf); see --clip-vloss for the screen that kept ours"""
    adam_eps: float = 1e-5
    """Adam's epsilon (CleanRL's 1e-5, ours; the authors' code uses optax's default, 1e-8; screened with --init)"""
    obs_clip: float = 10.0
    """normalised inputs are clipped to [-obs_clip, obs_clip]"""
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
    lambda_depth: float = 0.05
    """weight of the adjacent-depth KL on the minibatch states (0 = plain IRU-K training)"""
    teacher_value_targets: bool = True
    """in the FlexLoop phase, regress V_K onto a frozen teacher's values instead of the GAE returns (paper); the
    teacher is the --init-checkpoint model, or in a two-phase run the pretrained model at the switch"""


@dataclass
class EvaluationArgs:
    """evaluation"""
    num_eval_envs: int = 128
    """envs per split for evaluation (one deterministic episode each, the same tasks at every depth)"""
    eval_every: int = 10
    """evaluate every depth on both splits every this many iterations (and at the end of each phase)"""


@dataclass
class PerformanceArgs:
    """performance: device and speed"""
    cuda: bool = True
    """use CUDA when it is available (see --require-cuda to make its absence an error)"""
    require_cuda: bool = False
    """fail instead of falling back to CPU when no GPU is present"""
    cuda_graph: bool = True
    """capture the rollout, its GAE targets and the update in CUDA graphs and replay them (GPU only;
    --no-cuda-graph runs them eagerly)"""
    compile: bool = True
    """torch.compile the minibatch update and the rollout's policy pass on GPU (ignored on CPU, where it does not
    pay). With --cuda-graph the compiled update made the loop 4x the eager one on an H100 (docs/benchmarks.md); the
    LightsOut results' runs ran eagerly, as --no-compile --no-cuda-graph --no-fused-iru runs"""
    combo_kernels: bool = True
    """with --compile, let inductor fuse independent kernels side by side (its combo_kernels option): 8% more env
    steps/s in bench/ppo_throughput.py on an H200 (see --fused-iru)"""
    compile_env_step: bool = True
    """with --compile, compile the rollout's whole step (the policy pass, the action's sampling, the env step and
    the buffer writes) instead of the policy pass alone: around the policy, a step is 85 separate PyTorch
    operations uncompiled. 1.10x the env steps/s in bench/ppo_throughput.py on an H200 (see --fused-iru)"""
    fused_iru: bool = True
    """run the K IRU steps as two Triton kernels, one forward and one backward (flexloop_kernels.py), in place of
    several PyTorch kernels a step, where they run: a Hopper GPU (H100, H200), the residual IRU at a hidden width
    of 16-64. Elsewhere the PyTorch steps run, and on a GPU the run says why at its start. With --compile-env-step
    and --combo-kernels: 2.46M env steps/s in pretraining on an H200 and 2.22M in FlexLoop on an H100, and three
    50M-step runs of each phase learned as three without them (docs/benchmarks.md)"""


@dataclass
class Args(PerformanceArgs, EvaluationArgs, FlexLoopArgs, AlgorithmArgs, NetworkArgs, EnvironmentArgs, ExperimentArgs):
    """Every flag, flat (args.lambda_depth). --help shows them in the groups above (see parse_args)."""


# What the run plumbing (flexloop_run.py) needs to know about this script.
FLEXLOOP_SCRIPT = "flexloop-script-v1"  # marks a FlexLoop script: eval_adaptive.py imports no other file
ENV_FLAG = "env_id"  # the flag naming the env: run names, checkpoints and --init-checkpoint checks read it
RESUME_FLAGS = ("resume", "cuda", "require_cuda", "save_every_minutes", "debug")  # --resume takes these as given
ALGORITHM = "gcppo"
NETWORK_FLAGS = ("depth", "hidden_dim", "iru_variant", "backbone")  # an --init-checkpoint must match
CHECKPOINT_PARTS = ("model", "teacher_model", "optimizer")  # the state dicts in a checkpoint (no teacher: None)
GPU_SIZED_FLAGS = ("num_envs", "num_steps", "pretrain_timesteps", "total_timesteps")  # their defaults need a GPU
PRETRAINING_ONLY = dict(lambda_depth=0.0, total_timesteps=0, init_checkpoint=None)  # what iru_pretrain.py fixes
ENV_IDS = (envs.LIGHTSOUT_ID,)  # what check_args accepts
POSITIVE_FLAGS = ("num_envs", "num_steps", "num_minibatches", "update_epochs", "hidden_dim", "num_eval_envs",
                  "eval_every", "log_every", "save_every", "max_episode_steps", "learning_rate", "clip_coef",
                  "adam_eps")  # check_args refuses them at 0 or less


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


def fused_iru_off_because(args: Args, device):
    """Why --fused-iru's kernels cannot run here (None: they can)."""
    device = torch.device(device)
    if args.backbone != "iru" or args.iru_variant != "residual":
        return "they run the residual IRU's steps only"
    if args.hidden_dim not in (16, 32, 64):
        return f"they hold the gate weights in one program, at a hidden width of 16, 32 or 64, not {args.hidden_dim}"
    if device.type != "cuda":
        return "they are GPU kernels"
    if torch.cuda.get_device_capability(device)[0] != 9:  # flexloop_kernels.py: the backward needs 184,320 bytes
        return (f"their blocks are sized for a Hopper GPU's shared memory (H100, H200); this GPU is "
                f"{torch.cuda.get_device_name(device)}")
    return None


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: network
# ---------------------------------------------------------------------------------------------------------
class IRUNetwork(nn.Module):
    """pi_k(a | s, g) and V_k(s, g) read out after each of K recurrent steps of one shared IRU (below):
        x      = clip((concat[obs, goal] - running mean) / running std)     (40 inputs)
        x_emb  = LayerNorm(Linear(x))
        logits_k = Actor(h),  V_k = Value(h)   after step k (paper variant: read c)
    With fused_steps set (--fused-iru: flexloop_kernels.iru_steps), all_depths and full_depth run the residual
    steps as two Triton kernels, one forward and one backward, and their states hold h alone.
    The state is a tuple of tensors shaped (batch, d). The running mean and variance of the inputs are buffers,
    so checkpoints and evaluation carry them. The policy pi_k = softmax(logits_k):
        logits = decide(state)            pi_k's logits (20)
        all_depths(obs, goal)             logits (K, B, 20) and values (K, B) of every depth at once
        act(logits, generator, deterministic=False)   a sample of pi_k, or its mode (evaluation)
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
            self.gates.bias[..., :hidden_dim] = 1.0  # forget-gate bias +1: remember by default
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
        """Fold a batch of raw inputs into the running mean and variance (Chan et al.'s parallel update). Written
        in place: a rollout replayed from a CUDA graph reads these tensors."""
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
        """The recurrent feature the heads read: h (paper variant: c)."""
        _, c, h = state
        return h if self.variant == "residual" else c

    def decide(self, state):
        return self.actor(self.readout(state))

    def value(self, state):
        return self.critic(self.readout(state)).squeeze(-1)

    fused_steps = None  # with --fused-iru, flexloop_kernels.iru_steps: h of every depth from x_emb, (K, B, hidden)

    def all_depths(self, obs, goal):
        """The heads at every depth: logits (K, B, A) and values (K, B). They read the K states stacked, so each
        head is one matmul over all depths (forward and backward) instead of K small ones."""
        if self.fused_steps is not None:  # the states with h alone, which the heads read
            stacked = None, None, self.fused_steps(self.start(obs, goal)[0], self.gate_norm, self.gates, self.depth)
            return self.decide(stacked), self.value(stacked)
        state = self.start(obs, goal)
        states = []
        for _ in range(self.depth):
            state = self.advance(state)
            states.append(state)
        stacked = tuple(torch.stack(part) for part in zip(*states))  # (x_emb, c, h), each (K, B, hidden)
        return self.decide(stacked), self.value(stacked)

    def state_after(self, obs, goal, depth):
        """The recurrent state after `depth` steps, without reading the heads on the way."""
        state = self.start(obs, goal)
        for _ in range(depth):
            state = self.advance(state)
        return state

    def full_depth(self, obs, goal):
        """The heads at depth K alone, without the shallower ones."""
        if self.fused_steps is not None:  # h alone, which the heads read
            state = None, None, self.fused_steps(self.start(obs, goal)[0], self.gate_norm, self.gates, self.depth)[-1]
        else:
            state = self.state_after(obs, goal, self.depth)
        return self.decide(state), self.value(state)  # logits (B, A), values (B,)

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
        return tuple(t[rows] for t in state)

    @staticmethod
    def act(logits, generator=None, deterministic=False):
        """A sample of softmax(logits) (Gumbel-max, no host sync), or its mode when deterministic."""
        if deterministic:
            return logits.argmax(-1)
        uniform = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(1e-12, 1.0)
        return (logits - torch.log(-torch.log(uniform))).argmax(-1)


class LSTMNetwork(IRUNetwork):
    """The same network with an LSTM cell in place of the IRU cell, unrolled over depth for a fixed input
    (the paper's LSTM backbones, §5.4):

        i, f, g, o = Linear(concat[x_emb, h])            (forget-gate bias initialised to +1)
        c          = sigmoid(f) * c + sigmoid(i) * tanh(g)
        h          = sigmoid(o) * tanh(c)                  (the heads read h)

    The input embedding, the heads, the state (x_emb, c, h) and the depth protocol are the IRU's."""

    def __init__(self, depth=5, hidden_dim=64, obs_clip=10.0, input_dim=2 * NUM_LIGHTS, num_actions=NUM_LIGHTS):
        # variant "residual": the inherited readout is h, the LSTM's output
        super().__init__(depth, hidden_dim, "residual", obs_clip, input_dim, num_actions)
        self.gates = nn.Linear(2 * hidden_dim, 4 * hidden_dim)  # input, forget, cell, output
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
    """The network for this device. --fused-iru is on by default: where its kernels cannot run, the PyTorch steps
    do, a GPU run says why, and args.fused_iru becomes False, so the checkpoint and W&B record what ran."""
    network_args = dict(depth=args.depth, hidden_dim=args.hidden_dim, obs_clip=args.obs_clip)
    network = LSTMNetwork(**network_args) if args.backbone == "lstm" else \
        IRUNetwork(variant=args.iru_variant, **network_args)
    why_not_fused = args.fused_iru and fused_iru_off_because(args, device)
    if why_not_fused and torch.device(device).type == "cuda":
        flexloop_run.say(f"the IRU steps run in PyTorch, not as --fused-iru's kernels: {why_not_fused}")
    args.fused_iru = args.fused_iru and not why_not_fused
    if args.fused_iru:  # the K steps as Triton kernels, the teacher's too (frozen_copy copies the network)
        import flexloop_kernels
        network.fused_steps = flexloop_kernels.iru_steps
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


def frozen_copy(network):
    """The teacher: a copy that no optimiser or normaliser update touches."""
    return copy.deepcopy(network).requires_grad_(False).eval()


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: losses
# ---------------------------------------------------------------------------------------------------------
# flexloop_losses' terms: metrics, NaN checks and checkpoints read these
LOSS_NAMES = ("losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/depth_kl", "losses/approx_kl",
              "losses/clipfrac")


def flexloop_depth_loss(logits_per_depth, target="adjacent"):
    """mean_{k=1..K-1} KL(sg[pi_{k+1}] || pi_k) from logits (K, B, A); with target="final",
    mean_{k=1..K-1} KL(sg[pi_K] || pi_k) instead.

    The deeper policy is the target (detached), so only the shallower depth moves towards it."""
    deeper = logits_per_depth[1:] if target == "adjacent" else logits_per_depth[-1:].expand_as(logits_per_depth[:-1])
    kl = IRUNetwork.divergence(deeper.detach(), logits_per_depth[:-1])  # (K-1, B)
    return kl.mean()


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


def flexloop_losses(network, minibatch, args, lambda_depth, every_depth=True):
    """The loss of one minibatch update and its terms by LOSS_NAMES, as device tensors (no host sync): PPO's
    losses at depth K (policy, value, entropy bonus) plus lambda_depth * the depth KL. every_depth=False is
    pretraining's update (lambda_depth 0): the heads at depth K alone, as IRU-K trains, with the depth KL not
    computed (it reads 0)."""
    if every_depth:
        logits, values = network.all_depths(minibatch["obs"], minibatch["goal"])  # (K, B, A), (K, B)
        depth_kl = flexloop_depth_loss(logits, args.depth_target)
        logits, values = logits[-1], values[-1]
    else:
        logits, values = network.full_depth(minibatch["obs"], minibatch["goal"])  # (B, A), (B,)
        depth_kl = values.new_zeros(())
    policy_loss, value_loss, entropy, approx_kl, clipfrac = ppo_loss(
        logits, values, minibatch["actions"], minibatch["logprobs"], minibatch["values"],
        minibatch["advantages"], minibatch["value_targets"], args.clip_coef, args.clip_vloss,
        args.norm_adv and args.advantage_norm == "minibatch")
    loss = policy_loss - args.ent_coef * entropy + args.vf_coef * value_loss + lambda_depth * depth_kl
    return loss, dict(zip(LOSS_NAMES, (policy_loss, value_loss, entropy, depth_kl, approx_kl, clipfrac)))


def make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums, every_depth=True):
    """One minibatch update: the rows minibatch_index of the rollout, the losses of `flexloop_losses`, gradient
    clipping, Adam. No host sync, fixed shapes: it can be captured in a CUDA graph."""
    flat = {name: tensor.flatten(0, 1) for name, tensor in buffers.items()}  # views: (T * N, ...)

    def update():
        minibatch = {name: flat[name][minibatch_index]
                     for name in ("obs", "goal", "actions", "logprobs", "values", "advantages", "value_targets")}
        loss, terms = flexloop_losses(network, minibatch, args, lambda_depth, every_depth)
        optimizer.zero_grad(set_to_none=False)
        loss.backward()
        nn.utils.clip_grad_norm_(network.parameters(), args.max_grad_norm)
        optimizer.step()
        loss_sums.add_(torch.stack([terms[name] for name in LOSS_NAMES]).detach())

    return update


# ---------------------------------------------------------------------------------------------------------
# ALGO LOGIC: data
# ---------------------------------------------------------------------------------------------------------
def make_rollout_buffers(num_steps, num_envs, device):
    """(T, N, ...) tensors, allocated once so a captured update can read them."""
    lights = lambda: torch.zeros(num_steps, num_envs, NUM_LIGHTS, device=device)  # noqa: E731
    steps = lambda dtype=torch.float32: torch.zeros(num_steps, num_envs, dtype=dtype, device=device)  # noqa: E731
    return dict(obs=lights(), goal=lights(), final_obs=lights(), final_goal=lights(), actions=steps(torch.long),
                logprobs=steps(), values=steps(), rewards=steps(), terminated=steps(torch.bool),
                truncated=steps(torch.bool), advantages=steps(), value_targets=steps())


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


def epoch_order(layout, num_steps, num_envs, generator, device):
    """One epoch's order of the flattened (T * N) rollout rows (row t * N + n is step t of env n); consecutive
    slices of it are the minibatches. rows: a random permutation of all rows. time-rows: a random permutation
    of the time steps, each step's N rows kept together, so a minibatch holds whole time steps of every env."""
    if layout == "rows":
        return torch.randperm(num_steps * num_envs, generator=generator, device=device)
    steps = torch.randperm(num_steps, generator=generator, device=device)
    return (steps[:, None] * num_envs + torch.arange(num_envs, device=device)).flatten()


def minibatch_order(args, generator, device):
    """The rollout rows of each update of one iteration, (update_epochs * num_minibatches, minibatch size): a
    fresh epoch_order per epoch, cut into minibatches."""
    return torch.stack([epoch_order(args.minibatch_layout, args.num_steps, args.num_envs, generator, device)
                        for _ in range(args.update_epochs)]).view(args.update_epochs * args.num_minibatches, -1)


# ---------------------------------------------------------------------------------------------------------
# Collection and per-depth evaluation
# ---------------------------------------------------------------------------------------------------------
def make_envs(args, device):
    """One vector env for collection, and one per split for evaluation."""
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=args.seed, split="train", check_actions=False,
                        max_steps=args.max_episode_steps, max_presses=args.train_max_presses).unwrapped
    eval_envs = {split: envs.make_vec(args.env_id, args.num_eval_envs, device=device, split=split,
                                      max_steps=args.max_episode_steps, check_actions=False).unwrapped
                 for split in ["train", "unseen"]}
    return env, eval_envs


@torch.no_grad()
def rollout_step(network, env, obs, row, generator, episode_sums, forward=None):
    """One step of every env with the depth-K policy: writes the step's inputs, action, log-probability, value,
    reward and end flags into row (each buffer's slice for this step), adds the episodes that ended to
    episode_sums (4,: count, successes, returns, lengths, on the device) and returns the next obs (the envs
    auto-reset). forward is network.full_depth, or that pass compiled; train() compiles either the policy pass
    alone or, with --compile-env-step, the whole step."""
    row["obs"].copy_(obs["observation"])
    row["goal"].copy_(obs["desired_goal"])
    logits, value = (forward or network.full_depth)(obs["observation"], obs["desired_goal"])
    action = network.act(logits, generator)
    row["actions"].copy_(action)
    row["logprobs"].copy_(F.log_softmax(logits, -1).gather(-1, action[:, None]).squeeze(-1))
    row["values"].copy_(value)
    obs, reward, terminated, truncated, info = env.step(action)
    row["rewards"].copy_(reward)
    row["terminated"].copy_(terminated)
    row["truncated"].copy_(truncated)
    row["final_obs"].copy_(info["final_obs"]["observation"])
    row["final_goal"].copy_(info["final_obs"]["desired_goal"])
    done = info["episode_done"].float()
    episode_sums += torch.stack([done.sum(), (done * info["episode_success"]).sum(),
                                 (done * info["episode_return"]).sum(), (done * info["episode_length"]).sum()])
    return obs


@torch.no_grad()
def collect_rollout(network, env, obs, buffers, generator, episode_sums, step=rollout_step):
    """num_steps steps of every env (rollout_step, or that step compiled), written into buffers. Continues from
    obs and returns the obs after the last step."""
    for t in range(buffers["obs"].shape[0]):
        obs = step(network, env, obs, {name: buffer[t] for name, buffer in buffers.items()}, generator,
                   episode_sums)
    return obs


def compiled_rollout_step(compile, network, whole_step):
    """rollout_step with compile (train(): run.compiled, torch.compile with --compile on a GPU) applied to the whole
    step (--compile-env-step) or to its policy pass alone."""
    if whole_step:
        return compile(rollout_step)
    forward = compile(network.full_depth)
    return lambda *step_args: rollout_step(*step_args, forward=forward)


def make_rollout(network, env, obs, buffers, generator, episode_sums, step=rollout_step):
    """collect_rollout from obs that writes the obs after its last step back into obs: every tensor it reads or
    writes keeps its address, so the whole rollout can be captured in one CUDA graph and replayed, drawing fresh
    actions and tasks from its registered generators at every replay.

    The capture runs its warm-up calls for real. train() captures with one warm-up call, in the first iteration,
    and that call is the iteration's rollout: learned from and counted as any other, while the capture itself
    runs nothing. So no env step goes unused or uncounted, and episode_sums holds no extra rollout."""
    def rollout():
        copy_obs(obs, collect_rollout(network, env, obs, buffers, generator, episode_sums, step))

    return rollout


def copy_obs(obs, new_obs):
    """Write new_obs into obs's tensors (the static obs a captured rollout reads)."""
    for key, tensor in obs.items():
        tensor.copy_(new_obs[key])


def rollout_metrics(buffers, episode_sums):
    """The statistics of the episodes finished since the last log (episode_sums is reset) and how much of the
    value targets' variance the values explain."""
    episodes = episode_sums[0].clamp(min=1)
    targets, values = buffers["value_targets"], buffers["values"]
    metrics = {"charts/episodes": episode_sums[0].clone(), "charts/train_success": episode_sums[1] / episodes,
               "charts/episodic_return": episode_sums[2] / episodes,
               "charts/episodic_length": episode_sums[3] / episodes,
               "losses/explained_variance": 1 - (targets - values).var() / targets.var()}
    episode_sums.zero_()
    return metrics


@torch.no_grad()
def evaluation_episode(network, env, depth, success):
    """Every env plays one episode at `depth` with the deterministic (argmax) policy, from a fresh task of the
    env's generator; success (num_envs,) is set where it reached the goal. Fixed shapes, no host sync: it can be
    captured in a CUDA graph."""
    obs, _ = env.reset()
    alive = torch.ones(env.num_envs, dtype=torch.bool, device=env.device)
    solved = torch.zeros_like(alive)
    for _ in range(env.max_steps):
        logits = network.policy_logits(obs["observation"], obs["desired_goal"], depth)
        obs, _, terminated, truncated, _ = env.step(network.act(logits, deterministic=True))
        solved |= alive & terminated
        alive &= ~(terminated | truncated)
    success.copy_(solved)


def make_evaluate(network, eval_envs, cuda_graph=False):
    """evaluate(seed): deterministic success at every depth 1..K on each split, one episode per env, on the same
    tasks at every depth (the env's generator is reseeded before each; the splits draw different tasks), as
    device tensors. With cuda_graph each split and depth's episode is captured at the first evaluation, whose one
    warm-up call is that evaluation's episode, and replayed after: reseeding the generator before a replay gives
    the eager episode's tasks."""
    success = {(split, depth): torch.zeros(env.num_envs, dtype=torch.bool, device=env.device)
               for split, env in eval_envs.items() for depth in range(1, network.depth + 1)}
    captured = {}

    def evaluate(seed):
        results = {}
        for (split, depth), solved in success.items():
            env = eval_envs[split]
            env.generator.manual_seed(seed)
            if (split, depth) in captured:
                captured[(split, depth)]()
            elif cuda_graph:  # the capture calls the episode now (its warm-up and its recording), never later
                episode = lambda: evaluation_episode(network, env, depth, solved)  # noqa: E731
                captured[(split, depth)] = flexloop_run.capture_cuda_graph(episode, [env.generator], warmup=1)
            else:
                evaluation_episode(network, env, depth, solved)
            results[f"eval/{split}/success_depth_{depth}"] = solved.float().mean()
        return results

    return evaluate


def evaluate(network, eval_envs, seed):
    """make_evaluate's evaluation, eager, once."""
    return make_evaluate(network, eval_envs)(seed)


def format_eval(results, args, iteration):
    """Training draws tasks of at most --train-max-presses presses, and evaluation covers each whole split: the
    header and the row labels say which tasks each number is over."""
    lines = [f"iteration {iteration} success by depth 1..{args.depth} (training tasks: at most "
             f"{args.train_max_presses} press{'es' if args.train_max_presses > 1 else ''}; evaluated on every split's "
             "tasks):"]
    for split in ["train", "unseen"]:
        values = " ".join(f"{results[f'eval/{split}/success_depth_{k}']:.3f}" for k in range(1, args.depth + 1))
        low, high = SPLITS[split]
        lines.append(f"  {f'{split} ({low}-{high} presses)':23s} {values}")
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
                  "minibatch": torch.Generator(device).manual_seed(args.seed + 1)}
    # The teacher of the FlexLoop phase's value targets: the --init-checkpoint model, else made at the switch.
    has_teacher = run.init is not None or (run.checkpoint or {}).get("teacher_model") is not None
    teacher = frozen_copy(network) if has_teacher else None  # a resumed run's is loaded into it
    on_cuda = device.type == "cuda"  # fused: one multi-tensor Adam kernel; capturable: replayable in a CUDA graph
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, eps=args.adam_eps, capturable=on_cuda,
                                 fused=on_cuda)
    buffers = make_rollout_buffers(args.num_steps, args.num_envs, device)
    batch_size = args.num_envs * args.num_steps
    minibatch_index = torch.zeros(batch_size // args.num_minibatches, dtype=torch.long, device=device)
    episode_sums = torch.zeros(4, device=device)  # finished episodes: count, successes, returns, lengths

    # Phases in whole rollouts. From the flags, not run.init: a resumed run started from a checkpoint has none.
    phases = [("pretrain", (0 if args.init_checkpoint else args.pretrain_timesteps) // batch_size, 0.0),
              ("flexloop", args.total_timesteps // batch_size, args.lambda_depth)]
    parts = {"model": network, "teacher_model": teacher, "optimizer": optimizer}
    run.begin(phases, parts, generators, loss_sums, steps_per_iteration=batch_size,
              updates_per_iteration=args.update_epochs * args.num_minibatches, progress="env steps")
    obs, _ = env.reset()  # the rollout reads and writes these tensors in place (a captured graph reads them)
    rollout = make_rollout(network, env, obs, buffers, generators["actions"], episode_sums,
                           compiled_rollout_step(run.compiled, network, args.compile_env_step))
    graphed_rollout, graphed_targets, updates_by_phase = None, {}, {}  # the updates: one per phase
    evaluate_now = make_evaluate(network, eval_envs, run.cuda_graph)  # on a GPU, each depth's episode a CUDA graph

    with run:
        while run.running():
            phase, lam = run.phase()
            lambda_depth.fill_(lam)
            if phase == "flexloop" and teacher is None:  # a two-phase run: the pretrained model at the switch
                teacher = parts["teacher_model"] = frozen_copy(network)
            if graphed_rollout is not None:
                graphed_rollout()
            elif run.cuda_graph:  # its one warm-up call is this iteration's rollout (make_rollout says why)
                graphed_rollout = flexloop_run.capture_cuda_graph(rollout, [generators["actions"], env.generator],
                                                                  warmup=1)
            else:
                with run.interruptible():  # a stop ends a long CPU collection at once
                    rollout()
            if args.obs_norm_update == "before-epochs":  # the authors' order: GAE and the epochs see its stats
                network.update_normalizer(buffers["obs"].flatten(0, 1), buffers["goal"].flatten(0, 1))
            value_teacher = teacher if phase == "flexloop" and args.teacher_value_targets else None
            if value_teacher not in graphed_targets:  # with the teacher or not; warm-ups rewrite the same targets
                graphed_targets[value_teacher] = run.graphed(prepare_targets, [], network, value_teacher, buffers,
                                                             obs, args)
            graphed_targets[value_teacher]()

            order = minibatch_order(args, generators["minibatch"], device)
            for i in run.update_steps(len(order)):
                minibatch_index.copy_(order[i])
                if phase not in updates_by_phase:  # pretraining's reads depth K alone; captured on its first minibatch
                    update = make_update(args, network, optimizer, buffers, minibatch_index, lambda_depth, loss_sums,
                                         every_depth=phase == "flexloop")
                    updates_by_phase[phase] = run.graphed_update(run.compiled(update), [])
                updates_by_phase[phase]()
            if not run.end_iteration():
                break  # stopped mid-iteration (SIGTERM, Ctrl-C): finish() writes latest.pt
            if args.obs_norm_update == "after-epochs":  # ours: the rollout's own ratios start at exactly 1
                network.update_normalizer(buffers["obs"].flatten(0, 1), buffers["goal"].flatten(0, 1))
            if args.hard_reset_every and run.iteration % args.hard_reset_every == 0:
                copy_obs(obs, env.reset()[0])  # fresh tasks for all envs; GAE above bootstrapped from the old obs

            if run.log_due():
                run.log({"charts/lambda_depth": lam, "charts/learning_rate": args.learning_rate,
                         **rollout_metrics(buffers, episode_sums)})
            if run.evaluate_due():
                run.evaluate(evaluate_now, args.seed + 1000)
            run.save_due()
        run.evaluate_if_owed(evaluate_now, args.seed + 1000)  # resumed after a stop in the final evaluation
    return run.finish()  # final.pt, or latest.pt after a stop


if __name__ == "__main__":
    with flexloop_run.errors_in_one_line():
        train(flexloop_run.parse_args(Args, description=__doc__))
