"""OGBench data for FlexLoop's GC-IQL: load a dataset, sample goal-conditioned batches on the device, and
regenerate all five datasets locally at OGBench's size: manipulation and pointmaze with the oracles that ship inside
the `ogbench` package, antmaze with the ant expert of envs/ant_expert.py.

    from envs.ogbench_data import DATASETS, load_dataset, make_eval_env
    train = load_dataset("cube-double-play-v0", device="cuda")          # a GCDataset
    batch = train.sample(1024, generator)                                 # dict of tensors, no host syncs

    python -m envs.ogbench_data generate --env scene-play-v0 --out ~/.ogbench/data     # 1000 episodes, all cores

`ogbench` (and with it mujoco) is imported only inside the functions that need it, so importing this module
for BoxPick or LightsOut costs neither.
"""

import argparse
import multiprocessing
import os
import socket
import sys
import time
import urllib.error
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

# ---------------------------------------------------------------------------------------------------------------
# Per-dataset facts (docs/reference.md, OGBench)
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DatasetSpec:
    family: str  # "manipulation" or "navigation"
    env_id: str  # the gymnasium id of the evaluation env (the dataset name without the dataset type)
    obs_dim: int  # = goal dim
    action_dim: int
    episode_limit: int  # evaluation episode length (the env's TimeLimit)
    actor_geom_sample: bool  # False: trajectory goals for the actor are uniform over the future
    gen_episodes: int  # reference number of train episodes when generating
    gen_episode_steps: int  # reference states per episode when generating


# The training hyperparameters of each dataset (the BC weight alpha, lambda_depth, the actor's goal probabilities)
# live with GC-IQL: flexloop_gciql.DATASET_HYPERPARAMETERS. Actor trajectory goals are uniform over the future.
_MANIP = dict(family="manipulation", action_dim=5, actor_geom_sample=False, gen_episodes=1000, gen_episode_steps=1001)
_NAV = dict(family="navigation", actor_geom_sample=False, gen_episodes=5000, gen_episode_steps=201)
DATASETS = {
    "scene-play-v0": DatasetSpec(env_id="scene-v0", obs_dim=40, episode_limit=750, **_MANIP),
    "cube-double-play-v0": DatasetSpec(env_id="cube-double-v0", obs_dim=37, episode_limit=500, **_MANIP),
    "puzzle-4x4-play-v0": DatasetSpec(env_id="puzzle-4x4-v0", obs_dim=83, episode_limit=500, **_MANIP),
    "antmaze-medium-stitch-v0": DatasetSpec(
        env_id="antmaze-medium-v0", obs_dim=29, action_dim=8, episode_limit=1000, **_NAV
    ),
    "pointmaze-large-stitch-v0": DatasetSpec(
        env_id="pointmaze-large-v0", obs_dim=2, action_dim=2, episode_limit=1000, **_NAV
    ),
}

# Value/critic goals are the same for every dataset: current 0.2, trajectory 0.5 (geometric in gamma), random 0.3.
VALUE_P_CURGOAL, VALUE_P_TRAJGOAL, VALUE_P_RANDOMGOAL = 0.2, 0.5, 0.3
GAMMA = 0.99

# goal kinds reported by GCDataset.sample(..., return_goal_kind=True)
GOAL_CURRENT, GOAL_TRAJECTORY, GOAL_RANDOM = 0, 1, 2

OGBENCH_URL = "https://rail.eecs.berkeley.edu/datasets/ogbench"
DEFAULT_DATASET_DIR = "~/.ogbench/data"  # the ogbench package's default


def get_spec(env_name):
    if env_name not in DATASETS:
        raise ValueError(f"unknown OGBench dataset {env_name!r}; supported: {', '.join(DATASETS)}")
    return DATASETS[env_name]


def envs_are_small(env_name):
    """Whether every episode of an evaluation fits side by side: a navigation env takes about 2 MB, a
    manipulation env about 160 MB (docs/benchmarks.md), so 800 of those would not fit a 128 GB machine."""
    return get_spec(env_name).family == "navigation"


# ---------------------------------------------------------------------------------------------------------------
# Goal-conditioned sampling on the device
# ---------------------------------------------------------------------------------------------------------------


class GCDataset:
    """A compact OGBench dataset held as torch tensors on one device, with OGBench's goal-conditioned sampling.

    Layout (ogbench's `compact_dataset=True`): each trajectory is a run of states s_0..s_T; `valids` is 0 only at
    s_T, so for every valid index i the transition is (obs[i], act[i], obs[i + 1]) inside one trajectory.
    `final_idxs[i]` is the last *valid* index of i's trajectory (defined for valid i): OGBench clips trajectory goals
    there. `traj_ids[i]` numbers the trajectories 0, 1, ...
    """

    def __init__(
        self,
        observations,
        actions,
        valids,
        device="cpu",
        gamma=GAMMA,
        actor_p_curgoal=0.0,
        actor_p_trajgoal=1.0,
        actor_p_randomgoal=0.0,
        actor_geom_sample=False,
        value_p_curgoal=VALUE_P_CURGOAL,
        value_p_trajgoal=VALUE_P_TRAJGOAL,
        value_p_randomgoal=VALUE_P_RANDOMGOAL,
    ):
        observations = np.asarray(observations)
        actions = np.asarray(actions)
        valids = np.asarray(valids).astype(bool)
        n = len(observations)
        if len(actions) != n or len(valids) != n:
            raise ValueError(f"observations, actions and valids differ in length: {n}, {len(actions)}, {len(valids)}")
        if n == 0 or valids[-1]:
            raise ValueError("the dataset must end with the (invalid) last state of a trajectory; is it compact?")
        for name, ps in [
            ("value", (value_p_curgoal, value_p_trajgoal, value_p_randomgoal)),
            ("actor", (actor_p_curgoal, actor_p_trajgoal, actor_p_randomgoal)),
        ]:
            if min(ps) < 0 or not np.isclose(sum(ps), 1.0):
                raise ValueError(f"{name} goal probabilities {ps} must be >= 0 and sum to 1")
        if not 0.0 < gamma < 1.0:
            raise ValueError(f"gamma must be in (0, 1), got {gamma}")

        # Trajectory boundaries, computed once on the host. The invalid indices are the trajectories' last states.
        (end_locs,) = np.nonzero(~valids)
        (valid_idxs,) = np.nonzero(valids)
        if len(valid_idxs) == 0:
            raise ValueError("the dataset has no valid transition (every trajectory is a single state)")
        traj_ids = np.searchsorted(end_locs, np.arange(n), side="left")  # first end at or after i
        final_idxs = end_locs[traj_ids] - 1

        self.device = torch.device(device)
        self.observations = torch.as_tensor(observations, dtype=torch.float32).to(self.device)
        self.actions = torch.as_tensor(actions, dtype=torch.float32).to(self.device)
        self.valids = torch.as_tensor(valids, dtype=torch.float32).to(self.device)
        self.valid_idxs = torch.as_tensor(valid_idxs, dtype=torch.long).to(self.device)
        self.final_idxs = torch.as_tensor(final_idxs, dtype=torch.long).to(self.device)
        self.traj_ids = torch.as_tensor(traj_ids, dtype=torch.long).to(self.device)
        self.size = n
        self.num_valid = len(valid_idxs)
        self.num_trajectories = len(end_locs)
        self.obs_dim = self.observations.shape[1]
        self.action_dim = self.actions.shape[1]
        self.gamma = gamma
        self.value_probs = (value_p_curgoal, value_p_trajgoal, value_p_randomgoal)
        self.actor_probs = (actor_p_curgoal, actor_p_trajgoal, actor_p_randomgoal)
        self.actor_geom_sample = actor_geom_sample

    @classmethod
    def from_ogbench(cls, data, spec, device="cpu", gamma=GAMMA, actor_goals=(0.0, 1.0, 0.0)):
        """Build from the dict that `ogbench.load_dataset(..., compact_dataset=True)` returns. actor_goals: the
        probabilities of the current state, a future state of the trajectory and a random state as actor goal."""
        if "valids" not in data:
            raise ValueError("expected a compact ogbench dataset (with 'valids'); load it with compact_dataset=True")
        return cls(
            data["observations"],
            data["actions"],
            data["valids"],
            device=device,
            gamma=gamma,
            actor_p_curgoal=actor_goals[0],
            actor_p_trajgoal=actor_goals[1],
            actor_p_randomgoal=actor_goals[2],
            actor_geom_sample=spec.actor_geom_sample,
        )

    def __len__(self):
        return self.num_valid

    def random_valid_idxs(self, batch_size, generator=None):
        r = torch.randint(self.num_valid, (batch_size,), generator=generator, device=self.device)
        return self.valid_idxs[r]

    def sample_goals(self, idxs, p_curgoal, p_trajgoal, geom_sample, generator=None):
        """Goal indices for `idxs`, and the kind of each (GOAL_CURRENT / GOAL_TRAJECTORY / GOAL_RANDOM).

        Follows ogbench/impls/utils/datasets.py GCDataset.sample_goals:
        - trajectory, geometric: offset ~ Geometric(1 - gamma) on {1, 2, ...}, i.e. P(j) = (1 - gamma) gamma^(j-1),
          and goal = min(i + offset, last valid index of i's trajectory);
        - trajectory, uniform: goal = round(lo * d + final * (1 - d)), d ~ U[0, 1), lo = min(i + 1, final),
          i.e. (about) uniform over the future valid states of the trajectory;
        - random: a uniformly random valid index of the dataset.
        OGBench draws traj-vs-random and then current-vs-that with two coins; one uniform draw gives the same
        marginals (current p_cur, trajectory p_traj, random 1 - p_cur - p_traj).
        """
        b = idxs.shape[0]
        final = self.final_idxs[idxs]
        if geom_sample:
            offsets = torch.empty(b, device=self.device).geometric_(1.0 - self.gamma, generator=generator).long()
            traj_goals = torch.minimum(idxs + offsets, final)
        else:
            lo = torch.minimum(idxs + 1, final)
            d = torch.rand(b, device=self.device, generator=generator)
            traj_goals = lo + torch.round((final - lo).float() * (1.0 - d)).long()
        random_goals = self.random_valid_idxs(b, generator)
        u = torch.rand(b, device=self.device, generator=generator)
        kind = torch.full((b,), GOAL_RANDOM, dtype=torch.long, device=self.device)
        kind = torch.where(u < p_curgoal + p_trajgoal, GOAL_TRAJECTORY, kind)
        kind = torch.where(u < p_curgoal, GOAL_CURRENT, kind)
        goals = torch.where(kind == GOAL_TRAJECTORY, traj_goals, random_goals)
        goals = torch.where(kind == GOAL_CURRENT, idxs, goals)
        return goals, kind

    def sample(self, batch_size, generator=None, return_goal_kind=False):
        """A batch of goal-conditioned transitions, all torch ops on self.device (no host syncs).

        `generator` must be a torch.Generator on self.device (or None for the global one).
        Keys: observations, actions, next_observations, value_goals, actor_goals, rewards, masks.
        Rewards and masks follow OGBench: success = (current index == value goal index), reward = success - 1
        (0 at the goal, -1 elsewhere), mask = 1 - success.
        With return_goal_kind=True it also returns the indices (idxs, value_goal_idxs, actor_goal_idxs) and the goal
        kinds (value_goal_kinds, actor_goal_kinds), for tests and diagnostics.
        """
        idxs = self.random_valid_idxs(batch_size, generator)
        p_cur, p_traj, _ = self.value_probs
        value_goal_idxs, value_kind = self.sample_goals(idxs, p_cur, p_traj, True, generator)
        p_cur, p_traj, _ = self.actor_probs
        actor_goal_idxs, actor_kind = self.sample_goals(idxs, p_cur, p_traj, self.actor_geom_sample, generator)

        successes = (idxs == value_goal_idxs).float()
        batch = {
            "observations": self.observations[idxs],
            "actions": self.actions[idxs],
            "next_observations": self.observations[idxs + 1],  # valid idxs never end a trajectory
            "value_goals": self.observations[value_goal_idxs],
            "actor_goals": self.observations[actor_goal_idxs],
            "rewards": successes - 1.0,
            "masks": 1.0 - successes,
        }
        if return_goal_kind:
            batch.update(
                idxs=idxs,
                value_goal_idxs=value_goal_idxs,
                actor_goal_idxs=actor_goal_idxs,
                value_goal_kinds=value_kind,
                actor_goal_kinds=actor_kind,
            )
        return batch


# ---------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------


def missing_dataset_message(env_name, paths, dataset_dir=None):
    dataset_dir = dataset_dir or DEFAULT_DATASET_DIR
    lines = [
        f"OGBench dataset {env_name!r} not found: {', '.join(str(p) for p in paths)}.",
        "Download it (train and -val files) with",
        f"    python -c \"import ogbench; ogbench.download_datasets(['{env_name}'], '{dataset_dir}')\"",
        f"or fetch {OGBENCH_URL}/{env_name}.npz and {OGBENCH_URL}/{env_name}-val.npz into the dataset dir,",
        "then pass --dataset-dir DIR pointing there (in Python: load_dataset(..., dataset_dir=DIR)).",
    ]
    lines += [
        "Or generate it locally (at OGBench's size by default):",
        f"    python -m envs.ogbench_data generate --env {env_name} --out DIR",
        "and pass --dataset-dir DIR (in Python: dataset_dir=DIR).",
    ]
    if env_name.startswith("antmaze"):
        lines += ["(antmaze needs the trained ant expert first: python -m envs.ant_expert train --device cuda)"]
    return "\n".join(lines)


def _read_compact(path, spec, env_name):
    import ogbench

    try:
        data = ogbench.load_dataset(path, compact_dataset=True)
    except Exception as e:  # truncated or foreign file: name it and the fix instead of a zipfile traceback
        raise ValueError(
            f"could not read OGBench dataset file {path} ({type(e).__name__}: {e}); "
            f"delete it and download or regenerate {env_name}"
        ) from e
    obs, act = data["observations"], data["actions"]
    if obs.ndim != 2 or obs.shape[1] != spec.obs_dim or act.ndim != 2 or act.shape[1] != spec.action_dim:
        raise ValueError(
            f"{path} has observations {obs.shape} and actions {act.shape}, but {env_name} needs "
            f"obs dim {spec.obs_dim} and action dim {spec.action_dim}: wrong file?"
        )
    return data


def load_dataset(
    env_name, dataset_dir=None, dataset_path=None, device="cpu", with_val=False, download=True, gamma=GAMMA,
    actor_goals=(0.0, 1.0, 0.0),
):
    """Load an OGBench dataset as a GCDataset on `device` (and its -val split when with_val=True). actor_goals:
    P(current state, future state of the trajectory, random state) as the actor's goal (GC-IQL's per-dataset value).

    dataset_path: a local `<name>.npz` (its val file is `<name>-val.npz` beside it, ogbench's convention); no
    download. Otherwise files are looked up in dataset_dir (default ~/.ogbench/data) and, when missing and
    download=True, downloaded there by `ogbench.download_datasets`. A missing file raises FileNotFoundError that
    says how to download or generate it.
    Returns a GCDataset, or (train, val) when with_val=True.
    """
    spec = get_spec(env_name)
    import ogbench

    if dataset_path is not None:
        train_path = os.path.expanduser(str(dataset_path))
        val_path = train_path.replace(".npz", "-val.npz")
        needed = [train_path, val_path] if with_val else [train_path]
        missing = [p for p in needed if not os.path.exists(p)]
        if missing:
            raise FileNotFoundError(missing_dataset_message(env_name, missing, os.path.dirname(train_path) or "."))
    else:
        dataset_dir = os.path.expanduser(str(dataset_dir or DEFAULT_DATASET_DIR))
        train_path = os.path.join(dataset_dir, f"{env_name}.npz")
        val_path = os.path.join(dataset_dir, f"{env_name}-val.npz")
        needed = [train_path, val_path] if with_val else [train_path]
        missing = [p for p in needed if not os.path.exists(p)]
        if missing and not download:
            raise FileNotFoundError(missing_dataset_message(env_name, missing, dataset_dir))
        if missing:
            # ogbench's urlopen has no timeout: bound each socket read so a blocked network fails instead of hanging
            old_timeout = socket.getdefaulttimeout()
            socket.setdefaulttimeout(60)
            try:
                ogbench.download_datasets([env_name], dataset_dir)
            except (urllib.error.URLError, OSError, ValueError) as e:  # no network, HTTP error, timeout, disk
                raise FileNotFoundError(
                    f"download failed ({type(e).__name__}: {e}).\n"
                    + missing_dataset_message(env_name, missing, dataset_dir)
                ) from e
            finally:
                socket.setdefaulttimeout(old_timeout)

    train = GCDataset.from_ogbench(_read_compact(train_path, spec, env_name), spec, device, gamma, actor_goals)
    if not with_val:
        return train
    val = GCDataset.from_ogbench(_read_compact(val_path, spec, env_name), spec, device, gamma, actor_goals)
    return train, val


def make_eval_env(env_name, **env_kwargs):
    """The evaluation env of a dataset (no download): reset with options=dict(task_id=k) for k in 1..5."""
    get_spec(env_name)
    import ogbench

    return ogbench.make_env_and_datasets(env_name, env_only=True, **env_kwargs)


def reset_episode(env, seed, task_id):
    """Resets an evaluation env into task task_id's episode `seed`, the same in any process. OGBench's mazes draw
    their start and goal noise from numpy's global generator and their settling steps from the action space's
    own, which reset(seed=...) leaves alone: both are seeded from `seed` here, and the global generator's state
    is put back afterwards."""
    outside = np.random.get_state()
    np.random.seed(seed)
    env.action_space.seed(seed)
    try:
        return env.reset(seed=seed, options=dict(task_id=task_id, render_goal=False))
    finally:
        np.random.set_state(outside)


# ---------------------------------------------------------------------------------------------------------------
# Generation: the package's oracles, and the trained ant expert for antmaze
# ---------------------------------------------------------------------------------------------------------------

MANIP_NOISE, MANIP_NOISE_SMOOTHING = 0.1, 0.5  # PlanOracle noise of OGBench's 'play' datasets
POINTMAZE_NOISE = 0.5  # Gaussian action noise of OGBench's pointmaze stitch data
ANTMAZE_NOISE = 0.2  # Gaussian noise on the ant expert's actions (generate_locomaze.py's default)
STITCH_CELLS = 4  # stitch goals are 4 maze cells (BFS steps) from the start cell

_WORKER = {}  # per-process env, oracles and expert, built once per worker


def _worker_setup(env_name, episode_steps, expert_path):
    key = (env_name, episode_steps, expert_path, expert_path and os.path.getmtime(expert_path))  # a new expert file
    if _WORKER.get("key") == key:
        return _WORKER
    import gymnasium
    import ogbench  # noqa: F401  (registers the envs)

    spec = get_spec(env_name)
    _WORKER.clear()
    _WORKER["key"] = key
    if spec.family == "manipulation":
        from ogbench.manipspace.oracles.plan.button_plan import ButtonPlanOracle
        from ogbench.manipspace.oracles.plan.cube_plan import CubePlanOracle
        from ogbench.manipspace.oracles.plan.drawer_plan import DrawerPlanOracle
        from ogbench.manipspace.oracles.plan.window_plan import WindowPlanOracle

        env = gymnasium.make(
            spec.env_id, terminate_at_goal=False, mode="data_collection", max_episode_steps=episode_steps
        )
        kw = dict(env=env, noise=MANIP_NOISE, noise_smoothing=MANIP_NOISE_SMOOTHING)
        if env_name.startswith("cube"):
            agents = {"cube": CubePlanOracle(**kw)}
        elif env_name.startswith("scene"):
            agents = {
                "cube": CubePlanOracle(**kw),
                "button": ButtonPlanOracle(**kw),
                "drawer": DrawerPlanOracle(**kw),
                "window": WindowPlanOracle(**kw),
            }
        else:  # puzzle: buttons only, pressed with a closed gripper
            agents = {"button": ButtonPlanOracle(gripper_always_closed=True, **kw)}
        _WORKER.update(env=env, agents=agents)
    else:
        env = gymnasium.make(spec.env_id, terminate_at_goal=False, max_episode_steps=episode_steps)
        maze_map = env.unwrapped.maze_map
        free = [(i, j) for i in range(maze_map.shape[0]) for j in range(maze_map.shape[1]) if maze_map[i, j] == 0]
        _WORKER.update(env=env, maze_map=maze_map, free_cells=free, expert=None)
        if env_name.startswith("antmaze"):
            from envs.ant_expert import load_expert

            _WORKER["expert"], _ = load_expert(expert_path)
    return _WORKER


def _pool_init():
    # one torch thread per worker: the workers already use every core, and the expert is a batch-1 MLP
    torch.set_num_threads(1)


def _cells_at_distance(maze_map, start, dist):
    """Free cells exactly `dist` BFS steps from `start` (how OGBench picks stitch goals)."""
    depth = {start: 0}
    queue = [start]
    out = []
    while queue:
        i, j = queue.pop(0)
        for di, dj in [(-1, 0), (0, -1), (1, 0), (0, 1)]:
            n = (i + di, j + dj)
            if 0 <= n[0] < maze_map.shape[0] and 0 <= n[1] < maze_map.shape[1] and maze_map[n] == 0 and n not in depth:
                depth[n] = depth[(i, j)] + 1
                queue.append(n)
                if depth[n] == dist:
                    out.append(n)
    return out


def _manip_episode(w, env_name, seed):
    """One 'play' episode: the oracle does a task, then a new target is set, until the time limit.
    Returns the episode and the number of tasks the oracle finished in it."""
    env, agents = w["env"], w["agents"]
    np.random.seed(seed % 2**32)  # the PlanOracles draw their plan noise from the global numpy RNG
    reset_seed = seed
    for _attempt in range(100):
        ob, info = env.reset(seed=reset_seed)
        reset_seed = None  # retries continue the env's RNG stream
        # cube-double stacks with a per-episode probability in [0, 0.25] (OGBench); scene uses 0.5, puzzle ignores it
        p_stack = np.random.uniform(0.0, 0.25) if env_name.startswith("cube") else 0.5
        agent = agents[info["privileged/target_task"]]
        agent.reset(ob, info)
        ep = {"observations": [], "actions": [], "terminals": [], "qpos": [], "qvel": [], "button_states": []}
        tasks_done, done = 0, False
        while not done:
            action = np.clip(np.asarray(agent.select_action(ob, info)), -1, 1)
            next_ob, _, terminated, truncated, info = env.step(action)
            done = terminated or truncated
            if agent.done:  # the oracle finished its task: pick a new target and the matching oracle
                tasks_done += 1
                agent_ob, agent_info = env.unwrapped.set_new_target(p_stack=p_stack)
                agent = agents[agent_info["privileged/target_task"]]
                agent.reset(agent_ob, agent_info)
            ep["observations"].append(ob)
            ep["actions"].append(action)
            ep["terminals"].append(done)
            ep["qpos"].append(info["prev_qpos"])  # the state that produced `ob`
            ep["qvel"].append(info["prev_qvel"])
            if "prev_button_states" in info:
                ep["button_states"].append(info["prev_button_states"])
            ob = next_ob
        if env_name.startswith("scene"):
            # OGBench's health check: the cube must stay visible unless it is in the drawer, else retry the episode.
            xyz = np.asarray(ep["qpos"])[:, 14:17]
            too_right = (xyz[:, 1] >= 0.29).any()
            too_left = ((xyz[:, 1] <= -0.3) & ((xyz[:, 2] < 0.06) | (xyz[:, 2] > 0.08))).any()
            if too_right or too_left:
                continue
        if not ep["button_states"]:
            del ep["button_states"]
        return ep, {"tasks_done": tasks_done}
    raise RuntimeError(f"{env_name}: 100 unhealthy episodes in a row for seed {seed}")


def _maze_episode(w, env_name, seed):
    """One stitch episode: start in a random free cell, goal 4 cells away, follow the oracle's waypoints.
    The point moves along the waypoint direction plus N(0, 0.5) noise; the ant is the expert, steered by the same
    direction (its observation without x, y, then the direction, as in online-ant-xy-v0), plus N(0, 0.2) noise.
    Returns the episode and whether the goal was reached (at any step, and at the last one)."""
    env, maze_map, free, expert = w["env"], w["maze_map"], w["free_cells"], w["expert"]
    rng = np.random.default_rng(seed)
    np.random.seed(seed % 2**32)  # the maze env adds start noise with the global numpy RNG
    env.action_space.seed(seed)  # and takes a few random settling steps at reset
    init_ij = free[rng.integers(len(free))]
    candidates = _cells_at_distance(maze_map, init_ij, STITCH_CELLS)
    goal_ij = candidates[rng.integers(len(candidates))] if candidates else init_ij
    ob, _ = env.reset(seed=seed, options=dict(task_info=dict(init_ij=init_ij, goal_ij=goal_ij)))
    u = env.unwrapped
    ep = {"observations": [], "actions": [], "terminals": [], "qpos": [], "qvel": []}
    reached, done = False, False
    while not done:
        xy = u.get_xy()
        subgoal_xy, _ = u.get_oracle_subgoal(xy, u.cur_goal_xy)
        direction = (subgoal_xy - xy) / (np.linalg.norm(subgoal_xy - xy) + 1e-6)
        if expert is None:
            action = direction + rng.normal(0.0, POINTMAZE_NOISE, 2)
        else:
            expert_ob = np.concatenate([u.get_ob(ob_type="states")[2:], direction])
            action = expert.act(torch.as_tensor(expert_ob, dtype=torch.float32)[None])[0].numpy().astype(np.float64)
            action = action + rng.normal(0.0, ANTMAZE_NOISE, action.shape)
        action = np.clip(action, -1, 1)
        next_ob, _, terminated, truncated, info = env.step(action)
        done = terminated or truncated
        reached = reached or bool(info["success"])
        ep["observations"].append(ob)
        ep["actions"].append(action)
        ep["terminals"].append(done)
        ep["qpos"].append(info["prev_qpos"])
        ep["qvel"].append(info["prev_qvel"])
        ob = next_ob
    return ep, {"reached": reached, "at_goal_at_end": bool(info["success"])}


def _file_dtype(key):
    # OGBench's file layout: terminals bool, button_states int64, everything else float32
    return bool if key == "terminals" else np.int64 if key == "button_states" else np.float32


def _collect_episode(task):
    env_name, episode_steps, expert_path, seed = task
    w = _worker_setup(env_name, episode_steps, expert_path)
    if get_spec(env_name).family == "manipulation":
        ep, stats = _manip_episode(w, env_name, seed)
    else:
        ep, stats = _maze_episode(w, env_name, seed)
    # arrays in the file's dtypes: a tenth of the memory of lists of per-step arrays, and cheap to send back
    return {k: np.asarray(v, dtype=_file_dtype(k)) for k, v in ep.items()}, stats


def _write_npz(f, arrays):
    """np.savez_compressed's format (a zip of .npy members), with the members' timestamps fixed so that the same
    seed gives the same bytes (savez stamps the current time)."""
    with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_DEFLATED, allowZip64=True) as zf:
        for key, array in arrays.items():
            info = zipfile.ZipInfo(f"{key}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            with zf.open(info, "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _write_npz_files(paths_and_episodes):
    """Write each (path, episodes) in OGBench's file layout: every file lands, or none does."""
    tmps = []
    try:
        for path, episodes in paths_and_episodes:
            arrays = {k: np.concatenate([ep[k] for ep in episodes]).astype(_file_dtype(k)) for k in episodes[0]}
            tmp = path + ".tmp"
            tmps.append(tmp)
            with open(tmp, "wb") as f:
                _write_npz(f, arrays)
        for tmp, (path, _) in zip(tmps, paths_and_episodes):
            os.replace(tmp, path)  # atomic: a killed run never leaves a half-written dataset under the real name
    finally:
        for tmp in tmps:
            if os.path.exists(tmp):
                os.remove(tmp)


def check_expert(env_name, expert_path):
    """The ant expert must exist and fit the ant (29-dim observation with the direction, 8 actions); returns the
    number of env steps it was trained for."""
    from envs.ant_expert import load_expert

    _, info = load_expert(expert_path)
    if info["obs_dim"] != 29 or info["action_dim"] != DATASETS[env_name].action_dim:
        raise ValueError(
            f"{expert_path} maps {info['obs_dim']} observations to {info['action_dim']} actions, but the ant "
            f"expert needs 29 (27 ant + the direction) to 8: retrain with `python -m envs.ant_expert train`"
        )
    return info["env_steps"]


def waypoint_success(env_name, episodes=20, episode_steps=None, seed=12345, expert_path=None):
    """The collector's own check, without writing files: the fraction of stitch episodes (start, goal 4 cells
    away, noisy waypoint following, as generation runs them) that reach their goal at some step, and that are
    at the goal at their last step."""
    if get_spec(env_name).family != "navigation":
        raise ValueError(f"{env_name} is not a maze dataset")
    episode_steps = episode_steps or DATASETS[env_name].gen_episode_steps
    if env_name.startswith("antmaze"):
        from envs.ant_expert import DEFAULT_EXPERT_PATH

        expert_path = os.path.abspath(os.path.expanduser(expert_path or DEFAULT_EXPERT_PATH))
        check_expert(env_name, expert_path)
    else:
        expert_path = None
    seeds = [int(np.random.SeedSequence([seed, e]).generate_state(1)[0]) for e in range(episodes)]
    stats = [_collect_episode((env_name, episode_steps, expert_path, s))[1] for s in seeds]
    return {key: float(np.mean([st[key] for st in stats])) for key in stats[0]}


def generate_dataset(
    env_name,
    out_dir,
    episodes=None,
    episode_steps=None,
    seed=0,
    workers=1,
    val_fraction=0.1,
    progress=True,
    expert_path=None,
    return_stats=False,
):
    """Collect `episodes` train episodes (+ val_fraction as many for -val), by default at OGBench's size.

    Writes `<out_dir>/<env_name>.npz` and `<out_dir>/<env_name>-val.npz` in OGBench's layout. Episode e is seeded
    from (seed, e) alone, so the bytes do not depend on the number of workers. antmaze needs the trained ant
    expert (`expert_path`, default envs.ant_expert.DEFAULT_EXPERT_PATH). Returns (train_path, val_path), and a
    dict of collection statistics as well when return_stats=True: for the mazes the fraction of episodes that
    reach their goal, for manipulation the tasks the oracle finished per episode; and episodes per second.
    """
    spec = get_spec(env_name)
    episodes = spec.gen_episodes if episodes is None else episodes
    episode_steps = spec.gen_episode_steps if episode_steps is None else episode_steps
    if episodes < 1 or episode_steps < 2:
        raise ValueError(f"need episodes >= 1 and episode_steps >= 2, got {episodes} and {episode_steps}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    expert_steps = None
    if env_name.startswith("antmaze"):
        from envs.ant_expert import DEFAULT_EXPERT_PATH

        expert_path = os.path.abspath(os.path.expanduser(expert_path or DEFAULT_EXPERT_PATH))
        expert_steps = check_expert(env_name, expert_path)  # fail before any work, with the training command
    else:
        expert_path = None
    n_val = max(1, round(episodes * val_fraction))  # ogbench's loader needs a non-empty -val file
    total = episodes + n_val
    seeds = [int(np.random.SeedSequence([seed, e]).generate_state(1)[0]) for e in range(total)]
    tasks = [(env_name, episode_steps, expert_path, s) for s in seeds]

    from tqdm import tqdm

    start = time.time()
    bar = tqdm(total=total, desc=f"generate {env_name}", unit="ep", disable=not progress)
    results = []
    if workers == 1:
        for t in tasks:
            results.append(_collect_episode(t))
            bar.update(1)
    else:
        # spawn: fresh interpreters, so mujoco and torch state are never forked; imap keeps the episode order
        with multiprocessing.get_context("spawn").Pool(min(workers, total), initializer=_pool_init) as pool:
            for result in pool.imap(_collect_episode, tasks, chunksize=1):
                results.append(result)
                bar.update(1)
    bar.close()
    seconds = time.time() - start

    os.makedirs(out_dir, exist_ok=True)
    train_path = os.path.join(out_dir, f"{env_name}.npz")
    val_path = os.path.join(out_dir, f"{env_name}-val.npz")
    eps = [ep for ep, _ in results]
    _write_npz_files([(train_path, eps[:episodes]), (val_path, eps[episodes:])])
    if not return_stats:
        return train_path, val_path
    per_episode = [s for _, s in results]
    stats = {"episodes": total, "seconds": seconds, "episodes_per_second": total / seconds, "workers": workers}
    for key in per_episode[0]:
        stats[f"mean_{key}"] = float(np.mean([s[key] for s in per_episode]))
    if expert_steps is not None:
        stats["expert_env_steps"] = expert_steps
    return train_path, val_path, stats


def usable_cores():
    """The cores this process may run on (a container or taskset can allow fewer than the machine has)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check(args):
    """`check`: the maze collector's goal-reaching rate, as generation would drive it."""
    try:
        maze = waypoint_success(args.env, args.episodes, seed=args.seed, expert_path=args.expert)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.env}, waypoints with the collection's action noise: goal reached in {100 * maze['reached']:.0f}% "
          f"of {args.episodes} episodes, at the goal at the end in {100 * maze['at_goal_at_end']:.0f}%")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m envs.ogbench_data", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="make an OGBench dataset locally (oracles; the ant expert for antmaze)")
    g.add_argument("--env", required=True, help=f"dataset name, one of: {', '.join(DATASETS)}")
    g.add_argument("--out", default=os.path.expanduser(DEFAULT_DATASET_DIR), help="output directory")
    g.add_argument("--episodes", type=int, default=None, help="train episodes (default: OGBench's 1000 or 5000)")
    g.add_argument("--episode-steps", type=int, default=None, help="states per episode (default 1001, or 201)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--workers", type=int, default=usable_cores(), help="worker processes (default: every usable core)")
    g.add_argument("--val-fraction", type=float, default=0.1, help="extra val episodes as a fraction of --episodes")
    g.add_argument("--expert", default=None, help="antmaze: the trained ant expert (default "
                   "checkpoints/ant_expert/expert.pt, from `python -m envs.ant_expert train`)")
    g.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    c = sub.add_parser("check", help="how often the maze collector reaches its goal, without writing a dataset")
    c.add_argument("--env", required=True, help="pointmaze-large-stitch-v0 or antmaze-medium-stitch-v0")
    c.add_argument("--episodes", type=int, default=20)
    c.add_argument("--seed", type=int, default=12345)
    c.add_argument("--expert", default=None, help="antmaze: the ant expert (default checkpoints/ant_expert/expert.pt)")
    args = parser.parse_args(argv)
    if args.command == "check":
        return check(args)

    try:
        train_path, val_path, stats = generate_dataset(
            args.env,
            args.out,
            episodes=args.episodes,
            episode_steps=args.episode_steps,
            seed=args.seed,
            workers=args.workers,
            val_fraction=args.val_fraction,
            progress=not args.no_progress,
            expert_path=args.expert,
            return_stats=True,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {train_path} and {val_path}")
    summary = f"{stats['episodes']} episodes in {stats['seconds']:.0f} s ({stats['episodes_per_second']:.2f} ep/s, "
    summary += f"{stats['workers']} workers)"
    if "mean_reached" in stats:
        summary += f"; goal reached in {100 * stats['mean_reached']:.1f}% of episodes"
        summary += f", at the goal at the end in {100 * stats['mean_at_goal_at_end']:.1f}%"
    if "mean_tasks_done" in stats:
        summary += f"; the oracle finished {stats['mean_tasks_done']:.2f} tasks per episode"
    if "expert_env_steps" in stats:
        summary += f"; ant expert trained for {stats['expert_env_steps']:,} env steps"
    print(summary)
    print(f"train on it with: python flexloop_gciql.py --env-name {args.env} --dataset-dir {args.out}")
    print(f"or load it in Python: envs.ogbench_data.load_dataset({args.env!r}, dataset_dir={args.out!r})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
