"""The ant locomotion expert that collects antmaze data: SAC on OGBench's online-ant-xy-v0, in PyTorch.

    python -m envs.ant_expert train --device cuda        # 400k env steps; rerun the same command to resume
    python -m envs.ant_expert evaluate                   # speed along commanded directions, falls
    python -m envs.ogbench_data generate --env antmaze-medium-stitch-v0   # drives the expert through the maze

The task (`ogbench/online_locomotion/`): the ant of OGBench's mazes at 10 Hz, 1000-step episodes that end early
when it falls; a unit direction z, resampled every 100 steps, is appended to the 27-dim observation, and the
reward is the xy displacement of one step dotted with z. OGBench trains its expert on it with
`data_gen_scripts/main_sac.py --env_name=online-ant-xy-v0 --train_steps=400000` and `agents/sac.py`; this file
follows that recipe: one env, 10k uniformly random steps first, then one update per env step, Adam lr 1e-4,
batch 256, (256, 256) GELU MLPs, gamma 0.99, tau 0.005, twin critics with the min of the two, a tanh-squashed
Gaussian actor with state-dependent std and a 0.01-scaled last layer, and the temperature tuned towards the
target entropy -0.5 dim(A). Like OGBench, one loss (critic + actor + temperature) is computed from the same
parameters and taken in one Adam step.

Speed: on a GPU the loop is bound by launch and copy overheads, not by arithmetic (batch 256, 256-wide MLPs). So
on CUDA the update (batch sampling, losses, Adam, target update) and the policy's action are each replayed as a
CUDA graph, a step copies its transition into the replay in one row, and the losses are summed on the device and
read only at log time. `--no-cuda-graph` runs the same functions eagerly; on a CPU they always run eagerly.

Files: `<run-dir>/state.pt` holds everything needed to resume (networks, optimiser, replay, RNG states);
`--expert-path` (default checkpoints/ant_expert/expert.pt) gets the actor alone when training finishes. That
small file is what `envs.ogbench_data` loads; its actions are deterministic (tanh of the mean, OGBench's
temperature 0).
"""

import json
import math
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from typing import Annotated, Optional, Union

import gymnasium
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

import flexloop_run  # capture_cuda_graph: warm-up on a side stream, registered generators

EXPERT_FORMAT = "flexloop-ant-expert-v1"
STATE_FORMAT = "flexloop-ant-expert-state-v1"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_EXPERT_PATH = os.path.join(REPO_ROOT, "checkpoints", "ant_expert", "expert.pt")
TRAIN_COMMAND = "python -m envs.ant_expert train --device cuda"
LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # OGBench's GCActor bounds


@dataclass
class TrainArgs:
    """Train the ant expert with SAC (OGBench's recipe); resumes from <run-dir>/state.pt when it exists."""

    seed: int = 0
    """seed of the run (network init, random actions, episode seeds, directions)"""
    device: str = "cpu"
    """torch device for the networks and the replay buffer: cpu or cuda"""
    env_id: str = "online-ant-xy-v0"
    """the task; online-ant-xy-v0 is OGBench's online-ant-v0 with its directional GymXYWrapper"""
    total_steps: int = 400_000
    """env steps in all, random ones included"""
    learning_starts: int = 10_000
    """uniformly random actions for this many steps before the first update"""
    buffer_size: int = 1_000_000
    """replay capacity (OGBench keeps every transition of a 400k-step run)"""
    batch_size: int = 256
    lr: float = 1e-4
    hidden_dims: tuple[int, ...] = (256, 256)
    """hidden layers of the actor and of each critic"""
    gamma: float = 0.99
    tau: float = 0.005
    """target critic update rate"""
    target_entropy_multiplier: float = 0.5
    """target entropy = -multiplier * dim(A)"""
    run_dir: str = "runs/ant_expert"
    """where state.pt (resume) and metrics.jsonl go"""
    expert_path: str = DEFAULT_EXPERT_PATH
    """where the trained actor is written when training finishes"""
    max_minutes: Optional[float] = None
    """save the state and stop after this many minutes (rerun the command to continue)"""
    save_every_minutes: float = 10.0
    """also save the state this often, so a killed run loses little"""
    log_every: int = 5_000
    """print progress every this many env steps"""
    cuda_graph: bool = True
    """on CUDA, replay the update and the action as CUDA graphs (--no-cuda-graph: run them eagerly)"""


@dataclass
class EvaluateArgs:
    """Check a trained expert: its speed along commanded directions on online-ant-xy-v0."""

    expert_path: str = DEFAULT_EXPERT_PATH
    episodes: int = 5
    """1000-step episodes, the direction resampled every 100 steps"""
    seed: int = 100


# ---------------------------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------------------------


def make_env(env_id):
    """online-ant-xy-v0 is not a registered id: OGBench builds it as online-ant-v0 inside its GymXYWrapper."""
    import ogbench.online_locomotion  # noqa: F401  (registers online-ant-v0)

    if env_id == "online-ant-xy-v0":
        from ogbench.online_locomotion.wrappers import GymXYWrapper

        return GymXYWrapper(gymnasium.make("online-ant-v0"), resample_interval=100)
    return gymnasium.make(env_id)


def episode_seed(seed, episode):
    """Each episode's reset seed comes from (seed, episode) alone, so a resumed run resets as an unbroken one."""
    return int(np.random.SeedSequence([seed, episode]).generate_state(1)[0])


# ---------------------------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------------------------


def mlp(in_dim, hidden_dims, out_dim=None):
    """Linear + GELU layers with OGBench's init (Glorot uniform, zero bias); a last linear layer if out_dim."""
    layers, dim = [], in_dim
    for h in hidden_dims:
        layers += [nn.Linear(dim, h), nn.GELU()]
        dim = h
    if out_dim is not None:
        layers.append(nn.Linear(dim, out_dim))
    for layer in layers:
        if isinstance(layer, nn.Linear):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.zeros_(layer.bias)
    return nn.Sequential(*layers)


class TwinCritic(nn.Module):
    """Two independent Q(s, a) MLPs; forward returns both, shape (2, batch)."""

    def __init__(self, obs_dim, action_dim, hidden_dims):
        super().__init__()
        self.qs = nn.ModuleList([mlp(obs_dim + action_dim, hidden_dims, 1) for _ in range(2)])

    def forward(self, obs, actions):
        x = torch.cat([obs, actions], dim=-1)
        return torch.stack([q(x).squeeze(-1) for q in self.qs])


class Actor(nn.Module):
    """Tanh-squashed Gaussian policy with a state-dependent std."""

    def __init__(self, obs_dim, action_dim, hidden_dims):
        super().__init__()
        self.trunk = mlp(obs_dim, hidden_dims)
        self.mean = nn.Linear(hidden_dims[-1], action_dim)
        self.log_std = nn.Linear(hidden_dims[-1], action_dim)
        for head in (self.mean, self.log_std):  # OGBench scales the last layer's init by 0.01 (variance)
            nn.init.xavier_uniform_(head.weight, gain=math.sqrt(0.01))
            nn.init.zeros_(head.bias)

    def forward(self, obs):
        h = self.trunk(obs)
        return self.mean(h), self.log_std(h).clamp(LOG_STD_MIN, LOG_STD_MAX)

    def sample(self, obs):
        """A reparameterised action in (-1, 1) and its log-probability under the squashed Gaussian."""
        mean, log_std = self(obs)
        u = mean + log_std.exp() * torch.randn_like(mean)
        log_prob = (-0.5 * ((u - mean) / log_std.exp()) ** 2 - log_std - 0.5 * math.log(2 * math.pi)).sum(-1)
        # log |d tanh(u) / du| = log(1 - tanh(u)^2), written in a form that stays finite for large |u|
        log_prob = log_prob - (2 * (math.log(2) - u - F.softplus(-2 * u))).sum(-1)
        return torch.tanh(u), log_prob

    @torch.no_grad()
    def act(self, obs):
        """The deterministic action (temperature 0), as data collection uses it."""
        mean, _ = self(obs)
        return torch.tanh(mean)


# ---------------------------------------------------------------------------------------------------------------
# Replay buffer (on the training device)
# ---------------------------------------------------------------------------------------------------------------


class ReplayBuffer:
    """Each transition is one row (observation, action, reward, next observation, mask) of one tensor, so a step
    writes its transition with one copy and a batch is one gather. `filled` holds the size on the device too: a
    CUDA graph reads it at every replay, where a Python int would stay frozen at its value at capture."""

    SCALARS = ("rewards", "masks")

    def __init__(self, capacity, obs_dim, action_dim, device):
        self.capacity, self.size, self.pos = capacity, 0, 0
        widths = {"observations": obs_dim, "actions": action_dim, "rewards": 1, "next_observations": obs_dim,
                  "masks": 1}  # masks: 0 when the ant fell (a true end), 1 at a time limit
        self.columns, start = {}, 0
        for key, width in widths.items():
            self.columns[key] = slice(start, start + width)
            start += width
        self.rows = torch.zeros(capacity, start, device=device)
        self.data = self.fields(self.rows)  # views of the rows, by name
        self.filled = torch.zeros((), dtype=torch.long, device=device)
        self.staging = torch.zeros(start, pin_memory=self.rows.is_cuda)  # the host side of a row's copy

    def fields(self, rows):
        return {key: rows[:, s.start] if key in self.SCALARS else rows[:, s] for key, s in self.columns.items()}

    def add(self, obs, action, reward, next_obs, mask):
        row = self.staging.numpy()
        for key, value in zip(self.columns, (obs, action, reward, next_obs, mask)):
            row[self.columns[key]] = value
        # a blocking copy: the staging row may be refilled at the next step (the stream is idle here anyway)
        self.rows[self.pos].copy_(self.staging)
        self.pos = (self.pos + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        self.filled.fill_(self.size)  # a kernel argument, not a host-to-device copy

    def sample(self, batch_size, generator):
        """Uniform rows of [0, size), size read on the device. A 62-bit integer modulo the size is uniform to
        within size / 2^62, and unlike (rand * size).long() it cannot round up to size."""
        draws = torch.randint(2**62, (batch_size,), device=self.rows.device, generator=generator)
        return self.fields(self.rows[draws % self.filled])

    def state_dict(self):  # only the filled part, in insertion order, so a resumed buffer is the same buffer
        order = torch.arange(self.pos - self.size, self.pos) % self.capacity
        return {key: value[order.to(value.device)].cpu() for key, value in self.data.items()}

    def load_state_dict(self, state):
        n = min(len(state["rewards"]), self.capacity)  # a smaller buffer keeps the newest transitions
        for key, value in state.items():
            self.data[key][:n] = value[len(value) - n:].to(self.data[key].device)
        self.size, self.pos = n, n % self.capacity
        self.filled.fill_(self.size)


# ---------------------------------------------------------------------------------------------------------------
# Losses and update
# ---------------------------------------------------------------------------------------------------------------


def sac_losses(batch, actor, critic, critic_target, log_alpha, gamma, target_entropy):
    """OGBench's SAC losses, all from the current parameters; their sum takes one optimiser step."""
    alpha = log_alpha.exp()
    with torch.no_grad():
        next_actions, next_log_probs = actor.sample(batch["next_observations"])
        next_q = critic_target(batch["next_observations"], next_actions).min(dim=0).values
        target_q = batch["rewards"] + gamma * batch["masks"] * (next_q - alpha * next_log_probs)
    critic_loss = (critic(batch["observations"], batch["actions"]) - target_q).pow(2).mean()

    actions, log_probs = actor.sample(batch["observations"])
    critic.requires_grad_(False)  # the actor's loss moves only the actor
    q = critic(batch["observations"], actions).min(dim=0).values
    critic.requires_grad_(True)
    actor_loss = (alpha.detach() * log_probs - q).mean()

    entropy = -log_probs.detach().mean()
    alpha_loss = alpha * (entropy - target_entropy)  # raises alpha while the entropy is below its target
    return {"critic_loss": critic_loss, "actor_loss": actor_loss, "alpha_loss": alpha_loss, "entropy": entropy}


def update(batch, actor, critic, critic_target, log_alpha, optimizer, args, target_entropy):
    losses = sac_losses(batch, actor, critic, critic_target, log_alpha, args.gamma, target_entropy)
    optimizer.zero_grad(set_to_none=True)
    (losses["critic_loss"] + losses["actor_loss"] + losses["alpha_loss"]).backward()
    optimizer.step()
    with torch.no_grad():
        target_params, params = list(critic_target.parameters()), list(critic.parameters())
        torch._foreach_lerp_(target_params, params, args.tau)  # target <- (1 - tau) target + tau online
    return losses


LOSS_NAMES = ("critic_loss", "actor_loss", "alpha_loss", "entropy")


def make_update_step(args, nets, log_alpha, optimizer, buffer, generator, target_entropy, loss_sums):
    """The loop's update: a batch drawn on the device, `update`, and the losses added to loss_sums (read at log
    time). Fixed shapes and no host sync, so on CUDA it is captured once (`capture_update`) and replayed."""
    actor, critic, critic_target = nets

    def update_step():
        batch = buffer.sample(args.batch_size, generator)
        losses = update(batch, actor, critic, critic_target, log_alpha, optimizer, args, target_entropy)
        with torch.no_grad():
            loss_sums.add_(torch.stack([losses[name].detach() for name in LOSS_NAMES]))
        return losses

    return update_step


def capture_update(update_step, nets, log_alpha, optimizer, loss_sums, generator):
    """update_step as a CUDA graph. The capture's warm-up calls do real updates; they are undone here (parameters,
    temperature, Adam's moments and step counts, loss sums put back in place), so the run still takes exactly one
    update per env step. Their random draws are not put back: they only move the generators on."""
    kept = [p for net in nets for p in net.parameters()] + [log_alpha, loss_sums]
    saved = [t.detach().clone() for t in kept]
    saved_adam = {p: {k: v.clone() for k, v in state.items()} for p, state in optimizer.state.items()}
    graphed = flexloop_run.capture_cuda_graph(update_step, [generator])
    with torch.no_grad():
        for t, value in zip(kept, saved):
            t.copy_(value)
        for p, state in optimizer.state.items():
            for k, v in state.items():
                if p in saved_adam:
                    v.copy_(saved_adam[p][k])
                else:  # state the warm-ups created: zero, as Adam's own first step finds it
                    v.zero_()
    return graphed


def make_policy(actor, obs_dim, action_dim, device, graphed):
    """act(obs) -> a sampled action: one copy to the device and one back per step, through pinned host buffers on
    CUDA. With graphed, the actor's forward is a CUDA graph (its warm-ups only draw random numbers)."""
    pinned = device.type == "cuda"
    obs_host = torch.zeros(1, obs_dim, pin_memory=pinned)
    action_host = torch.zeros(1, action_dim, pin_memory=pinned)
    obs_device = torch.zeros(1, obs_dim, device=device)

    def sample():
        with torch.no_grad():
            return actor.sample(obs_device)[0]

    if graphed:
        sample = flexloop_run.capture_cuda_graph(sample, [])

    def act(obs):
        obs_host.numpy()[0] = obs
        obs_device.copy_(obs_host, non_blocking=True)  # obs_host is refilled only after the sync below
        action_host.copy_(sample(), non_blocking=True)
        if pinned:
            torch.cuda.current_stream(device).synchronize()
        return action_host.numpy()[0].copy()

    return act


# ---------------------------------------------------------------------------------------------------------------
# Files: the resumable state and the expert
# ---------------------------------------------------------------------------------------------------------------


def atomic_save(obj, path):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill mid-write never leaves a broken file under the real name


def save_expert(actor, path, env_id, env_steps, hidden_dims):
    atomic_save(
        {
            "format": EXPERT_FORMAT,
            "env_id": env_id,
            "env_steps": env_steps,
            "obs_dim": actor.trunk[0].in_features,
            "action_dim": actor.mean.out_features,
            "hidden_dims": list(hidden_dims),
            "actor": {k: v.cpu() for k, v in actor.state_dict().items()},
        },
        path,
    )


def load_expert(path, device="cpu"):
    """(actor, info) from an expert file; a one-line error that names the training command if it is missing."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no ant expert at {path}: train it with `{TRAIN_COMMAND}` (or pass its path)")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise ValueError(f"could not read the ant expert {path} ({type(e).__name__}); retrain with `{TRAIN_COMMAND}`")
    if not isinstance(saved, dict) or saved.get("format") != EXPERT_FORMAT:
        raise ValueError(f"{path} is not an ant expert file (format {EXPERT_FORMAT}); retrain with `{TRAIN_COMMAND}`")
    actor = Actor(saved["obs_dim"], saved["action_dim"], saved["hidden_dims"])
    actor.load_state_dict(saved["actor"])
    info = {k: saved[k] for k in ("env_id", "env_steps", "obs_dim", "action_dim", "hidden_dims")}
    return actor.to(device).eval(), info


def np_global_state():
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss, "cached": cached}


def set_np_global_state(s):
    np.random.set_state(("MT19937", s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached"]))


def save_state(path, step, episode, nets, optimizer, log_alpha, buffer, rngs, device, args, stats):
    actor, critic, critic_target = nets
    action_rng, sample_rng = rngs
    state = {
        "format": STATE_FORMAT,
        "args": asdict(args),
        "global_step": step,
        "episode": episode,
        "actor": actor.state_dict(),
        "critic": critic.state_dict(),
        "critic_target": critic_target.state_dict(),
        "log_alpha": log_alpha.detach().cpu(),
        "optimizer": optimizer.state_dict(),
        "buffer": buffer.state_dict(),
        "action_rng": json.dumps(action_rng.bit_generator.state),
        "sample_rng": sample_rng.get_state(),
        "np_global": np_global_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.zeros(0, dtype=torch.uint8),
        "stats": stats,
    }
    atomic_save(state, path)


# ---------------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------------


def resolve_device(name):
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: --device {name} asked for a GPU but torch sees none; use --device cpu")
    return torch.device(name)


def train(args):
    if args.learning_starts < 1 or args.batch_size < 1 or args.total_steps < 1:
        raise SystemExit("error: --total-steps, --learning-starts and --batch-size must be >= 1")
    device = resolve_device(args.device)
    env = make_env(args.env_id)
    obs_dim, action_dim = env.observation_space.shape[0], env.action_space.shape[0]
    if not (np.all(env.action_space.low == -1.0) and np.all(env.action_space.high == 1.0)):
        raise SystemExit(f"error: {args.env_id}'s actions are not in [-1, 1], the tanh policy's range")

    # seeding: torch for init and the policy's noise, numpy's global RNG for the wrapper's directions, a Generator
    # for the random warm-up actions, a torch Generator on the device for the replay's batches
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    action_rng = np.random.default_rng(args.seed)
    sample_rng = torch.Generator(device).manual_seed(args.seed)
    rngs = (action_rng, sample_rng)

    actor = Actor(obs_dim, action_dim, args.hidden_dims).to(device)
    critic = TwinCritic(obs_dim, action_dim, args.hidden_dims).to(device)
    critic_target = TwinCritic(obs_dim, action_dim, args.hidden_dims).to(device)
    critic_target.load_state_dict(critic.state_dict())
    nets = (actor, critic, critic_target)
    log_alpha = torch.zeros((), device=device, requires_grad=True)  # alpha starts at 1, as OGBench's LogParam
    # on CUDA a fused Adam with capturable step counts (on the device): a CUDA graph can replay its step
    on_cuda = device.type == "cuda"
    adam_flags = {"foreach": not on_cuda, "fused": on_cuda, "capturable": on_cuda}
    optimizer = torch.optim.Adam([*actor.parameters(), *critic.parameters(), log_alpha], lr=args.lr, **adam_flags)
    target_entropy = -args.target_entropy_multiplier * action_dim
    buffer = ReplayBuffer(min(args.buffer_size, args.total_steps), obs_dim, action_dim, device)

    # resume
    state_path = os.path.join(args.run_dir, "state.pt")
    global_step, episode = 0, 0
    stats = {"episode_returns": [], "episode_lengths": []}
    if os.path.exists(state_path):
        s = torch.load(state_path, map_location="cpu", weights_only=True)
        if s.get("format") != STATE_FORMAT or s["args"]["env_id"] != args.env_id:
            raise SystemExit(f"error: {state_path} is not a {args.env_id} expert run; pick another --run-dir")
        if tuple(s["args"]["hidden_dims"]) != tuple(args.hidden_dims):
            raise SystemExit(f"error: {state_path} has hidden dims {tuple(s['args']['hidden_dims'])}, not "
                             f"{tuple(args.hidden_dims)}; pass the same --hidden-dims or another --run-dir")
        actor.load_state_dict(s["actor"])
        critic.load_state_dict(s["critic"])
        critic_target.load_state_dict(s["critic_target"])
        with torch.no_grad():
            log_alpha.copy_(s["log_alpha"])
        for group in s["optimizer"]["param_groups"]:
            group.update(adam_flags)  # the file holds the saving device's flags; this device's go in their place
        optimizer.load_state_dict(s["optimizer"])
        buffer.load_state_dict(s["buffer"])
        action_rng.bit_generator.state = json.loads(s["action_rng"])
        # (a CPU generator's state does not fit a CUDA one: a run moved between devices draws batches afresh)
        if "sample_rng" in s and s["sample_rng"].numel() == sample_rng.get_state().numel():
            sample_rng.set_state(s["sample_rng"])
        set_np_global_state(s["np_global"])
        torch.set_rng_state(s["torch_rng"])
        if device.type == "cuda" and len(s["cuda_rng"]):
            torch.cuda.set_rng_state(s["cuda_rng"], device)
        global_step, episode, stats = s["global_step"], s["episode"], s["stats"]
        print(f"resuming {state_path} at step {global_step:,} (a fresh episode starts)", flush=True)
    if global_step >= args.total_steps:
        print(f"{state_path} is already at step {global_step:,} >= --total-steps {args.total_steps:,}")

    # the update and the action; on CUDA the update is captured at the first update (its warm-ups need data)
    graphed = on_cuda and args.cuda_graph
    loss_sums = torch.zeros(len(LOSS_NAMES), device=device)
    update_step = make_update_step(args, nets, log_alpha, optimizer, buffer, sample_rng, target_entropy, loss_sums)
    update_captured = not graphed
    act = make_policy(actor, obs_dim, action_dim, device, graphed)

    # stop cleanly on SIGTERM (a scheduler's stop) as on Ctrl-C: the loop saves, then exits
    stop = {"signal": None}
    previous_handler = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal="SIGTERM"))

    start_time = last_save = last_log_time = time.time()
    last_log_step = global_step
    obs, episode_return, episode_length = None, 0.0, 0
    updates_since_log = 0
    os.makedirs(args.run_dir, exist_ok=True)
    metrics_file = open(os.path.join(args.run_dir, "metrics.jsonl"), "a")
    try:
        while global_step < args.total_steps:
            # a new episode starts lazily, so a state saved between episodes resumes exactly
            if obs is None:
                obs, _ = env.reset(seed=episode_seed(args.seed, episode))
                episode_return, episode_length = 0.0, 0

            # act: uniform at first, then a sample of the policy
            if global_step < args.learning_starts:
                action = action_rng.uniform(-1.0, 1.0, action_dim)
            else:
                action = act(obs)
            next_obs, reward, terminated, truncated, _ = env.step(action)
            buffer.add(obs, action, reward, next_obs, 0.0 if terminated else 1.0)
            global_step += 1
            episode_return += float(reward)
            episode_length += 1
            obs = next_obs
            if terminated or truncated:
                stats["episode_returns"] = (stats["episode_returns"] + [episode_return])[-20:]
                stats["episode_lengths"] = (stats["episode_lengths"] + [episode_length])[-20:]
                obs, episode = None, episode + 1

            # learn: one update per env step once the warm-up is over
            if global_step >= args.learning_starts:
                if not update_captured:
                    update_step = capture_update(update_step, nets, log_alpha, optimizer, loss_sums, sample_rng)
                    update_captured = True
                update_step()
                updates_since_log += 1

            # log (the only host syncs besides acting): the losses' means since the last log
            if global_step % args.log_every == 0 or global_step == args.total_steps:
                now = time.time()
                row = {
                    "global_step": global_step,
                    "charts/SPS": (global_step - last_log_step) / max(now - last_log_time, 1e-9),
                    "charts/episodic_return": float(np.mean(stats["episode_returns"] or [0.0])),
                    "charts/episodic_length": float(np.mean(stats["episode_lengths"] or [0.0])),
                    "losses/alpha": float(log_alpha.detach().exp()),
                }
                if updates_since_log:
                    means = (loss_sums / updates_since_log).tolist()
                    row.update({f"losses/{name}": mean for name, mean in zip(LOSS_NAMES, means)})
                    loss_sums.zero_()
                    updates_since_log = 0
                last_log_step, last_log_time = global_step, now
                metrics_file.write(json.dumps(row) + "\n")
                metrics_file.flush()
                print(
                    f"step {global_step:,}/{args.total_steps:,}  sps {row['charts/SPS']:.0f}  "
                    f"return(last 20 eps) {row['charts/episodic_return']:.2f}  "
                    f"length {row['charts/episodic_length']:.0f}  alpha {row['losses/alpha']:.3f}  "
                    f"critic_loss {row.get('losses/critic_loss', float('nan')):.4f}",
                    flush=True,
                )

            # stop or checkpoint
            minutes = (time.time() - start_time) / 60
            if stop["signal"] or (args.max_minutes is not None and minutes >= args.max_minutes):
                save_state(state_path, global_step, episode, nets, optimizer, log_alpha, buffer, rngs, device,
                           args, stats)
                why = stop["signal"] or f"--max-minutes {args.max_minutes}"
                print(f"stopped ({why}) at step {global_step:,}; saved {state_path}; rerun the command to resume")
                return None
            if time.time() - last_save >= 60 * args.save_every_minutes:
                save_state(state_path, global_step, episode, nets, optimizer, log_alpha, buffer, rngs, device,
                           args, stats)
                last_save = time.time()
    except KeyboardInterrupt:
        save_state(state_path, global_step, episode, nets, optimizer, log_alpha, buffer, rngs, device,
                   args, stats)
        print(f"interrupted at step {global_step:,}; saved {state_path}; rerun the command to resume")
        return None
    finally:
        signal.signal(signal.SIGTERM, previous_handler)
        metrics_file.close()
        env.close()

    save_state(state_path, global_step, episode, nets, optimizer, log_alpha, buffer, rngs, device,
               args, stats)
    save_expert(actor, args.expert_path, args.env_id, global_step, args.hidden_dims)
    print(f"done: {global_step:,} env steps; expert written to {args.expert_path}")
    return actor


# ---------------------------------------------------------------------------------------------------------------
# Self-check
# ---------------------------------------------------------------------------------------------------------------


def evaluate(args):
    """Runs the deterministic expert; returns its mean speed (m/s) along the commanded directions and falls."""
    actor, info = load_expert(args.expert_path)
    env = make_env(info["env_id"])
    dt = env.unwrapped.dt
    np.random.seed(args.seed)
    speeds, falls = [], 0
    for e in range(args.episodes):
        obs, _ = env.reset(seed=episode_seed(args.seed, e))
        progress, steps, done = 0.0, 0, False
        while not done:
            action = actor.act(torch.as_tensor(obs, dtype=torch.float32)[None])[0].numpy()
            obs, reward, terminated, truncated, _ = env.step(action)
            progress += reward  # the reward is the displacement along the current direction
            steps += 1
            done = terminated or truncated
        falls += int(terminated)
        speeds.append(progress / (steps * dt))
        print(f"episode {e}: {steps} steps, speed along the commanded direction {speeds[-1]:.3f} m/s", flush=True)
    env.close()
    result = {"speed_mean": float(np.mean(speeds)), "speed_min": float(np.min(speeds)), "falls": falls,
              "episodes": args.episodes, "env_steps_trained": info["env_steps"]}
    print(
        f"expert {args.expert_path} ({info['env_steps']:,} env steps): speed along the commanded direction "
        f"{result['speed_mean']:.3f} m/s (worst episode {result['speed_min']:.3f}), fell in {falls}/{args.episodes}"
    )
    print("then check it on the maze as data collection drives it: "
          f"python -m envs.ogbench_data check --env antmaze-medium-stitch-v0 --expert {args.expert_path}")
    return result


def main(argv=None):
    args = tyro.cli(
        Union[
            Annotated[TrainArgs, tyro.conf.subcommand("train")],
            Annotated[EvaluateArgs, tyro.conf.subcommand("evaluate")],
        ],
        args=argv,
        description=__doc__.split("\n")[0],
    )
    try:
        if isinstance(args, TrainArgs):
            train(args)
        else:
            evaluate(args)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
