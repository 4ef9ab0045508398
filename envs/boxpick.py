"""BoxPick as whole-batch torch tensor ops (docs/reference.md, BoxPick).

A 6x6 grid holds boxes, targets and one agent. The agent moves, picks up a box
from its own cell and puts it down again. The goal is the solved grid: a box on
every target, no other box, the agent back at its start cell and not carrying.

Every env of the batch steps at once, on CPU or CUDA, with no Python loop over
envs and no host sync in `step`. Episodes always run 100 steps (success does
not end them) and reset themselves in the same step.
"""

import gymnasium as gym
import numpy as np
import torch

GRID_SIZE = 6
NUM_CELLS = GRID_SIZE * GRID_SIZE
NUM_ACTIONS = 6
NUM_CODES = 12

# Cell codes, as in the reference JAX env.
EMPTY = 0
BOX = 1
TARGET = 2
AGENT = 3
AGENT_CARRYING_BOX = 4
AGENT_ON_BOX = 5
AGENT_ON_TARGET = 6
AGENT_ON_TARGET_CARRYING_BOX = 7
AGENT_ON_TARGET_WITH_BOX = 8
AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX = 9
BOX_ON_TARGET = 10
AGENT_ON_BOX_CARRYING_BOX = 11

CODE_NAMES = [
    "EMPTY", "BOX", "TARGET", "AGENT", "AGENT_CARRYING_BOX", "AGENT_ON_BOX", "AGENT_ON_TARGET",
    "AGENT_ON_TARGET_CARRYING_BOX", "AGENT_ON_TARGET_WITH_BOX", "AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX",
    "BOX_ON_TARGET", "AGENT_ON_BOX_CARRYING_BOX",
]

UP, DOWN, LEFT, RIGHT, PICK_UP, PUT_DOWN = range(NUM_ACTIONS)
ACTION_NAMES = ["UP", "DOWN", "LEFT", "RIGHT", "PICK_UP", "PUT_DOWN"]
MOVES = [(-1, 0), (1, 0), (0, -1), (0, 1), (0, 0), (0, 0)]  # (row, col) change per action

# Each code is a set of four flags: (box, target, agent, carrying). The 12 codes are
# exactly the legal flag sets (carrying needs an agent), so the step works on flags
# and re-encodes; no hand-written table of transitions is needed.
CODE_FLAGS = {
    EMPTY: (0, 0, 0, 0),
    BOX: (1, 0, 0, 0),
    TARGET: (0, 1, 0, 0),
    AGENT: (0, 0, 1, 0),
    AGENT_CARRYING_BOX: (0, 0, 1, 1),
    AGENT_ON_BOX: (1, 0, 1, 0),
    AGENT_ON_TARGET: (0, 1, 1, 0),
    AGENT_ON_TARGET_CARRYING_BOX: (0, 1, 1, 1),
    AGENT_ON_TARGET_WITH_BOX: (1, 1, 1, 0),
    AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX: (1, 1, 1, 1),
    BOX_ON_TARGET: (1, 1, 0, 0),
    AGENT_ON_BOX_CARRYING_BOX: (1, 0, 1, 1),
}
_FLAGS = torch.tensor([CODE_FLAGS[c] for c in range(NUM_CODES)], dtype=torch.bool)  # (12, 4)
_ENCODE = torch.full((16,), -1, dtype=torch.long)  # flag bits box|target<<1|agent<<2|carry<<3 -> code
for _code, (_b, _t, _a, _c) in CODE_FLAGS.items():
    _ENCODE[_b | _t << 1 | _a << 2 | _c << 3] = _code

# Targets are hidden from the agent (use_targets=False in the reference).
_HIDE_TARGETS = torch.tensor([EMPTY, BOX, EMPTY, AGENT, AGENT_CARRYING_BOX, AGENT_ON_BOX, AGENT,
                              AGENT_CARRYING_BOX, AGENT_ON_BOX, AGENT_ON_BOX_CARRYING_BOX, BOX,
                              AGENT_ON_BOX_CARRYING_BOX], dtype=torch.int8)
# The reward compares grids with the agent removed (a carried box disappears with it).
_REMOVE_AGENT = torch.tensor([EMPTY, BOX, TARGET, EMPTY, EMPTY, BOX, TARGET, TARGET, BOX_ON_TARGET,
                              BOX_ON_TARGET, BOX_ON_TARGET, BOX], dtype=torch.int8)

# Exact-n quadrants: 0 top-left, 1 top-right, 2 bottom-left, 3 bottom-right.
TRAIN_QUADRANT_PAIRS = [(0, 1), (1, 0), (0, 2), (2, 0), (1, 3), (3, 1), (2, 3), (3, 2)]  # adjacent
UNSEEN_QUADRANT_PAIRS = [(0, 3), (3, 0), (1, 2), (2, 1)]  # diagonal
QUADRANT_SIZE = 9  # cells in a 3x3 quadrant
QUADRANT_CELLS = [
    [(r0 + r) * GRID_SIZE + c0 + c for r in range(3) for c in range(3)]
    for r0, c0 in [(0, 0), (0, 3), (3, 0), (3, 3)]
]

# Variant name -> generator settings.
VARIANTS = {
    "Exact-3": dict(generator="exact", num_boxes=3),
    "Exact-4": dict(generator="exact", num_boxes=4),
    "Generalize-4-1": dict(generator="generalize", num_boxes=4, num_moving=1),
    "Generalize-4-2": dict(generator="generalize", num_boxes=4, num_moving=2),
    # Not a paper env: one box and one target, small enough to learn on a CPU in seconds (tests, debugging).
    "Generalize-1-1": dict(generator="generalize", num_boxes=1, num_moving=1),
}
SPLITS = ("train", "unseen")


_TABLE_COPIES = {}


def _table(table, device):
    """The lookup table on `device`, copied there once (copies inside a CUDA graph capture are not allowed)."""
    key = (id(table), torch.device(device))
    if key not in _TABLE_COPIES:
        _TABLE_COPIES[key] = table.to(device)
    return _TABLE_COPIES[key]


def hide_targets(grid):
    """What the agent sees: the grid with every target erased."""
    return _table(_HIDE_TARGETS, grid.device)[grid.long()]


def remove_agent(grid):
    """The grid without the agent (and without the box it carries)."""
    return _table(_REMOVE_AGENT, grid.device)[grid.long()]


def goal_reached(obs, goal):
    """1.0 where `obs` equals `goal` once the agent is removed from both, per row.

    Works on full grids and on the agent's target-free view alike, so replay
    relabelling recomputes rewards with the same rule the env uses.
    """
    return (remove_agent(obs) == remove_agent(goal)).all(-1).float()


def decode(grid):
    """(..., 36) codes -> four bool planes (box, target, agent, carrying)."""
    flags = _table(_FLAGS, grid.device)[grid.long()]
    return flags.unbind(-1)


def encode(box, target, agent, carrying):
    bits = box.long() | target.long() << 1 | agent.long() << 2 | carrying.long() << 3
    return _table(_ENCODE, box.device)[bits].to(torch.int8)


def render(grid, targets_visible=True):
    """A 6x6 grid of codes as text. `A`/`a` agent (carrying: upper case), `#` box,
    `o` target, `@` box on target, `.` empty; an agent on a box or target is
    written in brackets, e.g. `[a#]`."""
    grid = torch.as_tensor(grid).reshape(GRID_SIZE, GRID_SIZE).cpu()
    if not targets_visible:
        grid = hide_targets(grid)
    lines = []
    for row in grid.tolist():
        cells = []
        for code in row:
            box, target, agent, carrying = CODE_FLAGS[code]
            ground = "@" if box and target else "#" if box else "o" if target else "."
            if agent:
                cells.append(("A" if carrying else "a") + (ground if ground != "." else " "))
            else:
                cells.append(ground + " ")
        lines.append(" ".join(f"{c:2s}" for c in cells))
    return "\n".join(lines)


class BoxPickVecEnv(gym.vector.VectorEnv):
    """A batch of BoxPick envs stepped together on one device.

    Observations are dicts of int8 tensors: "observation" (N, 36) is the grid
    without targets, "desired_goal" (N, 36) the solved grid seen the same way.
    Auto-reset is SAME_STEP: a finished env comes back already reset, and
    `info["final_obs"]` holds the observation it finished on. Episode
    statistics at episode end are in `info` as tensors (no host sync):
    episode_done, episode_success, episode_boxes_on_target, episode_length.
    """

    metadata = {"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP}

    def __init__(self, num_envs, variant="Exact-4", split="train", device="cpu", seed=0,
                 episode_length=100, quarter_filter=False, check_actions=True):
        if variant not in VARIANTS:
            raise ValueError(f"unknown BoxPick variant {variant!r}; choose one of {sorted(VARIANTS)}")
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; use split='train' or split='unseen'")
        if not isinstance(num_envs, int) or num_envs <= 0:
            raise ValueError(f"num_envs must be a positive int, got {num_envs!r}")
        if episode_length <= 0:
            raise ValueError(f"episode_length must be positive, got {episode_length}")
        self.variant, self.split = variant, split
        self.settings = VARIANTS[variant]
        if quarter_filter and self.settings["generator"] != "exact":
            raise ValueError("quarter_filter only applies to the Exact-n variants (it needs box and target quadrants)")
        self.num_envs = num_envs
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", one name per device
        self.episode_length = episode_length
        self.quarter_filter = quarter_filter
        self.check_actions = check_actions

        self.single_action_space = gym.spaces.Discrete(NUM_ACTIONS)
        self.action_space = gym.spaces.MultiDiscrete(np.full(num_envs, NUM_ACTIONS))
        grid_space = gym.spaces.Box(0, NUM_CODES - 1, shape=(NUM_CELLS,), dtype=np.int8)
        self.single_observation_space = gym.spaces.Dict({"observation": grid_space, "desired_goal": grid_space})
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, num_envs)

        # Tables and per-action offsets live on the device once.
        for table in (_FLAGS, _ENCODE, _HIDE_TARGETS, _REMOVE_AGENT):
            _table(table, self.device)
        self._row_move = torch.tensor([m[0] for m in MOVES], device=self.device)
        self._col_move = torch.tensor([m[1] for m in MOVES], device=self.device)
        self._quadrant_cells = torch.tensor(QUADRANT_CELLS, device=self.device)
        # Each cell's quadrant and its slot in QUADRANT_CELLS, so that tasks are built cell by cell (no scatter).
        self._cell_quadrant = torch.tensor([q for c in range(NUM_CELLS) for q in range(4) if c in QUADRANT_CELLS[q]],
                                           device=self.device)
        self._cell_slot = torch.tensor([QUADRANT_CELLS[q].index(c) for c, q in enumerate(self._cell_quadrant.tolist())],
                                       device=self.device)
        pairs = TRAIN_QUADRANT_PAIRS if split == "train" else UNSEEN_QUADRANT_PAIRS
        self._quadrant_pairs = torch.tensor(pairs, device=self.device)
        self._env_index = torch.arange(num_envs, device=self.device)

        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(seed)
        self._allocate_state()

    # ----- state -----
    def _allocate_state(self):
        n = self.num_envs
        self.grid = torch.zeros(n, NUM_CELLS, dtype=torch.int8, device=self.device)  # full codes, targets included
        self.goal = torch.zeros_like(self.grid)  # solved grid, agent's view
        self.agent_pos = torch.zeros(n, dtype=torch.long, device=self.device)  # flat cell index
        self.steps = torch.zeros(n, dtype=torch.int32, device=self.device)
        self.allowed = torch.ones(n, NUM_CELLS, dtype=torch.bool, device=self.device)  # quarter filter region

    # ----- task generators -----
    # A random draw that names a torch.Generator breaks a torch.compile graph (dynamo cannot trace it), and each
    # break splits a step into separately compiled pieces that recompile per env instance. So n tasks take all
    # their randomness from one uniform draw, (n, noise width), made at the top of `step` and `reset`.
    def _noise_width(self):
        """Uniform numbers one task needs: Exact, the quadrant pair, 9 box and 9 target cells, the agent's cell;
        Generalize, 36 cells and the agent's cell."""
        return 2 * QUADRANT_SIZE + 2 if self.settings["generator"] == "exact" else NUM_CELLS + 1

    @torch.compiler.disable  # one clean graph break per step, never a frame of its own that recompiles
    def _task_noise(self, n):
        return torch.rand(n, self._noise_width(), generator=self.generator, device=self.device)

    @staticmethod
    def _ranks(draws):
        """Per row, how many draws are smaller than each one. `ranks < k` marks the k smallest draws: a uniformly
        random k-subset. Counted pairwise rather than with topk or a sort, so that torch.compile fuses it into
        the step's other kernels (the same cells as `draws <= k-th smallest`, ties included). Only for short
        rows (Exact's 9 quadrant slots): the work grows with the square of the row."""
        return (draws[:, None, :] < draws[:, :, None]).sum(-1)

    @staticmethod
    def _uniform_int(u, k):
        """A uniform integer in 0..k-1 from a uniform number in [0, 1)."""
        return (u * k).long().clamp_(max=k - 1)

    def sample_tasks(self, n, noise=None):
        """n fresh tasks: (box, target) planes (n, 36), agent start cell (n,), allowed region (n, 36). noise:
        the (n, noise width) uniform numbers to build them from; drawn here when not given."""
        noise = self._task_noise(n) if noise is None else noise
        if self.settings["generator"] == "exact":
            return self._sample_exact(noise)
        return self._sample_generalize(noise)

    def _sample_generalize(self, noise):
        n = noise.shape[0]
        num_boxes = self.settings["num_boxes"]
        num_moving = num_boxes if self.split == "unseen" else self.settings["num_moving"]
        # Shuffle the cells: the first num_boxes hold boxes, the first (num_boxes - num_moving) of those
        # already sit on targets, and the next num_moving cells are the free targets. topk thresholds, not
        # pairwise ranks: over 36 cells those cost 36 x 36 comparisons per env and step, and with them this env fell
        # from 205 to 114 M steps/s at 32,768 envs (H100, BENCHMARKS.md). Exact's 9-slot quadrants stay pairwise.
        draws = noise[:, :NUM_CELLS]
        smallest = torch.topk(draws, num_boxes + num_moving, dim=1, largest=False).values

        def first(k):  # the cells whose draw is among the k smallest: the first k of the shuffle
            return draws <= smallest[:, k - 1:k] if k > 0 else torch.zeros_like(draws, dtype=torch.bool)
        box = first(num_boxes)
        target = first(num_boxes - num_moving) | (first(num_boxes + num_moving) & ~box)
        agent_start = self._uniform_int(noise[:, NUM_CELLS], NUM_CELLS)
        allowed = torch.ones(n, NUM_CELLS, dtype=torch.bool, device=self.device)
        return box, target, agent_start, allowed

    def _sample_exact(self, noise):
        n = noise.shape[0]
        num_boxes = self.settings["num_boxes"]
        pair = self._quadrant_pairs[self._uniform_int(noise[:, 0], len(self._quadrant_pairs))]  # (n, 2)
        box_draws, target_draws = noise[:, 1:1 + QUADRANT_SIZE], noise[:, 1 + QUADRANT_SIZE:1 + 2 * QUADRANT_SIZE]
        # A cell holds a box if it lies in the box quadrant and its slot there has one of the num_boxes smallest
        # draws; targets likewise.
        in_box_quadrant = self._cell_quadrant == pair[:, :1]  # (n, 36)
        in_target_quadrant = self._cell_quadrant == pair[:, 1:]
        box = in_box_quadrant & (self._ranks(box_draws) < num_boxes)[:, self._cell_slot]
        target = in_target_quadrant & (self._ranks(target_draws) < num_boxes)[:, self._cell_slot]
        agent_in_quadrant = self._uniform_int(noise[:, -1], QUADRANT_SIZE)
        agent_start = self._quadrant_cells[pair[:, 0], agent_in_quadrant]
        allowed = in_box_quadrant | in_target_quadrant
        # The quarter filter keeps the agent inside the bounding box of the two quadrants.
        rows, cols = allowed.view(n, GRID_SIZE, GRID_SIZE).any(2), allowed.view(n, GRID_SIZE, GRID_SIZE).any(1)
        allowed = (rows[:, :, None] & cols[:, None, :]).view(n, NUM_CELLS)
        return box, target, agent_start, allowed

    def _build(self, box, target, agent_start, carrying):
        """Full grid and agent-view goal from flag planes."""
        agent = torch.arange(NUM_CELLS, device=box.device) == agent_start[:, None]
        carry_plane = agent & carrying[:, None]
        grid = encode(box, target, agent, carry_plane)
        # Solved grid: boxes on exactly the targets, agent at its start, not carrying.
        goal = hide_targets(encode(target, target, agent, torch.zeros_like(box)))
        return grid, goal

    # ----- gymnasium API -----
    def reset(self, *, seed=None, options=None):
        if seed is not None:
            self.generator.manual_seed(seed)
        if options is not None and "grid" in options:
            box, target, agent_start, carrying = self._parse_given_states(options)
            allowed = torch.ones(self.num_envs, NUM_CELLS, dtype=torch.bool, device=self.device)
        else:
            box, target, agent_start, allowed = self.sample_tasks(self.num_envs)
            carrying = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        grid, goal = self._build(box, target, agent_start, carrying)
        # State is written in place everywhere: it lives at fixed addresses, so a CUDA graph that captured
        # reset or step reads and writes the live state on every replay (never a freed tensor).
        self.grid.copy_(grid)
        self.goal.copy_(goal)
        self.agent_pos.copy_(agent_start)
        self.allowed.copy_(allowed)
        self.steps.zero_()
        return self._obs(), {}

    def _obs(self):
        # The goal is returned as a copy: the state changes in place at the next step.
        return {"observation": hide_targets(self.grid), "desired_goal": self.goal.clone()}

    def _parse_given_states(self, options):
        """Validate explicitly given states: grid of box/target codes, agent cell, carrying flag."""
        grid = torch.as_tensor(options["grid"], device=self.device)
        if grid.shape not in ((self.num_envs, NUM_CELLS), (self.num_envs, GRID_SIZE, GRID_SIZE)):
            raise ValueError(f"options['grid'] must have shape ({self.num_envs}, 36) or ({self.num_envs}, 6, 6), "
                             f"got {tuple(grid.shape)}")
        if grid.dtype.is_floating_point or grid.dtype == torch.bool:
            raise TypeError(f"options['grid'] must hold integer cell codes, got dtype {grid.dtype}")
        grid = grid.reshape(self.num_envs, NUM_CELLS).long()
        if ((grid < 0) | (grid >= NUM_CODES)).any():
            raise ValueError("options['grid'] holds codes outside 0..11")
        box, target, agent, carrying_plane = decode(grid)
        if "agent_pos" in options:
            # Agent given apart from the grid: the grid must then hold no agent code.
            if agent.any():
                raise ValueError("options['grid'] holds an agent code while options['agent_pos'] is given; "
                                 "pass the agent either in the grid or as agent_pos, not both")
            pos = torch.as_tensor(options["agent_pos"], device=self.device).long()
            if pos.shape == (self.num_envs, 2):
                if ((pos < 0) | (pos >= GRID_SIZE)).any():
                    raise ValueError("options['agent_pos'] rows and columns must lie in 0..5")
                pos = pos[:, 0] * GRID_SIZE + pos[:, 1]
            elif pos.shape != (self.num_envs,):
                raise ValueError(f"options['agent_pos'] must have shape ({self.num_envs},) (flat cell) or "
                                 f"({self.num_envs}, 2) (row, col), got {tuple(pos.shape)}")
            if ((pos < 0) | (pos >= NUM_CELLS)).any():
                raise ValueError("options['agent_pos'] flat cells must lie in 0..35")
            carrying = torch.as_tensor(options.get("carrying", torch.zeros(self.num_envs, dtype=torch.bool)),
                                       device=self.device).bool().reshape(-1)
            if carrying.shape != (self.num_envs,):
                raise ValueError(f"options['carrying'] must have shape ({self.num_envs},)")
        else:
            counts = agent.sum(1)
            if (counts != 1).any():
                bad = int((counts != 1).nonzero()[0])
                raise ValueError(f"options['grid'] row {bad} has {int(counts[bad])} agent cells; each grid needs "
                                 "exactly one, or give options['agent_pos'] with an agent-free grid")
            pos = agent.long().argmax(1)
            carrying = carrying_plane.any(1)
        # A reachable goal needs one box per target: boxes on the grid plus the carried one.
        num_boxes = box.sum(1) + carrying.long()
        num_targets = target.sum(1)
        if ((num_boxes != num_targets) | (num_targets == 0)).any():
            bad = int(((num_boxes != num_targets) | (num_targets == 0)).nonzero()[0])
            raise ValueError(f"options['grid'] row {bad} has {int(num_boxes[bad])} boxes (counting a carried one) "
                             f"and {int(num_targets[bad])} targets; a legal task has as many boxes as targets, at least one")
        return box, target, pos, carrying

    def step(self, actions):
        actions = self._check(actions)
        n = self.num_envs
        task_noise = self._task_noise(n)  # the step's one random draw: the auto-reset's fresh tasks
        rows, cols = self.agent_pos // GRID_SIZE, self.agent_pos % GRID_SIZE

        # Moves: off-grid moves do nothing; the agent walks over boxes and targets.
        new_rows, new_cols = rows + self._row_move[actions], cols + self._col_move[actions]
        inside = (new_rows >= 0) & (new_rows < GRID_SIZE) & (new_cols >= 0) & (new_cols < GRID_SIZE)
        new_pos = torch.where(inside, new_rows * GRID_SIZE + new_cols, self.agent_pos)

        here = self.grid[self._env_index, self.agent_pos]
        box, target, _, carrying = decode(here)
        # PICK_UP only from a box cell when not carrying; PUT_DOWN is its exact inverse.
        pick = (actions == PICK_UP) & box & ~carrying
        put = (actions == PUT_DOWN) & ~box & carrying
        box = (box & ~pick) | put
        carrying = (carrying | pick) & ~put

        # Leave the old cell (re-coded without agent), then enter the new one (carrying kept). Only these two cells
        # change; they are written with one elementwise pass over the grid (no scatter), which the compiler fuses.
        no = torch.zeros_like(box)
        stayed = new_pos == self.agent_pos
        old_cell = torch.where(stayed, encode(box, target, ~no, carrying), encode(box, target, no, no))
        dest_box, dest_target, _, _ = decode(torch.where(stayed, old_cell, self.grid[self._env_index, new_pos]))
        entered_cell = encode(dest_box, dest_target, ~no, carrying)
        cells = torch.arange(NUM_CELLS, device=self.device)
        self.grid.copy_(torch.where(cells == new_pos[:, None], entered_cell[:, None],
                                    torch.where(cells == self.agent_pos[:, None], old_cell[:, None], self.grid)))
        self.agent_pos.copy_(new_pos)
        self.steps += 1

        obs = self._obs()
        reward = goal_reached(obs["observation"], self.goal)
        terminated = torch.zeros(n, dtype=torch.bool, device=self.device)  # success never ends an episode
        truncated = self.steps >= self.episode_length
        if self.quarter_filter:
            truncated = truncated | ~self.allowed[self._env_index, self.agent_pos]

        box_plane, target_plane, _, _ = decode(self.grid)
        info = {
            "final_obs": obs,
            "episode_done": truncated,
            "episode_success": reward,  # success = reward 1 at the episode's last step
            "episode_boxes_on_target": (box_plane & target_plane).sum(1).float(),
            "episode_length": self.steps.clone(),
        }
        self._autoreset(truncated, task_noise)
        return self._obs(), reward, terminated, truncated, info

    def _autoreset(self, done, task_noise):
        """Reset finished envs in place, without a host sync: fresh tasks for all, kept where done."""
        box, target, agent_start, allowed = self.sample_tasks(self.num_envs, task_noise)
        carrying = torch.zeros(self.num_envs, dtype=torch.bool, device=self.device)
        new_grid, new_goal = self._build(box, target, agent_start, carrying)
        done_col = done[:, None]
        self.grid.copy_(torch.where(done_col, new_grid, self.grid))
        self.goal.copy_(torch.where(done_col, new_goal, self.goal))
        self.allowed.copy_(torch.where(done_col, allowed, self.allowed))
        self.agent_pos.copy_(torch.where(done, agent_start, self.agent_pos))
        self.steps.masked_fill_(done, 0)

    def _check(self, actions):
        actions = torch.as_tensor(actions)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"actions must have shape ({self.num_envs},), one per env, got {tuple(actions.shape)}")
        if actions.dtype.is_floating_point or actions.dtype.is_complex or actions.dtype == torch.bool:
            raise TypeError(f"actions must be an integer tensor (e.g. torch.long), got {actions.dtype}")
        actions = actions.to(self.device, torch.long, non_blocking=True)
        # The range check syncs with the device, so hot loops that sample valid actions turn it off.
        if self.check_actions and ((actions < 0) | (actions >= NUM_ACTIONS)).any():
            raise ValueError(f"actions must lie in 0..{NUM_ACTIONS - 1} "
                             f"({', '.join(f'{i}={a}' for i, a in enumerate(ACTION_NAMES))})")
        return actions

    def render_text(self, index=0, targets_visible=True):
        """Env `index` as text, for a human."""
        return render(self.grid[index], targets_visible)
