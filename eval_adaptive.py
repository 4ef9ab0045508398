"""Depth elasticity and state-wise adaptive inference of FlexLoop checkpoints (one file, CleanRL style).

    python eval_adaptive.py --checkpoints runs/X/pretrained.pt runs/X/final.pt --labels IRU-5 FlexLoop
    python eval_adaptive.py --checkpoints runs/X/final.pt --stress-envs 1024 32768      # + wall-clock stress test

Reads any checkpoint of flexloop_gcdqn.py (BoxPick), flexloop_gcppo.py (LightsOut) or flexloop_gciql.py (OGBench),
or of a user's copy of one: it rebuilds the network with the `network_from_checkpoint` of the script the checkpoint
names (found next to the checkpoint's run or on the path; --script overrides), and drives it through the depth
protocol (start / advance / decide / divergence / gather / act). It reports:
  1. elasticity: success at every fixed depth 1..K, per split (OGBench: per task);
  2. adaptive inference over an eps grid: success, mean depth, depth histogram, ideal speed-up K / mean depth;
  3. calibration: the largest eps that keeps `--retain` of full-depth success on the train split, reported on unseen;
  4. (--stress-envs) wall clock of whole env steps at full depth against compacted and masked adaptive inference;
  5. analysis: delta_k against D(pi_K, pi_k) in quantile bins, per-step depth traces, BoxPick frames.

The stopping rule (docs/reference.md, adaptive inference): k* = min({k > k_min : delta_k < eps} ∪ {K}), acting with pi_{k*}, where
    delta_k = divergence(pi_k, pi_{k-1}),
the script's own divergence with the deeper policy first: the direction of its training loss KL(sg[pi_{k+1}] || pi_k)
(for GC-DQN delta_k = KL(pi_k || pi_{k-1})). The paper writes D(pi_{k-1}, pi_k) for a generic D. delta_k is clamped
at 0 (a KL of equal policies can round to -1e-9), so eps = 0 always runs to K. With k_min = 0, delta_1 compares
pi_1 with pi_0 = decide(start(obs, goal)), the depth-0 decision.

A copy of a script whose loss changes: this stopping rule calls the copy's network's `divergence` method, so changing
that method changes the rule. Keep it the D of your depth loss, so that training and stopping measure the same thing.
"""

import json
import math
import os
import textwrap
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Literal, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

import envs
from envs.ogbench_data import DATASETS as OGBENCH_DATASETS
# Safe checkpoint reading and one-line errors are the scripts' run plumbing (the same in every flexloop_*.py).
import flexloop_run

# The paper's eps grids (docs/reference.md, adaptive inference, appendix "Pareto Curve").
EPS_GRIDS = {
    "boxpick": (0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1),
    "lightsout": tuple(np.linspace(0.0, 0.05, 11).round(6).tolist()),
    "ogbench-manipulation": tuple(np.linspace(0.0, 0.005, 11).round(7).tolist()),
    "ogbench-navigation": tuple(np.linspace(0.0, 0.05, 11).round(6).tolist()),
}
# The paper's wall-clock anchors (Table 3, BoxPick-Exact-4, 32,768 envs, IRU-5 170.1 ms a step): FlexLoop 133.0 ms
# at mean depth 3.85 on train tasks, 127.4 ms at 3.80 on unseen ones (its headline 1.34x).
PAPER_ANCHORS = {split: {"speedup": round(170.1 / ms, 2), "mean_depth": depth, "depth": 5, "num_envs": 32768,
                         "env_id": "BoxPick-Exact-4-v0", "split": split}
                 for split, ms, depth in (("train", 133.0, 3.85), ("unseen", 127.4, 3.80))}


def paper_anchor(env_id, split):
    """Table 3's row for a stress test on env_id and split, or None off the paper's env."""
    anchor = PAPER_ANCHORS[split]
    return anchor if env_id == anchor["env_id"] else None


@dataclass
class ExperimentArgs:
    checkpoints: tuple[str, ...] = ()
    """checkpoint files to evaluate, all on one env (e.g. runs/X/pretrained.pt runs/X/final.pt)"""
    labels: tuple[str, ...] = ()
    """one name per checkpoint for tables and plots (default: <run folder>/<file stem>)"""
    exp_name: str = "eval_adaptive"
    """the name of this evaluation (part of the output folder's name)"""
    seed: int = 1
    """seed of the evaluation envs and action sampling: the same episodes for every checkpoint, depth and eps, and
    for every training seed's run evaluated with the same value (bench/seed_table.py joins only those)"""
    torch_deterministic: bool = True
    """sets `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """use CUDA when it is available"""
    require_cuda: bool = False
    """fail instead of falling back to CPU when no GPU is present"""
    track: bool = False
    """log the tables and plots to Weights & Biases (honours WANDB_MODE=offline)"""
    wandb_project_name: str = "flexloop"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B entity (team)"""
    wandb_group: Optional[str] = None
    """the W&B group, to compare the runs of one study"""
    wandb_tags: tuple[str, ...] = ()
    """W&B tags"""
    out_dir: Optional[str] = None
    """write results.json and the plots here (default: results/<env>__<exp_name>__<seed>__<time>)"""
    script: Optional[str] = None
    """rebuild every checkpoint's network with this FlexLoop script (default: the script each checkpoint names,
    next to its run or on the import path)"""
    debug: bool = False
    """show the full traceback of an error (also FLEXLOOP_DEBUG=1)"""


@dataclass
class EvaluationArgs:
    num_eval_envs: Optional[int] = None
    """envs per split (default: BoxPick 1024, LightsOut 128) or episodes per task (OGBench, default 50)"""
    eps: tuple[float, ...] = ()
    """stopping thresholds to sweep (default: the paper's grid for the env family, docs/reference.md, adaptive inference)"""
    k_min: int = 1
    """minimum depth: a row can stop at depths k > k_min only (0 <= k_min < K)"""
    retain: float = 0.99
    """calibration: the largest eps whose train success stays >= retain * full-depth train success"""
    analysis_bins: int = 10
    """quantile bins of delta_k for the delta_k vs D(pi_K, pi_k) plot"""
    trace_frames: int = 20
    """BoxPick: rendered grids in the depth-trace strip (the first steps of one episode)"""
    skip_eval: bool = False
    """run only the wall-clock stress test (needs --stress-eps)"""
    eval_async: bool = True
    """OGBench: step the episodes' MuJoCo envs in worker processes, one per core, as the checkpoint's run did
    unless it ran them in one process; --no-eval-async runs them in this process. The episodes are the same
    either way (docs/benchmarks.md)"""
    ogbench_envs: Optional[int] = None
    """OGBench: MuJoCo envs stepped side by side, the policy acting on all of them in one batch (default: on a GPU
    every episode of a task for the maze datasets, whose envs are small; otherwise the checkpoint's run's
    --eval-envs, 50). More envs make fewer, larger policy calls; the episodes are the same"""


@dataclass
class StressArgs:
    """The wall-clock stress test (BoxPick, gcdqn checkpoints)."""
    stress_envs: tuple[int, ...] = ()
    """parallel envs of the stress test, e.g. 1024 32768 (empty: no stress test)"""
    stress_env_id: Optional[str] = None
    """env of the stress test (default: the checkpoints' own; the paper's Table 3 is on BoxPick-Exact-4-v0)"""
    stress_split: Literal["train", "unseen"] = "unseen"
    """task split of the stress test (the paper's Table 3: 1.28x on train, 1.34x on unseen tasks)"""
    stress_eps: Optional[float] = None
    """eps of the stress test (default: each checkpoint's calibrated eps)"""
    stress_mode: tuple[Literal["compact", "masked"], ...] = ("compact", "masked")
    """adaptive inference to time against full depth, taking turns in one run: compacted active rows, masked rows"""
    stress_warmup: int = 100
    """untimed env steps per mode first (one BoxPick episode: compile, capture, bucket sizes settle)"""
    stress_samples: int = 50
    """timing samples per mode (modes take turns, so drift hits all alike)"""
    stress_block: int = 10
    """env steps per timing sample"""
    stress_min_shrink: float = 0.1
    """compact only when at least this fraction of the active rows stopped since the last compaction"""
    stress_bucket_margin: float = 0.05
    """CUDA graphs: compacted sizes are the recent maximum count plus this margin, rounded up to num_envs/32"""
    stress_bucket_window: int = 10
    """CUDA graphs: the recent maximum is over this many steps (bench/bucket_sizes.py counts the padding each costs)"""
    stress_freeze_sizes: bool = True
    """CUDA graphs: capture bucket sizes in the warm-up only; timed steps take the smallest captured sizes that
    hold their counts, so no capture lands in a timed block (the steady state of a long run). The runs timed
    before 2026-11-28 used --no-stress-freeze-sizes, which captures new sizes inside timed blocks too"""
    compile: bool = False
    """torch.compile the network's advance and decide (every mode, the baseline included)"""
    cuda_graph: bool = True
    """replay each whole env step from a CUDA graph (GPU only); compact mode captures one graph per bucket sizes"""


@dataclass
class Args(StressArgs, EvaluationArgs, ExperimentArgs):
    """Every flag, flat (args.eps). --help shows them in the groups above."""


def check_args(args: Args):
    """Refuse bad flags before any work starts, naming the fix."""
    if not args.checkpoints:
        raise ValueError("give at least one checkpoint: --checkpoints runs/<run_name>/final.pt [more.pt ...]")
    if args.labels and len(args.labels) != len(args.checkpoints):
        raise ValueError(f"--labels has {len(args.labels)} names for {len(args.checkpoints)} checkpoints; "
                         "give one label per checkpoint or none")
    if len(set(labels_for(args))) != len(args.checkpoints):
        raise ValueError(f"labels {labels_for(args)} are not distinct; pass --labels with one distinct name each")
    for eps in args.eps + ((args.stress_eps,) if args.stress_eps is not None else ()):
        if not math.isfinite(eps) or eps < 0:
            raise ValueError(f"eps must be a finite number >= 0, got {eps} (eps = 0 means always depth K)")
    if args.k_min < 0:
        raise ValueError(f"--k-min must be >= 0 (and below the checkpoint's depth K), got {args.k_min}")
    if not 0 < args.retain <= 1:
        raise ValueError(f"--retain must lie in (0, 1], got {args.retain}")
    for name in ["analysis_bins", "trace_frames", "stress_warmup", "stress_samples", "stress_block"]:
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ["num_eval_envs", "ogbench_envs"]:
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if any(n <= 0 for n in args.stress_envs):
        raise ValueError(f"--stress-envs must be positive env counts, got {args.stress_envs}")
    if not 0 <= args.stress_min_shrink < 1 or args.stress_bucket_margin < 0:
        raise ValueError("--stress-min-shrink must lie in [0, 1) and --stress-bucket-margin must be >= 0")
    if args.stress_bucket_window < 1:
        raise ValueError(f"--stress-bucket-window must be at least 1 step, got {args.stress_bucket_window}")
    if args.stress_env_id is not None and args.stress_env_id not in envs.BOXPICK_IDS:
        raise ValueError(f"--stress-env-id must be a BoxPick env (the stress test drives gcdqn checkpoints), "
                         f"got {args.stress_env_id!r}; choose one of {list(envs.BOXPICK_IDS)}")
    if args.skip_eval and not args.stress_envs:
        raise ValueError("--skip-eval leaves nothing to do without --stress-envs")
    if args.skip_eval and args.stress_eps is None:
        raise ValueError("--skip-eval has no calibrated eps for the stress test; pass --stress-eps (e.g. 0.02)")
    if args.require_cuda and not torch.cuda.is_available():
        raise flexloop_run.NoGPUError("--require-cuda was given but no CUDA GPU is visible; drop the flag or use "
                                      "--no-cuda")


def labels_for(args: Args):
    """--labels, else the file stems (pretrained, final), else <run folder>/<stem> when stems repeat."""
    if args.labels:
        return list(args.labels)
    stems = [Path(p).stem for p in args.checkpoints]
    if len(set(stems)) == len(stems):
        return stems
    return [f"{Path(p).parent.name}/{Path(p).stem}" for p in args.checkpoints]


def check_k_min(k_min, depth, label):
    if not 0 <= k_min < depth:
        raise ValueError(f"--k-min {k_min} must satisfy 0 <= k_min < K = {depth} for checkpoint {label}; "
                         f"pass --k-min between 0 and {depth - 1}")


def adapter_for(env_id):
    """The adapter of the env family a checkpoint was trained on."""
    if env_id in envs.BOXPICK_IDS:
        return BoxPickAdapter
    if env_id == envs.LIGHTSOUT_ID:
        return LightsOutAdapter
    if env_id in OGBENCH_DATASETS:
        return OGBenchAdapter
    raise ValueError(f"eval_adaptive.py has no evaluation for env {env_id!r}; it evaluates BoxPick, LightsOut-4x5 "
                     "and the OGBench datasets")


# ---------------------------------------------------------------------------------------------------------
# The stopping rule and per-row depth choice. A decision is one tensor with the batch first: logits (B, A), or
# GC-IQL's Gaussian packed as (B, 2, A).
# ---------------------------------------------------------------------------------------------------------
def stopping_depths(deltas, eps, k_min):
    """k* = min({k > k_min : delta_k < eps} ∪ {K}) per row, from deltas (K, B) with deltas[k - 1] = delta_k.

    eps is a number or a per-row tensor (B,). deltas[0] = delta_1 is read only when k_min = 0. Negative deltas
    count as 0, so eps = 0 gives K."""
    depth = deltas.shape[0]
    ks = torch.arange(1, depth + 1, device=deltas.device)[:, None]
    stops = ((deltas.clamp(min=0) < eps) & (ks > k_min)) | (ks == depth)
    return torch.where(stops, ks, depth).amin(0)


@torch.no_grad()
def depth_decisions(network, obs, goal, with_depth_zero=False):
    """The decisions of depths 1..K (and pi_0 first when asked), one recurrent step at a time."""
    state = network.start(obs, goal)
    decisions = [network.decide(state)] if with_depth_zero else []
    for _ in range(network.depth):
        state = network.advance(state)
        decisions.append(network.decide(state))
    return decisions


def adjacent_divergences(network, decisions, decision_0=None):
    """deltas (K, B): deltas[k - 1] = delta_k = divergence(pi_k, pi_{k-1}); delta_1 is inf unless pi_0 is given."""
    first = network.divergence(decisions[0], decision_0) if decision_0 is not None else \
        torch.full(decisions[0].shape[:1], math.inf, device=decisions[0].device)
    return torch.stack([first] + [network.divergence(decisions[k], decisions[k - 1]) for k in range(1, len(decisions))])


class DepthChoice:
    """Each row's depth in evaluation episodes whose rows follow different policies: a fixed depth {"depth": k}
    or the stopping rule {"eps": e} (with k_min). policy_index (B,) names the policy of each row.

    It computes every depth for every row (K recurrent steps), so the choice is exact and the analysis can record
    delta_k and D(pi_K, pi_k) of the rows that follow `record_policy`; the stress test's compacted_policy is the
    version that saves work."""

    def __init__(self, network, policies, k_min=1, record_policy=None):
        self.network, self.policies, self.k_min, self.record_policy = network, policies, k_min, record_policy
        self.num_policies = len(policies)
        self.fixed = torch.tensor([p.get("depth", 0) for p in policies])  # 0: adaptive
        self.eps = torch.tensor([float(p.get("eps", 0.0)) for p in policies])
        self.with_depth_zero = k_min == 0 and any("eps" in p for p in policies)
        self.recorded = []

    @torch.no_grad()
    def __call__(self, obs, goal, policy_index):
        network, K = self.network, self.network.depth
        decisions = depth_decisions(network, obs, goal, self.with_depth_zero)
        decision_0 = decisions.pop(0) if self.with_depth_zero else None
        deltas = adjacent_divergences(network, decisions, decision_0)
        fixed, eps = self.fixed.to(obs.device)[policy_index], self.eps.to(obs.device)[policy_index]
        depth = torch.where(fixed > 0, fixed, stopping_depths(deltas, eps, self.k_min))
        rows = torch.arange(depth.shape[0], device=depth.device)
        decision = torch.stack(decisions)[depth - 1, rows]
        if self.record_policy is not None and K > 2:  # delta_k and the distance to the endpoint, k = 2..K-1
            endpoint = torch.stack([network.divergence(decisions[-1], decisions[k]) for k in range(1, K - 1)])
            self.recorded.append((deltas[1:K - 1].clamp(min=0), endpoint.clamp(min=0),
                                  (policy_index == self.record_policy).expand(K - 2, -1)))
        return decision, depth

    def recorded_pairs(self):
        """(delta_k, D(pi_K, pi_k)) of every recorded row and depth, on the CPU (one sync, after the episodes)."""
        if not self.recorded:
            return torch.zeros(0), torch.zeros(0)
        deltas, endpoint, mask = (torch.cat([r[i].flatten() for r in self.recorded]).cpu() for i in range(3))
        return deltas[mask], endpoint[mask]


def count_depths(counts, index):
    """counts[index] += 1 per row (index_add: no host sync, capturable in a CUDA graph)."""
    return counts.index_add_(0, index, torch.ones_like(index, dtype=counts.dtype))


# ---------------------------------------------------------------------------------------------------------
# Family adapters: the eval envs of a split (or task), episodes in which row blocks follow different policies.
# run(group, choice) returns, per policy, {"success", "depth_counts", "trace"}; trace(group, choice) is one
# episode's per-step depths under the single policy of `choice`.
# ---------------------------------------------------------------------------------------------------------
class BoxPickAdapter:
    """gcdqn on BoxPick: torch vector envs; 100-step episodes that never end early; success = reward 1 at the
    episode's last step; actions sampled from softmax(Q / alpha) by network.act, as training evaluates.
    Every policy plays the same num_envs tasks: one block of envs per policy, reset from the same grids."""

    family = "boxpick"
    groups = ("train", "unseen")

    def __init__(self, module, network, train_args, env_id, args, device):
        self.network, self.env_id, self.device = network, env_id, device
        self.episode_length = getattr(train_args, "episode_length", 100)
        self.num_envs = args.num_eval_envs or 1024
        self.seed = args.seed

    def eps_grid(self):
        return EPS_GRIDS["boxpick"]

    def make_env(self, group, num_envs):
        return envs.make_vec(self.env_id, num_envs, device=self.device, split=group,
                             seed=self.seed + 1000 + self.groups.index(group), episode_length=self.episode_length,
                             check_actions=False).unwrapped

    @torch.no_grad()
    def run(self, group, choice):
        P, N, K = choice.num_policies, self.num_envs, self.network.depth
        tasks = self.make_env(group, N)
        tasks.reset()
        env = self.make_env(group, P * N)
        obs, _ = env.reset(options={"grid": tasks.grid.repeat(P, 1)})
        policy_index = torch.arange(P, device=self.device).repeat_interleave(N)
        first_rows = torch.arange(P, device=self.device) * N  # each block's first env is traced
        goals = obs["desired_goal"][first_rows].clone()
        generator = torch.Generator(self.device).manual_seed(self.seed + 2)
        counts = torch.zeros(P * K, device=self.device)
        trace_depths, trace_grids = [], []
        for _ in range(env.episode_length):
            trace_grids.append(env.grid[first_rows].clone())
            decision, depth = choice(obs["observation"], obs["desired_goal"], policy_index)
            obs, _, _, _, info = env.step(self.network.act(decision, generator))
            count_depths(counts, policy_index * K + depth - 1)
            trace_depths.append(depth[first_rows])
        success = info["episode_success"].view(P, N)
        depths, grids = torch.stack(trace_depths, 1).tolist(), torch.stack(trace_grids, 1).tolist()
        return [{"success": s, "depth_counts": c,
                 "trace": {"depths": d, "episode_success": e, "grids": g, "goal": goal}}
                for s, c, d, e, g, goal in zip(success.mean(1).tolist(), counts.view(P, K).tolist(), depths,
                                               success[:, 0].tolist(), grids, goals.tolist())]

    def trace(self, group, choice):
        return self.run(group, choice)[0]["trace"]

    def close(self):
        pass


class LightsOutAdapter:
    """gcppo on LightsOut-4x5: torch vector envs; an episode ends on success (terminated) or fails when truncated
    at 20 steps; deterministic argmax actions, as the reference evaluates. Each env's first episode counts, and
    every policy plays the same tasks (one block of envs per policy)."""

    family = "lightsout"
    groups = ("train", "unseen")

    def __init__(self, module, network, train_args, env_id, args, device):
        self.network, self.env_id, self.device = network, env_id, device
        self.max_steps = getattr(train_args, "max_episode_steps", 20)
        self.num_envs = args.num_eval_envs or 128
        self.seed = args.seed

    def eps_grid(self):
        return EPS_GRIDS["lightsout"]

    def make_env(self, group, num_envs):
        return envs.make_vec(self.env_id, num_envs, device=self.device, split=group,
                             seed=self.seed + 1000 + self.groups.index(group), max_steps=self.max_steps,
                             check_actions=False).unwrapped

    @torch.no_grad()
    def run(self, group, choice):
        P, N, K = choice.num_policies, self.num_envs, self.network.depth
        tasks = self.make_env(group, N)
        tasks.reset()
        env = self.make_env(group, P * N)
        obs, _ = env.reset(options={"board": tasks.board.repeat(P, 1), "goal": tasks.goal.repeat(P, 1)})
        policy_index = torch.arange(P, device=self.device).repeat_interleave(N)
        first_rows = torch.arange(P, device=self.device) * N
        counts = torch.zeros(P * K, device=self.device)
        alive = torch.ones(P * N, dtype=torch.bool, device=self.device)
        success = torch.zeros(P * N, device=self.device)
        trace_depths, trace_alive = [], []
        for _ in range(env.max_steps):
            decision, depth = choice(obs["observation"], obs["desired_goal"], policy_index)
            obs, _, _, _, info = env.step(self.network.act(decision, deterministic=True))
            counts.index_add_(0, policy_index * K + depth - 1, alive.float())  # first episodes only
            trace_depths.append(depth[first_rows])
            trace_alive.append(alive[first_rows])
            ended = alive & info["episode_done"]
            success = torch.where(ended, info["episode_success"], success)
            alive = alive & ~info["episode_done"]
        success = success.view(P, N)
        depths, steps = torch.stack(trace_depths, 1).tolist(), torch.stack(trace_alive, 1).sum(1).tolist()
        return [{"success": s, "depth_counts": c, "trace": {"depths": d[:n], "episode_success": e}}
                for s, c, d, n, e in zip(success.mean(1).tolist(), counts.view(P, K).tolist(), depths, steps,
                                         success[:, 0].tolist())]

    def trace(self, group, choice):
        return self.run(group, choice)[0]["trace"]

    def close(self):
        pass


TRACE_TRIES = 10  # OGBench: episodes tried per task for a successful one to trace


class OGBenchAdapter:
    """gciql on OGBench: the dataset's 5 evaluation tasks, episodes run side by side by flexloop_gciql.rollout
    (its vector env, its episode seeds; success = the final info['success']), mean actions via network.act."""

    family = "ogbench"
    groups = ("task1", "task2", "task3", "task4", "task5")

    def __init__(self, module, network, train_args, env_id, args, device):
        from envs.ogbench_data import envs_are_small, get_spec
        for name in ("rollout", "make_eval_vector_env"):
            if not hasattr(module, name):
                raise AttributeError(f"{module.__name__}.py has no `{name}`; eval_adaptive.py runs OGBench episodes "
                                     "through the script's rollout(policy_fn, vector_env, task_ids, episodes, "
                                     "num_policies, seed) and make_eval_vector_env(env_name, num_envs, async_envs)")
        self.module, self.network, self.env_id, self.device = module, network, env_id, device
        self.spec = get_spec(env_id)
        self.episodes = args.num_eval_envs or getattr(train_args, "eval_episodes", 50)
        # a policy call costs about the same from 50 to 800 rows on a GPU but by the row on a CPU, and a
        # manipulation env takes about 160 MB (docs/benchmarks.md): a GPU steps every episode of a task side by side
        # where the envs are small, otherwise the run's envs
        all_at_once = torch.device(device).type == "cuda" and envs_are_small(env_id)
        self.num_envs = args.ogbench_envs or (None if all_at_once else getattr(train_args, "eval_envs", None) or 50)
        self.async_envs = args.eval_async and getattr(train_args, "eval_async", True)
        self.seed = args.seed
        self.vector_env = None

    def eps_grid(self):
        return EPS_GRIDS[f"ogbench-{self.spec.family}"]

    def run(self, group, choice):
        return self.rollout(group, choice)[0]

    @torch.no_grad()
    def rollout(self, group, choice, episodes=None, first_episode=0):
        """Per-policy results, the depths of row 0 at every step, and the success array (P, episodes). The
        episodes are the task's episodes first_episode, first_episode + 1, ... (each its own seed)."""
        P, K = choice.num_policies, self.network.depth
        if self.vector_env is None:
            self.num_envs = self.num_envs or self.episodes * P
            self.vector_env = self.module.make_eval_vector_env(self.env_id, self.num_envs, self.async_envs)
        counts = torch.zeros(P * K, device=self.device)
        first_row_depths = []

        def policy_fn(obs, goal, policy_index):
            obs = torch.as_tensor(obs, dtype=torch.float32, device=self.device)
            goal = torch.as_tensor(goal, dtype=torch.float32, device=self.device)
            policy_index = torch.as_tensor(policy_index, device=self.device).long()
            decision, depth = choice(obs, goal, policy_index)
            count_depths(counts, policy_index * K + depth - 1)
            first_row_depths.append(depth[0])
            return self.network.act(decision)

        task_id = self.groups.index(group) + 1
        success = self.module.rollout(policy_fn, self.vector_env, task_ids=(task_id,),
                                      episodes=episodes or self.episodes, num_policies=P,
                                      seed=self.seed + 1000 * task_id + first_episode)  # (P, 1, episodes)
        success = torch.as_tensor(np.asarray(success), dtype=torch.float32).view(P, -1)
        return [{"success": s, "depth_counts": c, "trace": None}
                for s, c in zip(success.mean(1).tolist(), counts.view(P, K).tolist())], first_row_depths, success

    def trace(self, group, choice):
        """The task's first successful episode among its first TRACE_TRIES (the paper's Figure 6 shows successful
        episodes), else the last of them. The tries run side by side (a failing try runs to the time limit), then
        the chosen episode runs again alone, the only running row of the vector env, so row 0 is that episode at
        every step."""
        _, _, tries = self.rollout(group, choice, episodes=TRACE_TRIES)
        succeeded = torch.nonzero(tries[0] > 0).flatten().tolist()
        episode = succeeded[0] if succeeded else TRACE_TRIES - 1
        _, depths, success = self.rollout(group, choice, episodes=1, first_episode=episode)
        return {"depths": torch.stack(depths).tolist(), "episode_success": success[0, 0].item(), "episode": episode}

    def close(self):
        if self.vector_env is not None:
            self.vector_env.close()



# ---------------------------------------------------------------------------------------------------------
# Evaluation of one checkpoint: elasticity, eps sweep, calibration, analysis, traces.
# ---------------------------------------------------------------------------------------------------------
def summarize(result, depth, **extra):
    counts = torch.tensor(result["depth_counts"], dtype=torch.float64)
    total = counts.sum().clamp(min=1)
    mean_depth = float((counts * torch.arange(1, depth + 1)).sum() / total)
    return {**extra, "success": result["success"], "mean_depth": mean_depth,
            "depth_histogram": (counts / total).tolist(), "ideal_speedup": depth / mean_depth}


def calibrate(sweep, full_success, retain):
    """The largest eps whose success stays >= retain * full-depth success. When none does (noise can put even
    eps = 0 below the floor), the smallest eps, with met = False."""
    floor = retain * full_success
    passing = [row for row in sweep if row["success"] >= floor]
    chosen = max(passing, key=lambda row: row["eps"]) if passing else min(sweep, key=lambda row: row["eps"])
    return {"eps": chosen["eps"], "retain": retain, "full_depth_success": full_success, "floor": floor,
            "met": bool(passing)}


def matched_success(evaluations):
    """Mean depth at matched success: per split, the first checkpoint's full-depth success is the reference (list
    the fixed-depth model first, e.g. IRU-5 then FlexLoop). For every checkpoint, the eps row of smallest mean depth
    whose success reaches the reference less one binomial standard error of it (the paper's comparison: FlexLoop's
    success at its mean depth beside IRU-5's at depth K). None where no row reaches it."""
    reference = evaluations[0]
    rows = []
    for group, success_per_depth in reference["elasticity"].items():
        target, episodes = success_per_depth[-1], reference["episodes"][group]
        floor = target - math.sqrt(target * (1 - target) / episodes)
        for ev in evaluations:
            reaching = [row for row in ev["adaptive"][group] if row["success"] >= floor]
            best = min(reaching, key=lambda row: (row["mean_depth"], -row["success"]), default=None)
            keys = ("eps", "success", "mean_depth", "ideal_speedup")
            rows.append({"label": ev["label"], "split": group, "reference": reference["label"],
                         "reference_success": target, "floor": floor,
                         **({key: best[key] for key in keys} if best else dict.fromkeys(keys))})
    return rows


def quantile_bins(deltas_by_group, endpoint_by_group, num_bins):
    """delta_k against D(pi_K, pi_k): bin edges are quantiles of delta over every group pooled; per group and bin,
    the fraction of that group's samples, the mean delta and the mean endpoint divergence (paper figure 4b)."""
    pooled = torch.cat(list(deltas_by_group.values()))
    if pooled.numel() == 0:
        return {}
    if pooled.numel() > 1_000_000:  # torch.quantile's input limit; a random subset gives the same edges
        pooled = pooled[torch.randperm(pooled.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    edges = torch.quantile(pooled.double(), torch.linspace(0, 1, num_bins + 1, dtype=torch.float64))[1:-1]
    bins = {}
    for group, deltas in deltas_by_group.items():
        which = torch.bucketize(deltas.double(), edges)
        rows = []
        for b in range(num_bins):
            mask = which == b
            if mask.any():
                rows.append({"bin": b, "fraction": mask.float().mean().item(),
                             "delta_mean": deltas[mask].mean().item(),
                             "endpoint_mean": endpoint_by_group[group][mask].mean().item()})
        bins[group] = rows
    return bins


def mean_over_tasks(rows_by_task, depth):
    """OGBench's headline: the per-eps mean over tasks of success, depth histogram and mean depth."""
    mean = []
    for rows in zip(*rows_by_task):
        mean_depth = float(np.mean([r["mean_depth"] for r in rows]))
        mean.append({"eps": rows[0]["eps"], "success": float(np.mean([r["success"] for r in rows])),
                     "mean_depth": mean_depth, "ideal_speedup": depth / mean_depth,
                     "depth_histogram": np.mean([r["depth_histogram"] for r in rows], 0).tolist()})
    return mean


def evaluate_checkpoint(adapter, network, args, pbar):
    K = network.depth
    eps_grid = tuple(args.eps) or adapter.eps_grid()
    policies = [{"depth": k} for k in range(1, K + 1)] + [{"eps": eps} for eps in eps_grid]
    out = {"eps_grid": list(eps_grid), "elasticity": {}, "adaptive": {}}
    analysis_deltas, analysis_endpoint = {}, {}
    for group in adapter.groups:  # every depth and eps side by side, on the same tasks
        choice = DepthChoice(network, policies, args.k_min, record_policy=K - 1)
        results = adapter.run(group, choice)
        out["elasticity"][group] = [r["success"] for r in results[:K]]
        out["adaptive"][group] = [summarize(r, K, eps=eps) for r, eps in zip(results[K:], eps_grid)]
        analysis_deltas[group], analysis_endpoint[group] = choice.recorded_pairs()
        pbar.update(1)
    if adapter.family == "ogbench":
        out["elasticity"]["mean"] = np.mean([out["elasticity"][g] for g in adapter.groups], 0).tolist()
        out["adaptive"]["mean"] = mean_over_tasks([out["adaptive"][g] for g in adapter.groups], K)

    # Calibration on the train split (OGBench: the mean over tasks), reported on every split.
    calibrate_on = "train" if "train" in adapter.groups else "mean"
    calibration = calibrate(out["adaptive"][calibrate_on], out["elasticity"][calibrate_on][-1], args.retain)
    index = eps_grid.index(calibration["eps"])
    calibration["calibrated_on"] = calibrate_on
    calibration["results"] = {g: {**rows[index], "full_depth_success": out["elasticity"][g][-1]}
                              for g, rows in out["adaptive"].items()}
    per_group = getattr(adapter, "episodes", None) or adapter.num_envs
    out["episodes"] = {g: per_group * (len(adapter.groups) if g == "mean" else 1) for g in out["elasticity"]}
    episodes = out["episodes"][calibrate_on]
    calibration["warning"] = calibration_warning(calibration)
    calibration["meaningful"] = calibration["warning"] is None
    calibration["note"] = calibration_noise_note(calibration, episodes)
    out["calibration"] = calibration

    out["analysis"] = {"direction": "delta_k = divergence(pi_k, pi_{k-1}); endpoint = divergence(pi_K, pi_k); "
                                    "states visited by the full-depth policy, k = 2..K-1",
                       "bins": quantile_bins(analysis_deltas, analysis_endpoint, args.analysis_bins)}
    out["trace"] = {}
    for group in adapter.groups:
        trace = adapter.trace(group, DepthChoice(network, [{"eps": calibration["eps"]}], args.k_min))
        out["trace"][group] = {"eps": calibration["eps"], **trace}
        pbar.update(1)
    return out


# ---------------------------------------------------------------------------------------------------------
# Inference for the wall-clock stress test: full depth, masked adaptive, compacted adaptive.
# ---------------------------------------------------------------------------------------------------------
@torch.no_grad()
def full_depth_policy(network, obs, goal):
    state = network.start(obs, goal)
    for _ in range(network.depth):
        state = network.advance(state)
    decision = network.decide(state)
    return decision, torch.full((obs.shape[0],), network.depth, dtype=torch.long, device=obs.device)


@torch.no_grad()
def masked_policy(network, obs, goal, eps, k_min):
    """Adaptive decisions with every row computing every depth: stopped rows are masked, not removed. Fixed
    shapes and no host sync, but no saving either: the reference that compacted_policy must match."""
    K, batch = network.depth, obs.shape[0]
    state = network.start(obs, goal)
    previous = network.decide(state) if k_min == 0 else None
    decision, depth = None, torch.full((batch,), K, dtype=torch.long, device=obs.device)
    stopped = torch.zeros(batch, dtype=torch.bool, device=obs.device)
    for k in range(1, K + 1):
        state = network.advance(state)
        if k < k_min:
            continue
        current = network.decide(state)
        if k > k_min:
            stop = network.divergence(current, previous).clamp(min=0) < eps if k < K else torch.ones_like(stopped)
            newly = stop & ~stopped
            decision = current if decision is None else \
                torch.where(newly.view(-1, *[1] * (current.dim() - 1)), current, decision)
            depth = torch.where(newly, k, depth)
            stopped = stopped | newly
        previous = current
    return decision, depth


@torch.no_grad()
def compacted_policy(network, obs, goal, eps, k_min, sizes=None, min_shrink=0.0):
    """Adaptive decisions where stopped rows stop costing work: after each depth, the rows still going are
    gathered (network.gather) into a smaller batch, advanced alone, and their decisions scattered back.

    sizes=None: exact. Each depth reads the count of rows still going (one host sync) and compacts to it when at
    least min_shrink of the active rows stopped; when none are left, the remaining depths are skipped.
    sizes=(s_1, ...): fixed sizes per compaction point (CUDA graphs need fixed shapes). Rows beyond a size are
    padding; if more rows are going than fit, `overflow` is set and the caller must redo the batch exactly.

    Active row i stands for batch row rows[i]; rows[i] = B marks padding or a row that already stopped, whose
    writes go to a sink row B. Returns decision, depth (B,), the going count after each depth, overflow."""
    K, batch, device = network.depth, obs.shape[0], obs.device
    state = network.start(obs, goal)
    previous = network.decide(state) if k_min == 0 else None
    for _ in range(k_min):  # no row can stop before k_min + 1
        state = network.advance(state)
    if k_min > 0:
        previous = network.decide(state)
    rows = torch.arange(batch, device=device)
    decision, depth = None, torch.full((batch + 1,), K, dtype=torch.long, device=device)
    counts, overflow = [], torch.zeros((), dtype=torch.bool, device=device)
    for level, k in enumerate(range(k_min + 1, K + 1)):
        state = network.advance(state)
        current = network.decide(state)
        if decision is None:
            decision = current.new_zeros((batch + 1, *current.shape[1:]))
        real = rows < batch
        stop = network.divergence(current, previous).clamp(min=0) < eps if k < K else torch.ones_like(real)
        target = torch.where(stop & real, rows, batch)  # finished rows write their batch row, the rest the sink
        decision.index_copy_(0, target, current)
        depth.index_copy_(0, target, torch.full_like(target, k))
        if k == K:
            break
        going = ~stop & real
        count = going.sum()
        counts.append(count)
        active = rows.shape[0]
        if sizes is None:
            size = int(count)  # the host sync of the exact version
            size = active if size > (1 - min_shrink) * active else size
        else:
            size = min(sizes[level], active)
            overflow = overflow | (count > size)
        if size == 0:
            break
        rows = torch.where(going, rows, batch)  # stopped rows retire in place
        if size < active:  # compact: the going rows first, in order; slots past the count are padding
            position = going.cumsum(0) - 1
            slot = torch.where(going & (position < size), position, size)
            order = torch.zeros(size + 1, dtype=torch.long, device=device)
            order = order.index_copy_(0, slot, torch.arange(active, device=device))[:size]
            rows = torch.where(torch.arange(size, device=device) < count, rows[order], batch)
            state = network.gather(state, order)
            current = current[order]
        previous = current
    return decision[:batch], depth[:batch], counts, overflow


def bucket_sizes(recent_counts, batch, margin, min_shrink):
    """Fixed compaction sizes for CUDA graphs: per compaction point the recent maximum going count plus a margin,
    rounded up to batch/32; a point keeps the previous size unless it shrinks by at least min_shrink."""
    granule = max(1, batch // 32)
    sizes, active = [], batch
    for level_counts in zip(*recent_counts):
        need = min(active, math.ceil(max(level_counts) * (1 + margin) / granule) * granule)
        size = active if need > (1 - min_shrink) * active else need
        sizes.append(size)
        active = size
    return tuple(sizes)


# ---------------------------------------------------------------------------------------------------------
# Wall-clock stress test: whole env steps (policy, act, env.step), CUDA-synchronised.
# ---------------------------------------------------------------------------------------------------------
MAX_POLICY_GRAPHS = 64  # distinct bucket sizes captured per stepper, at most


class StressStepper:
    """Whole env steps for one inference mode (full, masked, compact), eager or replayed from CUDA graphs.

    Eager compact mode compacts to exact counts (one host sync per depth). With CUDA graphs, full and masked replay
    one graph per step, and compact runs `bucketed`: a policy graph for its current compacted sizes, then one sync
    to read the going counts and the overflow flag, an exact redo of the batch on overflow, then the act + env.step
    graph; the sizes follow the last `window` steps' counts. (bucketed=True without graphs runs the same logic
    eagerly.)

    rows_run / rows_needed count the rows advanced through one recurrent step, against the exact compaction's."""

    def __init__(self, network, mode, eps, k_min, num_envs, env_id, split, seed, device, use_graph,
                 min_shrink=0.1, margin=0.05, bucketed=None, window=10):
        self.network, self.mode, self.eps, self.k_min, self.min_shrink, self.margin, self.window = \
            network, mode, eps, k_min, min_shrink, margin, window
        self.use_graph, self.num_envs = use_graph, num_envs
        self.bucketed = use_graph and mode == "compact" if bucketed is None else bucketed
        self.env = envs.make_vec(env_id, num_envs, device=device, split=split, seed=seed, check_actions=False).unwrapped
        self.generator = torch.Generator(device).manual_seed(seed)
        obs, _ = self.env.reset()
        self.obs, self.goal = obs["observation"].clone(), obs["desired_goal"].clone()
        K = network.depth
        self.depth_counts = torch.zeros(K, device=device)
        self.success_sum = torch.zeros((), device=device)
        self.episodes = torch.zeros((), device=device)
        self.num_levels = max(K - k_min - 1, 0)
        self.full_sizes = (num_envs,) * self.num_levels
        self.recent_counts, self.sizes, self.policy_runs = [], self.full_sizes, {}
        self.overflow_steps, self.rows_run, self.rows_needed = 0, 0, 0
        self.rows_before_stops = num_envs * min(k_min + 1, K)  # every row runs the depths before its first stop
        self.sizes_seen_before_timing = 0  # set after warmup: sizes first seen later were captured while timed
        self.freeze_sizes = False  # freeze(): no new sizes from then on
        decision, depth = full_depth_policy(network, self.obs, self.goal)  # shapes for the static buffers
        self.decision, self.depth = decision.clone(), depth.clone()
        self.stats = torch.zeros(1 + self.num_levels, dtype=torch.long, device=device)
        self.run_step = lambda: self.env_step(*self.policy())
        self.run_env_step = lambda: self.env_step(self.decision, self.depth)
        if use_graph:
            generators = [self.generator, self.env.generator]
            if self.bucketed:  # the policy runs apart, its sizes chosen on the host
                self.run_env_step = flexloop_run.capture_cuda_graph(self.run_env_step, generators)
                self.stats_host = torch.zeros_like(self.stats, device="cpu").pin_memory()
                self.pool = torch.cuda.graph_pool_handle()  # policy graphs share memory: they never overlap
            else:
                self.run_step = flexloop_run.capture_cuda_graph(self.run_step, generators)

    def policy(self):
        if self.mode == "full":
            return full_depth_policy(self.network, self.obs, self.goal)
        if self.mode == "masked":
            return masked_policy(self.network, self.obs, self.goal, self.eps, self.k_min)
        decision, depth, _, _ = compacted_policy(self.network, self.obs, self.goal, self.eps, self.k_min,
                                                 min_shrink=self.min_shrink)
        return decision, depth

    def env_step(self, decision, depth):
        action = self.network.act(decision, self.generator)
        obs, _, _, _, info = self.env.step(action)  # the env writes its state in place: graph-safe
        self.obs.copy_(obs["observation"])
        self.goal.copy_(obs["desired_goal"])
        count_depths(self.depth_counts, depth - 1)
        done = info["episode_done"]
        self.success_sum.add_((info["episode_success"] * done).sum())
        self.episodes.add_(done.sum())

    def bucketed_policy_into_buffers(self, sizes):
        decision, depth, counts, overflow = compacted_policy(self.network, self.obs, self.goal, self.eps, self.k_min,
                                                             sizes=sizes)
        self.decision.copy_(decision)
        self.depth.copy_(depth)
        skipped = [torch.zeros((), dtype=torch.long, device=self.stats.device)] * (self.num_levels - len(counts))
        self.stats.copy_(torch.stack([overflow.long(), *counts, *skipped]))

    def step(self):
        if self.bucketed:
            self.step_bucketed()
        else:
            self.run_step()

    def step_bucketed(self):
        sizes_used = self.sizes
        if self.sizes not in self.policy_runs:
            run = lambda s=self.sizes: self.bucketed_policy_into_buffers(s)  # noqa: E731
            graphed = self.use_graph
            self.policy_runs[self.sizes] = flexloop_run.capture_cuda_graph(run, [], pool=self.pool) if graphed else run
        self.policy_runs[self.sizes]()
        if self.use_graph:
            self.stats_host.copy_(self.stats, non_blocking=True)
            torch.cuda.current_stream().synchronize()  # the one sync per step
            stats = self.stats_host.tolist()
        else:
            stats = self.stats.tolist()
        if stats[0]:  # more rows kept going than the sizes hold: redo this batch exactly, and keep its counts
            self.overflow_steps += 1
            decision, depth, counts, _ = compacted_policy(self.network, self.obs, self.goal, self.eps, self.k_min,
                                                          min_shrink=self.min_shrink)
            self.decision.copy_(decision)
            self.depth.copy_(depth)
            stats = [0] + [int(c) for c in counts] + [0] * (self.num_levels - len(counts))
            self.rows_run += self.rows_before_stops + sum(stats[1:])  # the redo, as the exact compaction
        self.run_env_step()
        self.rows_run += self.rows_before_stops + sum(sizes_used)
        self.rows_needed += self.rows_before_stops + sum(stats[1:])
        if not self.num_levels:
            return
        self.recent_counts = (self.recent_counts + [stats[1:]])[-self.window:]
        sizes = bucket_sizes(self.recent_counts, self.num_envs, self.margin, self.min_shrink)
        if sizes not in self.policy_runs and (self.freeze_sizes or len(self.policy_runs) >= MAX_POLICY_GRAPHS):
            sizes = self.captured_sizes_holding(sizes)
        self.sizes = sizes

    def captured_sizes_holding(self, sizes):
        """The smallest captured sizes that hold these (the full sizes, captured first, always do)."""
        return min((s for s in self.policy_runs if all(a >= b for a, b in zip(s, sizes))), key=sum)

    def freeze(self):
        """--stress-freeze-sizes: no new bucket sizes from now on, the next step's included."""
        self.freeze_sizes = True
        if self.bucketed and self.sizes not in self.policy_runs:
            self.sizes = self.captured_sizes_holding(self.sizes)

    def captured_policies(self):
        """The policy graphs (eager: the policy functions) of compact mode so far."""
        return len(self.policy_runs) if self.bucketed else 0

    def report(self):
        counts = self.depth_counts.double().cpu()
        mean_depth = float((counts * torch.arange(1, len(counts) + 1)).sum() / counts.sum())
        episodes = int(self.episodes.item())
        return {"mean_depth": mean_depth, "episodes": episodes,
                "success": self.success_sum.item() / episodes if episodes else None,
                "overflow_steps": self.overflow_steps,
                "policy_graphs": self.captured_policies() if self.use_graph else 0,
                "new_sizes_while_timed": self.captured_policies() - self.sizes_seen_before_timing,
                "bucket_sizes": list(self.sizes) if self.bucketed else None,
                # rows advanced one recurrent step, over what the exact compaction advances (padding, redos)
                "rows_run_over_exact": self.rows_run / self.rows_needed if self.rows_needed else None}


def stress_test(network, args, eps, num_envs, device):
    """Median and IQR of the wall clock of one whole env step, per mode, on args.stress_env_id."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    use_graph = args.cuda_graph and device.type == "cuda"
    modes = ["full"] + list(dict.fromkeys(args.stress_mode))
    steppers = {mode: StressStepper(network, mode, eps, args.k_min, num_envs, args.stress_env_id, args.stress_split,
                                    args.seed, device, use_graph, args.stress_min_shrink, args.stress_bucket_margin,
                                    window=args.stress_bucket_window)
                for mode in modes}
    for stepper in steppers.values():
        for _ in range(args.stress_warmup):
            stepper.step()
        stepper.depth_counts.zero_()
        stepper.success_sum.zero_()
        stepper.episodes.zero_()
        stepper.overflow_steps, stepper.rows_run, stepper.rows_needed = 0, 0, 0
        stepper.sizes_seen_before_timing = stepper.captured_policies()
        if args.stress_freeze_sizes:
            stepper.freeze()
    sync()
    times = {mode: [] for mode in modes}
    for _ in range(args.stress_samples):
        for mode, stepper in steppers.items():  # modes take turns, so clock drift hits all alike
            sync()
            start = time.perf_counter()
            for _ in range(args.stress_block):
                stepper.step()
            sync()
            times[mode].append((time.perf_counter() - start) / args.stress_block * 1000)
    result = {"num_envs": num_envs, "env_id": args.stress_env_id, "split": args.stress_split, "eps": eps,
              "k_min": args.k_min, "depth": network.depth, "cuda_graph": use_graph, "compile": args.compile,
              "freeze_sizes": args.stress_freeze_sizes and use_graph,  # eager compact mode has no buckets
              "bucket_margin": args.stress_bucket_margin, "bucket_window": args.stress_bucket_window,
              "min_shrink": args.stress_min_shrink,
              "steps_timed": args.stress_samples * args.stress_block, "modes": {}}
    for mode in modes:
        q25, median, q75 = np.percentile(times[mode], [25, 50, 75])
        result["modes"][mode] = {"ms_per_step_median": median, "ms_per_step_q25": q25, "ms_per_step_q75": q75,
                                 "ms_per_step_iqr": q75 - q25,
                                 "ms_per_step_mean": float(np.mean(times[mode])),  # the whole run's wall clock
                                 **steppers[mode].report()}
    full = result["modes"]["full"]["ms_per_step_median"]
    full_mean = result["modes"]["full"]["ms_per_step_mean"]
    for mode in modes[1:]:
        row = result["modes"][mode]
        row["speedup"] = full / row["ms_per_step_median"]
        row["speedup_of_means"] = full_mean / row["ms_per_step_mean"]  # the paper's Table 3 reports means
        row["ideal_speedup"] = network.depth / row["mean_depth"]
        row["fraction_of_ideal"] = row["speedup"] / row["ideal_speedup"]
    return result


def run_stress(network, args, eps, device, label):
    results = []
    for num_envs in args.stress_envs:
        try:
            result = stress_test(network, args, eps, num_envs, device)
        except Exception as error:  # one failing size should not hide the others' numbers
            traceback.print_exc()
            result = {"num_envs": num_envs, "error": f"{type(error).__name__}: {error}"[:500]}
        results.append({"checkpoint": label, **result})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


# ---------------------------------------------------------------------------------------------------------
# Plots (matplotlib, Agg). Each figure_* builds one figure and returns it; make_plots saves and closes them.
# Axes that are pictures (BoxPick grids) or messages carry the label "picture" or "message"; every other axes has
# axis labels and labelled ticks (tests/test_eval_adaptive.py checks this for every figure).
# ---------------------------------------------------------------------------------------------------------
DPI = 120
MAX_COLUMNS = 3  # panels per row before a figure wraps into a grid


def safe_name(text):
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in text)


def panel_grid(plt, count, width, height, columns=MAX_COLUMNS):
    """A figure of `count` panels, at most `columns` a row (the OGBench tasks wrap into a grid); unused panels of
    the last row are hidden. Returns the figure and the flat list of the `count` axes."""
    columns = max(1, min(columns, count))
    rows = math.ceil(count / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(width * columns, height * rows + 0.6), squeeze=False,
                             layout="constrained", dpi=DPI)
    for ax in axes.flat[count:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:count])


def integer_depth_axis(axis, depth):
    """Ticks at whole depths only: 1..K when K is small, else integers chosen by matplotlib."""
    from matplotlib.ticker import FixedLocator, MaxNLocator
    if depth <= 12:
        axis.set_major_locator(FixedLocator(range(1, depth + 1)))
    else:
        axis.set_major_locator(MaxNLocator(integer=True))
    axis.set_minor_locator(FixedLocator([]))


def success_limits(ax, values):
    """y from 0 to a little above the largest success, so that small successes (unseen tasks) stay readable."""
    top = max([0.0] + [v for v in values if math.isfinite(v)])
    top = min(1.05, max(0.1, top * 1.15))
    ax.set_ylim(-0.03 * top, top)


def log_ticks(low, high):
    """Tick values for a log axis over [low, high] with at least 3 labelled ticks where possible: decades, then
    1-2-5, then every digit, then finer steps; when even that leaves fewer than 3 inside, the limits widen to the
    neighbouring ticks. Returns (ticks, low, high)."""
    lo_exp, hi_exp = math.floor(math.log10(low)) - 1, math.ceil(math.log10(high)) + 1
    fine = (1, 1.2, 1.4, 1.6, 1.8, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8, 9)
    for subs in ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9), fine):
        ticks = [s * 10.0 ** e for e in range(lo_exp, hi_exp + 1) for s in subs]
        inside = [t for t in ticks if low * (1 - 1e-9) <= t <= high * (1 + 1e-9)]
        if len(inside) >= 3:
            step = math.ceil(len(inside) / 8)  # at most about 8 labels
            return inside[::step], low, high
    below = max(t for t in ticks if t <= low)
    above = min(t for t in ticks if t >= high)
    return [t for t in ticks if below <= t <= above], below, above


def readable_log_axis(ax, which, values):
    """A log axis whose ticks are labelled plainly (0.002, 0.005, 0.01) however few decades the data spans."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    low, high = min(values), max(values)
    pad = (high / low) ** 0.08 if high > low else 1.5
    ticks, low, high = log_ticks(low / pad, high * pad)
    axis = ax.xaxis if which == "x" else ax.yaxis
    (ax.set_xscale if which == "x" else ax.set_yscale)("log")
    (ax.set_xlim if which == "x" else ax.set_ylim)(low, high)
    axis.set_major_locator(FixedLocator(ticks))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.3g}"))
    axis.set_minor_locator(NullLocator())


def message_panel(ax, text):
    """An axes that says, in words, why there is nothing to plot."""
    ax.set_label("message")
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=9, wrap=True, transform=ax.transAxes)


def bottom_legend(fig, handles, labels, columns=4):
    """One legend for the whole figure, below the panels, so that it never covers data."""
    if handles:
        fig.legend(handles, labels, loc="outside lower center", ncols=min(columns, len(labels)), fontsize=8,
                   frameon=False)


def curve_style(i, count):
    """Checkpoint i of count: earlier curves are drawn wider, with bigger markers edged in white, so that a curve
    that coincides with a later one still shows around it."""
    wider = count - 1 - i
    return dict(color=f"C{i}", linewidth=min(1.5 + 0.7 * wider, 3.0), markersize=min(5 + 1.5 * wider, 9.0),
                markeredgecolor="white", markeredgewidth=0.6)


def group_title(group):
    return {"train": "train tasks", "unseen": "unseen tasks", "mean": "mean over tasks"}.get(group, group)


def figure_elasticity(evaluations, plt):
    groups = list(evaluations[0]["elasticity"])
    depth = max(ev["depth"] for ev in evaluations)
    fig, axes = panel_grid(plt, len(groups), 3.6, 2.9)
    for ax, group in zip(axes, groups):
        for i, ev in enumerate(evaluations):
            values = ev["elasticity"][group]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=ev["label"],
                    **curve_style(i, len(evaluations)))
        ax.set(title=group_title(group), xlabel="depth k", ylabel="success", xlim=(0.7, depth + 0.3))
        integer_depth_axis(ax.xaxis, depth)
        success_limits(ax, [v for ev in evaluations for v in ev["elasticity"][group]])
        ax.grid(alpha=0.3)
    bottom_legend(fig, *axes[0].get_legend_handles_labels())
    fig.suptitle(f"{evaluations[0]['env_id']}: success at each fixed depth")
    return fig


def eps_text(values):
    """'0.01', or '0.005-0.02' for several eps at one point."""
    values = sorted(values)
    return f"{values[0]:g}" if len(values) == 1 else f"{values[0]:g}-{values[-1]:g}"


# Where an eps label may go, relative to its point (offset in points, alignment); the far ones get a leader line.
LABEL_SPOTS = [(4, 3, "left", "bottom"), (4, -3, "left", "top"), (-4, 3, "right", "bottom"),
               (-4, -3, "right", "top"), (0, 7, "center", "bottom"), (0, -7, "center", "top"),
               (12, 12, "left", "bottom"), (12, -12, "left", "top"), (-12, 12, "right", "bottom"),
               (-12, -12, "right", "top"), (0, 20, "center", "bottom"), (0, -20, "center", "top")]


SHARED_LABEL_COLOR = "0.35"


def line_boxes(ax, spacing=6):
    """Small pixel boxes along every line of the axes: places where a label would cross a curve."""
    from matplotlib.transforms import Bbox
    boxes = []
    for line in ax.lines:
        pixels = ax.transData.transform(np.column_stack(line.get_data()))
        for a, b in zip(pixels[:-1], pixels[1:]):
            steps = max(1, int(np.hypot(*(b - a)) / spacing))
            for t in np.linspace(0, 1, steps + 1):
                x, y = a + t * (b - a)
                boxes.append(Bbox.from_bounds(x - 1.5, y - 1.5, 3, 3))
    return boxes


def place_eps_labels(ax, points, renderer, taken):
    """Label each (x, y, eps, colour, marker radius in pixels) point of the Pareto curves where its text overlaps
    no other label and no marker and stays inside the axes, preferring spots that cross no curve; a label that
    fits nowhere is left out. Points of one curve within a few pixels of each other share one label
    ('0.005-0.02'). Returns the number of eps values left unlabelled."""
    from matplotlib.transforms import Bbox
    to_pixels = ax.transData.transform
    clusters = []  # [pixel position, x, y, eps list, colour, marker radius in pixels]
    for x, y, eps, color, radius in points:
        pixel = to_pixels((x, y))
        for cluster in clusters:
            if cluster[4] == color and np.hypot(*(cluster[0] - pixel)) < 5:
                cluster[3].append(eps)
                break
        else:
            clusters.append([pixel, x, y, [eps], color, radius])
    merged = []  # checkpoints whose points coincide with the same eps values share one label, in grey
    for cluster in clusters:
        twin = next((m for m in merged if sorted(m[3]) == sorted(cluster[3])
                     and np.hypot(*(m[0] - cluster[0])) < 5), None)
        if twin is None:
            merged.append(cluster)
        else:
            twin[4], twin[5] = SHARED_LABEL_COLOR, max(twin[5], cluster[5])
    clusters = merged
    frame = ax.get_window_extent(renderer)
    markers = [Bbox.from_bounds(p[0] - r, p[1] - r, 2 * r, 2 * r) for p, *_, r in clusters]
    curves = line_boxes(ax)
    left_out = 0
    for i, (pixel, x, y, values, color, radius) in enumerate(clusters):
        others = markers[:i] + markers[i + 1:]
        chosen = None
        for avoid_curves in (True, False):
            for dx, dy, ha, va in LABEL_SPOTS:
                far = abs(dx) > 6 or abs(dy) > 12
                grow = radius * 72 / ax.figure.dpi - 3  # bigger markers push the near spots out
                dx, dy = dx + np.sign(dx) * max(grow, 0), dy + np.sign(dy) * max(grow, 0)
                text = ax.annotate(eps_text(values), (x, y), xytext=(dx, dy), textcoords="offset points", ha=ha,
                                   va=va, fontsize=7, color=color, annotation_clip=False,
                                   bbox=dict(boxstyle="square,pad=0.1", facecolor="white", edgecolor="none",
                                             alpha=0.75),
                                   arrowprops=dict(arrowstyle="-", color=color, lw=0.5, alpha=0.6) if far else None)
                text.set_in_layout(False)
                box = text.get_window_extent(renderer).padded(2)  # a gap between neighbouring labels
                fits = frame.contains(box.x0, box.y0) and frame.contains(box.x1, box.y1) and \
                    not any(box.overlaps(b) for b in taken + others) and \
                    not (avoid_curves and any(box.overlaps(b) for b in curves))
                if fits:
                    chosen = box
                    break
                text.remove()
            if chosen is not None:
                break
        if chosen is None:
            left_out += len(values)
        else:
            taken.append(chosen)
    return left_out


def figure_pareto(evaluations, plt):
    groups = list(evaluations[0]["adaptive"])
    depth, count = max(ev["depth"] for ev in evaluations), len(evaluations)
    fig, axes = panel_grid(plt, len(groups), 4.2, 3.3)
    labels = {}
    for ax, group in zip(axes, groups):
        points = []
        for i, ev in enumerate(evaluations):
            style, wider = curve_style(i, count), count - 1 - i
            rows = ev["adaptive"][group]
            ax.plot([r["mean_depth"] for r in rows], [r["success"] for r in rows], marker="o", zorder=3,
                    label=f"{ev['label']}: adaptive, over eps", **style)  # above the fixed-depth points
            radius = style["markersize"] * DPI / 72 / 2
            points += [(r["mean_depth"], r["success"], r["eps"], style["color"], radius) for r in rows]
            fixed = ev["elasticity"][group]
            ax.plot(range(1, len(fixed) + 1), fixed, marker="s", linestyle=":", alpha=0.6,
                    label=f"{ev['label']}: fixed depth k",
                    **{**style, "markersize": min(4 + 1.2 * wider, 7.0), "linewidth": min(1.2 + 0.5 * wider, 2.2)})
        ax.set(title=group_title(group), xlabel="mean depth", ylabel="success", xlim=(0.7, depth + 0.3))
        integer_depth_axis(ax.xaxis, depth)
        success_limits(ax, [p[1] for p in points] + [v for ev in evaluations for v in ev["elasticity"][group]])
        ax.grid(alpha=0.3)
        labels[ax] = points
    bottom_legend(fig, *axes[0].get_legend_handles_labels(), columns=count)  # a column per checkpoint
    title = fig.suptitle("success against mean depth (numbers at the points: eps)\n ")  # line 2: see below
    fig.canvas.draw()  # lay the panels out once, then freeze it: labels are placed in pixels
    fig.set_layout_engine("none")
    renderer = fig.canvas.get_renderer()
    left_out = sum(place_eps_labels(ax, points, renderer, []) for ax, points in labels.items())
    shared = any(text.get_color() == SHARED_LABEL_COLOR for ax in labels for text in ax.texts)
    notes = (["grey: eps shared by checkpoints"] if shared else []) + \
        ([f"{left_out} eps labels hidden to avoid overlaps, all in results.json"] if left_out else [])  # one line
    title.set_text(title.get_text().strip() + (f"\n({'; '.join(notes)})" if notes else ""))
    return fig


def figure_analysis(evaluations, plt):
    fig, axes = panel_grid(plt, len(evaluations), 4.0, 3.3)
    for ax, ev in zip(axes, evaluations):
        bins = {group: rows for group, rows in ev["analysis"]["bins"].items() if rows}
        if not bins:
            message_panel(ax, f"{ev['label']}: nothing to show.\n"
                          + (f"This needs K >= 3 (it compares depths k = 2..K-1),\nand this checkpoint has K = "
                             f"{ev['depth']}." if ev["depth"] < 3 else "No states were recorded."))
            continue
        xs, ys = [], []
        for i, (group, rows) in enumerate(bins.items()):
            x = [max(r["delta_mean"], 1e-9) for r in rows]  # a delta of exactly 0 sits at 1e-9
            y = [max(r["endpoint_mean"], 1e-9) for r in rows]
            ax.plot(x, y, color=f"C{i}", alpha=0.5)
            ax.scatter(x, y, s=[20 + 400 * r["fraction"] for r in rows], color=f"C{i}", alpha=0.7, label=group)
            xs, ys = xs + x, ys + y
        readable_log_axis(ax, "x", xs)
        readable_log_axis(ax, "y", ys)
        ax.set(title=ev["label"], xlabel=r"$\delta_k = D(\pi_k, \pi_{k-1})$, bin mean",
               ylabel=r"$D(\pi_K, \pi_k)$, bin mean")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, markerscale=0.5)
    fig.suptitle("adjacent-depth change against distance to the full-depth policy\n"
                 "(quantile bins of delta_k, k = 2..K-1; marker area = fraction of states)", fontsize=10)
    return fig


def figure_traces(evaluations, plt):
    """One panel per checkpoint (columns) and split or task (rows): the depth used at each step of one episode."""
    groups = list(evaluations[0]["trace"])
    fig, axes = plt.subplots(len(groups), len(evaluations), figsize=(4.6 * len(evaluations), 1.9 * len(groups) + 0.6),
                             squeeze=False, layout="constrained", dpi=DPI)
    for column, ev in enumerate(evaluations):
        for row, group in enumerate(groups):
            ax, trace = axes[row, column], ev["trace"][group]
            depths = trace["depths"]
            if not depths:
                message_panel(ax, f"{ev['label']}, {group}: nothing to show (the episode had no steps)")
                continue
            ax.step(range(len(depths)), depths, where="mid", color=f"C{column}")
            tried = f" (the task's episode {trace['episode'] + 1})" if "episode" in trace else ""
            ax.set(title=f"{ev['label']}, {group_title(group)}: eps = {trace['eps']:g}, "
                         f"episode success {trace['episode_success']:.0f}{tried}",
                   xlabel="step of the episode", ylabel="depth k*", ylim=(0.5, ev["depth"] + 0.5),
                   xlim=(-0.5, max(len(depths) - 0.5, 1)))
            ax.title.set_fontsize(8)
            integer_depth_axis(ax.yaxis, ev["depth"])
            ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
    fig.suptitle("depth used at each step of one episode\n(adaptive inference at the calibrated eps)", fontsize=10)
    return fig


GRID_COLORS = {"target": "#c7e9c0", "box": "#a0522d", "agent": "#1f77b4", "line": "#cccccc"}


def draw_boxpick_grid(ax, grid, title):
    """One 6x6 BoxPick grid from its cell codes: green targets, brown boxes, a blue agent (with a box if carrying)."""
    from matplotlib.patches import Circle, Rectangle

    from envs.boxpick import CODE_FLAGS, GRID_SIZE
    for cell, code in enumerate(grid):
        row, col = divmod(cell, GRID_SIZE)
        box, target, agent, carrying = CODE_FLAGS[int(code)]
        ax.add_patch(Rectangle((col, row), 1, 1, facecolor=GRID_COLORS["target"] if target else "white",
                               edgecolor=GRID_COLORS["line"]))
        if box:
            ax.add_patch(Rectangle((col + 0.2, row + 0.2), 0.6, 0.6, facecolor=GRID_COLORS["box"]))
        if agent:
            ax.add_patch(Circle((col + 0.5, row + 0.5), 0.3, facecolor=GRID_COLORS["agent"], alpha=0.85))
            if carrying:
                ax.add_patch(Rectangle((col + 0.38, row + 0.38), 0.24, 0.24, facecolor=GRID_COLORS["box"]))
    ax.set_label("picture")
    ax.axis("on")
    ax.set_xlim(0, GRID_SIZE)
    ax.set_ylim(GRID_SIZE, 0)
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title, fontsize=7)


def boxpick_legend(fig):
    """What the symbols of a BoxPick strip mean."""
    from matplotlib.legend_handler import HandlerTuple
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    square = dict(marker="s", linestyle="none", markerfacecolor=GRID_COLORS["box"], markeredgecolor="none")
    agent = Line2D([], [], marker="o", linestyle="none", markersize=9, markerfacecolor=GRID_COLORS["agent"],
                   markeredgecolor="none", alpha=0.85)
    target = Patch(facecolor=GRID_COLORS["target"], edgecolor=GRID_COLORS["line"])
    box = Line2D([], [], markersize=8, **square)
    handles = [target, box, (target, Line2D([], [], markersize=5.5, **square)), agent, (box, agent),
               (agent, Line2D([], [], markersize=3.5, **square))]
    labels = ["target cell", "box", "box on a target", "agent", "agent on a box", "agent carrying a box"]
    fig.legend(handles, labels, handler_map={tuple: HandlerTuple(ndivide=1)}, loc="outside lower center",
               ncols=6, fontsize=7, frameon=False, handlelength=1.6, handleheight=1.2)


def figure_boxpick_strip(trace, frames, plt, title):
    """The goal, then the first `frames` steps of one episode (targets shown), 10 panels a row, and a legend."""
    steps = min(frames, len(trace["grids"]))
    rows = math.ceil((steps + 1) / 10)
    columns = math.ceil((steps + 1) / rows)  # rows of even length: 11 panels are 6 + 5, not 10 + 1
    fig, axes = plt.subplots(rows, columns, figsize=(max(1.3 * columns, 5.5), 1.45 * rows + 0.8), squeeze=False,
                             layout="constrained", dpi=DPI)
    for ax in axes.flat:
        ax.set_label("picture")
        ax.axis("off")
    draw_boxpick_grid(axes.flat[0], trace["goal"], "goal")
    for t in range(steps):
        draw_boxpick_grid(axes.flat[t + 1], trace["grids"][t], f"t={t}, depth {trace['depths'][t]}")
    boxpick_legend(fig)
    fig.suptitle(title + "\n(t: step of the episode; depth: the depth k* adaptive inference used for that step)",
                 fontsize=8)
    return fig


def build_figures(evaluations, args, plt):
    """{file name: figure} for every plot of these evaluations."""
    figures = {"elasticity.png": figure_elasticity(evaluations, plt), "pareto.png": figure_pareto(evaluations, plt),
               "delta_vs_endpoint.png": figure_analysis(evaluations, plt),
               "depth_trace.png": figure_traces(evaluations, plt)}
    for ev in evaluations:
        for group, trace in ev["trace"].items():
            if "grids" in trace:
                figures[f"strip_{safe_name(ev['label'])}_{group}.png"] = figure_boxpick_strip(
                    trace, args.trace_frames, plt, f"{ev['label']}, {group_title(group)}: eps = {trace['eps']:g}, "
                                                   f"episode success {trace['episode_success']:.0f}")
    return figures


def make_plots(evaluations, out_dir, args):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for name, fig in build_figures(evaluations, args, plt).items():
        fig.savefig(out_dir / name, dpi=DPI)
        plt.close(fig)
        paths.append(out_dir / name)
    return paths


# ---------------------------------------------------------------------------------------------------------
# The printed tables (results.json holds everything)
# ---------------------------------------------------------------------------------------------------------
def text_table(header, rows, indent="  "):
    """Columns padded to their widest cell; text left-aligned, numbers (cells that parse as one) right-aligned."""
    def is_number(cell):
        try:
            float(cell.rstrip("x%*").strip())
            return True
        except ValueError:
            return False
    cells = [header] + rows
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    numeric = [bool(rows) and all(is_number(row[i]) for row in rows if row[i]) for i in range(len(header))]
    lines = []
    for row in cells:
        lines.append(indent + "  ".join(cell.rjust(w) if num else cell.ljust(w)
                                        for cell, w, num in zip(row, widths, numeric)).rstrip())
    return lines


def calibration_noise_note(calibration, episodes):
    """A note when --retain asks for a loss smaller than one binomial standard error of full-depth success."""
    p = calibration["full_depth_success"]
    standard_error = math.sqrt(p * (1 - p) / max(episodes, 1))
    if p <= 0 or (1 - calibration["retain"]) * p >= standard_error:
        return None
    return (f"--retain {calibration['retain']:g} allows a loss of {(1 - calibration['retain']) * p:.3f}, less than one "
            f"standard error ({standard_error:.3f}, {episodes} episodes) of the full-depth success {p:.3f}, so eps* "
            "is noisy; a fixed eps, a lower --retain or more episodes give a steadier choice.")


def calibration_warning(calibration):
    """A warning when the calibrated eps means nothing: full-depth success 0 keeps every eps above its floor."""
    if calibration["full_depth_success"] > 0:
        return None
    return (f"full-depth {calibration['calibrated_on']} success is 0, so every eps meets the floor "
            f"{calibration['retain']:g} x 0 = 0 and the 'calibrated' eps = {calibration['eps']:g} is merely the "
            "largest eps of the grid: calibration is meaningless for this checkpoint. Choose eps from the sweep, or "
            "evaluate a checkpoint that succeeds at full depth.")


def summary_tables(evaluations, stress):
    lines = []
    if evaluations:
        groups = list(evaluations[0]["elasticity"])
        depth = max(ev["depth"] for ev in evaluations)
        lines += [f"{evaluations[0]['env_id']}: success at each fixed depth"]
        rows = []
        for ev in evaluations:
            for i, group in enumerate(groups):
                values = ev["elasticity"][group]
                rows.append([ev["label"] if i == 0 else "", group]
                            + [f"{s:.3f}" for s in values] + [""] * (depth - len(values)))
        lines += text_table(["checkpoint", "split" if "train" in groups else "task"]
                            + [f"k={k}" for k in range(1, depth + 1)], rows)

        for ev in evaluations:
            cal = ev["calibration"]
            lines += ["", f"{ev['label']}: adaptive inference (K = {ev['depth']}, k_min = {ev['k_min']}), "
                          "success / mean depth at each eps"]
            if ev["k_min"] + 1 >= ev["depth"]:
                lines.append(f"  (k_min + 1 = K: no row can stop before depth K, so every eps runs to depth "
                             f"{ev['depth']}{'; --k-min 0 lets depth 1 stop' if ev['k_min'] else ''})")
            rows = []
            for j, eps in enumerate(ev["eps_grid"]):
                rows.append([f"{eps:g}"]
                            + [f"{ev['adaptive'][g][j]['success']:.3f} / {ev['adaptive'][g][j]['mean_depth']:.2f}"
                               for g in groups] + ["<- calibrated eps*" if eps == cal["eps"] else ""])
            lines += text_table(["eps"] + groups + [""], rows)

        lines += ["", f"calibrated eps*: the largest eps whose {evaluations[0]['calibration']['calibrated_on']} "
                      f"success stays >= {evaluations[0]['calibration']['retain']:g} x its full-depth success"]
        rows = []
        for ev in evaluations:
            cal = ev["calibration"]
            for i, (group, row) in enumerate(cal["results"].items()):
                rows.append([ev["label"] if i == 0 else "", f"{cal['eps']:g}" if i == 0 else "", group,
                             f"{row['success']:.3f}", f"{row['full_depth_success']:.3f}", f"{row['mean_depth']:.2f}",
                             f"{row['ideal_speedup']:.2f}x"])
        lines += text_table(["checkpoint", "eps*", "split" if "train" in groups else "task", "success", "full depth",
                             "mean depth", "ideal speed-up"], rows)
        for ev in evaluations:
            cal = ev["calibration"]
            notes = [f"WARNING {ev['label']}: {cal['warning']}"] if cal.get("warning") else []
            if not cal["met"]:
                notes.append(f"note {ev['label']}: no eps kept {cal['retain']:g} of full-depth success (noise); "
                             f"eps* is the smallest eps, {cal['eps']:g}")
            if cal.get("note"):
                notes.append(f"note {ev['label']}: {cal['note']}")
            lines += [textwrap.fill(note, 116, initial_indent="  ", subsequent_indent="    ") for note in notes]

        lines += ["", textwrap.fill(f"mean depth at matched success: the smallest mean depth whose success reaches "
                                    f"{evaluations[0]['label']}'s full-depth success less one standard error", 116)]
        rows = [[row["label"], row["split"], f"{row['reference_success']:.3f}", f"{row['floor']:.3f}"]
                + ([f"{row['eps']:g}", f"{row['success']:.3f}", f"{row['mean_depth']:.2f}",
                    f"{row['ideal_speedup']:.2f}x"] if row["eps"] is not None else ["not reached", "", "", ""])
                for row in matched_success(evaluations)]
        lines += text_table(["checkpoint", "split" if "train" in groups else "task", "reference", "floor", "eps",
                             "success", "mean depth", "ideal speed-up"], rows)

    if stress:
        first = next((row for row in stress if "modes" in row), stress[0])
        anchor = paper_anchor(first.get("env_id"), first.get("split", "unseen"))
        paper = (f"the paper (Table 3): {anchor['speedup']}x at mean depth {anchor['mean_depth']:.2f} of "
                 f"{anchor['depth']} with {anchor['num_envs']:,} envs" if anchor
                 else f"the paper's Table 3 is on {PAPER_ANCHORS['unseen']['env_id']}")
        graphs = "off" if not first.get("cuda_graph") else (
            "on, bucket sizes frozen after warm-up" if first.get("freeze_sizes")
            else "on, new bucket sizes captured while timed")
        lines += ["", f"wall clock of one env step ({first.get('env_id', '')}, {first.get('split', '')} tasks, "
                      f"CUDA graphs {graphs}); {paper}"]
        rows, errors = [], []
        for row in stress:
            if "error" in row:
                errors.append(f"  {row['checkpoint']}, {row['num_envs']} envs: failed: {row['error']}")
                continue
            for i, (mode, m) in enumerate(row["modes"].items()):
                rows.append([row["checkpoint"] if i == 0 else "", f"{row['num_envs']}" if i == 0 else "",
                             f"{row['eps']:g}" if i == 0 else "", mode,
                             f"{m['ms_per_step_median']:.3f}", f"{m['ms_per_step_iqr']:.3f}",
                             f"{m['ms_per_step_mean']:.3f}", f"{m['mean_depth']:.2f}",
                             f"{m.get('speedup', 1.0):.2f}x", f"{m.get('ideal_speedup', 1.0):.2f}x",
                             f"{m['fraction_of_ideal']:.0%}" if "fraction_of_ideal" in m else ""])
        if rows:
            lines += text_table(["checkpoint", "envs", "eps", "mode", "ms/step", "IQR", "mean ms", "mean depth",
                                 "speed-up", "ideal", "of ideal"], rows)
        lines += errors
    return "\n".join(lines)


def log_to_wandb(args, name, out_dir, evaluations, stress, plot_paths):
    import wandb
    run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, group=args.wandb_group,
                     tags=list(args.wandb_tags), config=asdict(args), name=name, dir=str(out_dir), job_type="eval")
    tables = {
        "eval/elasticity": (["checkpoint", "split", "depth", "success"],
                            [[ev["label"], g, k + 1, s] for ev in evaluations for g, ss in ev["elasticity"].items()
                             for k, s in enumerate(ss)]),
        "eval/adaptive": (["checkpoint", "split", "eps", "success", "mean_depth", "ideal_speedup", "depth_histogram"],
                          [[ev["label"], g, r["eps"], r["success"], r["mean_depth"], r["ideal_speedup"],
                            json.dumps(r["depth_histogram"])] for ev in evaluations
                           for g, rows in ev["adaptive"].items() for r in rows]),
        "eval/calibration": (["checkpoint", "split", "eps", "success", "mean_depth", "full_depth_success"],
                             [[ev["label"], g, r["eps"], r["success"], r["mean_depth"], r["full_depth_success"]]
                              for ev in evaluations for g, r in ev["calibration"]["results"].items()]),
        "eval/matched_success": (["checkpoint", "split", "reference_success", "floor", "eps", "success", "mean_depth"],
                                 [[r["label"], r["split"], r["reference_success"], r["floor"], r["eps"], r["success"],
                                   r["mean_depth"]] for r in (matched_success(evaluations) if evaluations else [])]),
        "eval/stress": (["checkpoint", "num_envs", "mode", "ms_per_step_median", "ms_per_step_iqr", "mean_depth",
                         "speedup", "ideal_speedup"],
                        [[row["checkpoint"], row["num_envs"], mode, m["ms_per_step_median"], m["ms_per_step_iqr"],
                          m["mean_depth"], m.get("speedup", 1.0), m.get("ideal_speedup", 1.0)]
                         for row in stress if "modes" in row for mode, m in row["modes"].items()]),
    }
    log = {key: wandb.Table(columns=columns, data=data) for key, (columns, data) in tables.items() if data}
    log.update({f"plots/{path.stem}": wandb.Image(str(path)) for path in plot_paths})
    run.log(log)
    run.finish()


# ---------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------
def main(args: Args):
    check_args(args)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cuda.matmul.allow_tf32 = True  # as the training scripts run

    loaded = []
    for path, label in zip(args.checkpoints, labels_for(args)):
        module, checkpoint = flexloop_run.load_any_checkpoint(path, args.script)
        network, train_args = module.network_from_checkpoint(checkpoint, device)
        print(f"{label}: {checkpoint['algorithm']} on {checkpoint['env_id']}, network from {module.__file__}; "
              f"the stopping rule's delta_k is its {type(network).__name__}.divergence")
        network.eval().requires_grad_(False)
        check_k_min(args.k_min, network.depth, label)
        loaded.append((label, path, module, checkpoint, network, train_args))
    env_ids = {c["env_id"] for _, _, _, c, _, _ in loaded}
    if len(env_ids) > 1:
        raise ValueError(f"the checkpoints are on different envs {sorted(env_ids)}; evaluate one env per run")
    env_id = env_ids.pop()
    name = f"{env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    out_dir = Path(args.out_dir) if args.out_dir else Path("results") / name
    out_dir.mkdir(parents=True, exist_ok=True)

    evaluations = []
    if not args.skip_eval:
        groups = len(adapter_for(env_id).groups)
        pbar = tqdm(total=2 * groups * len(loaded), desc="eval_adaptive", dynamic_ncols=True)
        for label, path, module, checkpoint, network, train_args in loaded:
            adapter = adapter_for(env_id)(module, network, train_args, env_id, args, device)
            try:
                evaluation = evaluate_checkpoint(adapter, network, args, pbar)
            finally:
                adapter.close()
            evaluations.append({"label": label, "path": str(path), "algorithm": checkpoint["algorithm"],
                                "env_id": env_id, "family": adapter.family, "depth": network.depth,
                                "run_name": checkpoint.get("run_name"), "k_min": args.k_min, **evaluation})
        pbar.close()

    stress = []
    if args.stress_envs and adapter_for(env_id) is not BoxPickAdapter:
        print(f"stress test: skipped; it drives BoxPick checkpoints, and these are on {env_id}")
    elif args.stress_envs:
        # a policy is timed on the env it was trained on: another env's tasks would make its depths meaningless
        if args.stress_env_id not in (None, env_id):
            raise ValueError(f"--stress-env-id {args.stress_env_id} is not the checkpoints' env {env_id}; leave "
                             f"--stress-env-id out to time them on their own env")
        args = replace(args, stress_env_id=env_id)
        for (label, _, _, _, network, _), ev in zip(loaded, evaluations or [None] * len(loaded)):
            eps = args.stress_eps if args.stress_eps is not None else ev["calibration"]["eps"]
            if args.compile:
                network.advance, network.decide = torch.compile(network.advance), torch.compile(network.decide)
            stress += run_stress(network, args, eps, device, label)

    results = {"args": asdict(args), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
               "torch": torch.__version__,
               "stopping_rule": "k* = min({k > k_min : delta_k < eps} | {K}), delta_k = divergence(pi_k, pi_{k-1}) "
                                "(deeper policy first, the training loss's direction), clamped at 0",
               "checkpoints": evaluations,
               "matched_success": matched_success(evaluations) if evaluations else [],
               "warnings": [f"{ev['label']}: {ev['calibration']['warning']}" for ev in evaluations
                            if ev["calibration"]["warning"]],
               "stress": {"paper_anchor": paper_anchor(args.stress_env_id, args.stress_split), "results": stress}
               if args.stress_envs else None}
    tmp = out_dir / ".results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1))
    os.replace(tmp, out_dir / "results.json")

    plot_paths = make_plots(evaluations, out_dir, args) if evaluations else []
    print(summary_tables(evaluations, stress))
    print(f"wrote {out_dir / 'results.json'} (every number above and more) and {len(plot_paths)} plots to {out_dir}")
    if args.track:
        log_to_wandb(args, name, out_dir, evaluations, stress, plot_paths)
    return out_dir


if __name__ == "__main__":
    with flexloop_run.errors_in_one_line():
        main(flexloop_run.parse_args(Args, description=__doc__))
