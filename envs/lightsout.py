"""LightsOut-4x5 as a torch-batched, goal-conditioned vector env.

Rules (docs/reference.md, LightsOut):
- The board is 4 rows x 5 columns = 20 lights (0/1). There are 20 actions, one button per light.
  Pressing button i toggles light i and its up/down/left/right neighbours (no wraparound).
- Buttons are flattened row-major: button i sits at row i // 5, column i % 5.
- The 20x20 press matrix has full rank over GF(2), so every goal is reachable from every start and the
  minimal solution is unique: press each button at most once, and its length is the number of distinct buttons.
- Observation: {"observation": the 20 lights, "desired_goal": the 20 goal lights}, both float32.
- Tasks: the start is a uniform random board; the goal is the start after pressing `dist` DISTINCT random buttons.
  split="train": dist uniform in 1..9; split="unseen": dist uniform in 10..19.
  So the minimal solution length of a task is exactly `dist`. `max_presses` lowers the split's upper bound
  (an easier task stream, e.g. for a quick learning test).
- Reward = success - 0.1 per step: 0.9 on the step that reaches the goal, -0.1 on every other step.
- The episode terminates on success and is truncated after `max_steps` (20) steps without success.
- Autoreset is SAME_STEP: a finished env is reset inside `step`; `obs` is then the new episode's first
  observation and info["final_obs"] holds the observation the episode ended on.

Everything is whole-batch tensor ops on the env's device. `step` and `reset` never sync with the host,
except to validate arguments (the action range check, which `check_actions=False` turns off, and
explicit states given to `reset`).
"""

import gymnasium
import numpy as np
import torch

ROWS, COLS = 4, 5
NUM_LIGHTS = ROWS * COLS
STEP_COST = 0.1
SUCCESS_REWARD = 1.0
SPLITS = {"train": (1, 9), "unseen": (10, 19)}  # inclusive ranges of `dist`


# ---------------------------------------------------------------------------
# GF(2) algebra of the press matrix
# ---------------------------------------------------------------------------
def _build_press_matrix() -> torch.Tensor:
    # row i = the lights toggled by button i: itself plus its in-board neighbours
    matrix = torch.zeros(NUM_LIGHTS, NUM_LIGHTS, dtype=torch.uint8)
    for r in range(ROWS):
        for c in range(COLS):
            for dr, dc in ((0, 0), (-1, 0), (1, 0), (0, -1), (0, 1)):
                rr, cc = r + dr, c + dc
                if 0 <= rr < ROWS and 0 <= cc < COLS:
                    matrix[r * COLS + c, rr * COLS + cc] = 1
    return matrix


def _gf2_reduce(matrix: torch.Tensor, num_cols: int) -> tuple[torch.Tensor, int]:
    # Gauss-Jordan elimination over GF(2) on the first `num_cols` columns; returns (reduced copy, rank).
    # A Python loop over at most 20 columns: it runs once at import, never in the env's hot path.
    m = matrix.clone().to(dtype=torch.uint8, device="cpu") % 2
    rank = 0
    for col in range(num_cols):
        pivots = (m[rank:, col] == 1).nonzero()
        if len(pivots) == 0:
            continue
        p = rank + int(pivots[0])
        m[[rank, p]] = m[[p, rank]]
        rows = m[:, col].bool()
        rows[rank] = False
        m[rows] ^= m[rank]  # clear this column in every other row (xor = addition mod 2)
        rank += 1
        if rank == m.shape[0]:
            break
    return m, rank


def gf2_rank(matrix: torch.Tensor) -> int:
    """Rank of a 0/1 matrix over GF(2)."""
    return _gf2_reduce(matrix, matrix.shape[1])[1]


def gf2_inverse(matrix: torch.Tensor) -> torch.Tensor:
    """Inverse of a square 0/1 matrix over GF(2) (uint8), by Gauss-Jordan elimination on [M | I]."""
    n = matrix.shape[0]
    augmented = torch.cat([torch.as_tensor(matrix).to(torch.uint8).cpu(), torch.eye(n, dtype=torch.uint8)], dim=1)
    reduced, rank = _gf2_reduce(augmented, n)
    if rank < n:
        raise ValueError(f"matrix is singular over GF(2) (rank {rank} < {n}); it has no inverse")
    return reduced[:, n:].contiguous()


PRESS_MATRIX = _build_press_matrix()  # (20, 20) uint8, row i = toggle pattern of button i
PRESS_INVERSE = gf2_inverse(PRESS_MATRIX)  # (20, 20) uint8, PRESS_MATRIX @ PRESS_INVERSE = I mod 2


def _gf2_matmul(rows: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    # (N,20) 0/1 @ (20,20) 0/1, mod 2. Float32 matmul is exact here (sums <= 20) and, unlike integer
    # matmul, runs on CUDA too. Returns bool.
    return (rows.float() @ matrix.float()).remainder(2) == 1


# The helpers below check their inputs' values (a host sync): they are for tests, analysis and setup.
# The env's step uses its own device tables instead and never calls them.
def _as_boards(x, name: str) -> tuple[torch.Tensor, torch.Size]:
    """Validate a board-like input: shape (..., 20) or (..., 4, 5), values in {0, 1}. Returns (bool (M,20), shape)."""
    x = torch.as_tensor(x)
    if x.dtype.is_complex:
        raise TypeError(f"{name} must be a 0/1 tensor (bool, integer or float), got dtype {x.dtype}")
    if x.ndim >= 2 and tuple(x.shape[-2:]) == (ROWS, COLS):
        flat = x.reshape(-1, NUM_LIGHTS)
    elif x.ndim >= 1 and x.shape[-1] == NUM_LIGHTS:
        flat = x.reshape(-1, NUM_LIGHTS)
    else:
        raise ValueError(
            f"{name} must have shape (..., {NUM_LIGHTS}) or (..., {ROWS}, {COLS}), got {tuple(x.shape)}; "
            f"flatten each board row-major into {NUM_LIGHTS} lights"
        )
    if x.dtype != torch.bool and not bool(((flat == 0) | (flat == 1)).all()):
        raise ValueError(f"{name} must contain only 0s and 1s (lights off/on); convert it with (x != 0)")
    return flat != 0, x.shape


def press(board, buttons_mask) -> torch.Tensor:
    """Press every button where `buttons_mask` is 1 (each once) on `board`, in batch.

    board, buttons_mask: 0/1 tensors of shape (..., 20) or (..., 4, 5); one mask per board, or one for all.
    Returns the new board with board's shape and dtype.
    """
    b, shape = _as_boards(board, "board")
    m, _ = _as_boards(buttons_mask, "buttons_mask")
    if m.shape[0] not in (1, b.shape[0]):
        raise ValueError(
            f"buttons_mask must hold one mask per board ({b.shape[0]}) or a single mask, got {m.shape[0]}"
        )
    toggles = _gf2_matmul(m.to(b.device), PRESS_MATRIX.to(b.device))
    return (b ^ toggles).reshape(shape).to(torch.as_tensor(board).dtype)


def solve(board_diff) -> torch.Tensor:
    """The unique minimal set of presses that turns start into goal, given diff = start xor goal.

    board_diff: 0/1 tensor of shape (..., 20) or (..., 4, 5). Returns a 0/1 (..., 20) press mask in the
    input's dtype. Since the press matrix P is invertible over GF(2), presses = diff @ P^-1 mod 2.
    """
    d, shape = _as_boards(board_diff, "board_diff")
    lead = shape[:-1] if shape[-1] == NUM_LIGHTS else shape[:-2]
    presses = _gf2_matmul(d, PRESS_INVERSE.to(d.device))
    return presses.reshape(*lead, NUM_LIGHTS).to(torch.as_tensor(board_diff).dtype)


def min_solution_length(start, goal) -> torch.Tensor:
    """Number of presses of the minimal solution from start to goal, (N,) int64."""
    s, _ = _as_boards(start, "start")
    g, _ = _as_boards(goal, "goal")
    if s.shape != g.shape:
        raise ValueError(f"start and goal must have the same number of boards, got {s.shape[0]} and {g.shape[0]}")
    return solve(s ^ g.to(s.device)).sum(dim=-1, dtype=torch.int64)


def render(board) -> str:
    """Text picture of one board, or several separated by blank lines: '#' = light on, '.' = off."""
    b, _ = _as_boards(board, "board")
    pictures = []
    for one in b.cpu().reshape(-1, ROWS, COLS).tolist():
        pictures.append("\n".join("".join("#" if light else "." for light in row) for row in one))
    return "\n\n".join(pictures)


# ---------------------------------------------------------------------------
# The vector env
# ---------------------------------------------------------------------------
class LightsOutVecEnv(gymnasium.vector.VectorEnv):
    """`num_envs` LightsOut-4x5 boards stepped together as tensors on `device` (see module docstring)."""

    metadata = {"autoreset_mode": gymnasium.vector.AutoresetMode.SAME_STEP}

    def __init__(
        self,
        num_envs: int,
        split: str = "train",
        device="cpu",
        seed: int = 0,
        max_steps: int = 20,
        check_actions: bool = True,
        max_presses=None,
    ):
        if split not in SPLITS:
            raise ValueError(f"split must be 'train' or 'unseen', got {split!r}")
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs <= 0:
            raise ValueError(f"num_envs must be a positive integer, got {num_envs!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, (int, np.integer)) or max_steps <= 0:
            raise ValueError(f"max_steps must be a positive integer, got {max_steps!r}")
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {str(device)!r} was asked for but CUDA is not available; pass device='cpu'")
        self.num_envs = int(num_envs)
        self.split = split
        self.device = device
        self.max_steps = int(max_steps)
        self.check_actions = check_actions
        self.dist_low, self.dist_high = SPLITS[split]
        if max_presses is not None:
            if isinstance(max_presses, bool) or not isinstance(max_presses, (int, np.integer)) \
                    or not self.dist_low <= max_presses <= self.dist_high:
                raise ValueError(f"max_presses must be an integer in the {split} split's range "
                                 f"[{self.dist_low}, {self.dist_high}] (or None), got {max_presses!r}")
            self.dist_high = int(max_presses)

        self.single_action_space = gymnasium.spaces.Discrete(NUM_LIGHTS)
        self.action_space = gymnasium.spaces.MultiDiscrete(np.full(self.num_envs, NUM_LIGHTS))
        lights = gymnasium.spaces.Box(0.0, 1.0, (NUM_LIGHTS,), np.float32)
        self.single_observation_space = gymnasium.spaces.Dict({"observation": lights, "desired_goal": lights})
        self.observation_space = gymnasium.vector.utils.batch_space(self.single_observation_space, self.num_envs)

        # constant tables on the env's device, so step never copies from the host
        self._press_bool = PRESS_MATRIX.to(device=device, dtype=torch.bool)
        self._press_float = PRESS_MATRIX.to(device=device, dtype=torch.float32)
        self._light_index = torch.arange(NUM_LIGHTS, device=device)

        # the env's own random stream on its device: same seed -> same tasks on that device
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(int(seed))

        self.board = torch.zeros(self.num_envs, NUM_LIGHTS, dtype=torch.bool, device=device)
        self.goal = torch.zeros_like(self.board)
        self.episode_length = torch.zeros(self.num_envs, dtype=torch.int32, device=device)
        self.episode_return = torch.zeros(self.num_envs, dtype=torch.float32, device=device)
        self._needs_reset = True

    def _task_draws(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # the random numbers of a fresh task for every env (step keeps only the rows that finished, so the RNG
        # use is fixed-shape): start lights, press counts, and keys whose order is a random permutation
        n, g, dev = self.num_envs, self.generator, self.device
        start = torch.randint(0, 2, (n, NUM_LIGHTS), generator=g, device=dev)
        dist = torch.randint(self.dist_low, self.dist_high + 1, (n,), generator=g, device=dev)
        return start, dist, torch.rand(n, NUM_LIGHTS, generator=g, device=dev)

    def _sample_tasks(self, draws=None) -> tuple[torch.Tensor, torch.Tensor]:
        start, dist, keys = self._task_draws() if draws is None else draws
        start, n = start.bool(), self.num_envs
        # `dist` distinct buttons: a random permutation per env, keep its first `dist` entries
        perm = keys.argsort(dim=1)
        keep = self._light_index.expand(n, NUM_LIGHTS) < dist[:, None]
        buttons = torch.zeros(n, NUM_LIGHTS, dtype=torch.bool, device=self.device).scatter_(1, perm, keep)
        goal = start ^ _gf2_matmul(buttons, self._press_float)
        return start, goal

    def _obs(self) -> dict:
        return {"observation": self.board.float(), "desired_goal": self.goal.float()}

    def reset(self, *, seed=None, options=None) -> tuple[dict, dict]:
        """Reset all envs: from the task generator, or from explicit states options={"board": ..., "goal": ...}."""
        if seed is not None:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
                raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
            super().reset(seed=int(seed))  # keeps gymnasium's np_random in step with the seed
            self.generator.manual_seed(int(seed))
        if options:
            if not isinstance(options, dict) or set(options) != {"board", "goal"}:
                raise ValueError(
                    "options must be None or {'board': states, 'goal': states} (both keys, nothing else), "
                    f"got {sorted(options) if isinstance(options, dict) else type(options).__name__}"
                )
            board = self._given_states(options["board"], "options['board']")
            goal = self._given_states(options["goal"], "options['goal']")
        else:
            board, goal = self._sample_tasks()
        # State is written in place: fixed addresses, so a CUDA graph that captured reset or step stays valid.
        self.board.copy_(board)
        self.goal.copy_(goal)
        self.episode_length.zero_()
        self.episode_return.zero_()
        self._needs_reset = False
        return self._obs(), {}

    def _given_states(self, states, name: str) -> torch.Tensor:
        if not isinstance(states, (torch.Tensor, np.ndarray)):
            raise TypeError(f"{name} must be a tensor or array of 0/1 lights, got {type(states).__name__}")
        states = torch.as_tensor(states)
        if tuple(states.shape) not in ((self.num_envs, NUM_LIGHTS), (self.num_envs, ROWS, COLS)):
            raise ValueError(
                f"{name} must have shape ({self.num_envs}, {NUM_LIGHTS}) or ({self.num_envs}, {ROWS}, {COLS}) "
                f"(one board per env), got {tuple(states.shape)}"
            )
        flat, _ = _as_boards(states, name)
        return flat.to(self.device).clone()

    def _validate_actions(self, actions) -> torch.Tensor:
        if not isinstance(actions, torch.Tensor):
            actions = torch.as_tensor(actions)
        if actions.dtype == torch.bool or actions.dtype.is_floating_point or actions.dtype.is_complex:
            raise TypeError(
                f"actions must be an integer tensor (e.g. torch.long), got dtype {actions.dtype}; "
                "for a float tensor of button ids use actions.long()"
            )
        if tuple(actions.shape) != (self.num_envs,):
            raise ValueError(
                f"actions must have shape ({self.num_envs},) (one button id per env), got {tuple(actions.shape)}"
            )
        actions = actions.to(device=self.device, dtype=torch.long)
        if self.check_actions:  # a host sync: training loops pass check_actions=False
            if bool(((actions < 0) | (actions >= NUM_LIGHTS)).any()):
                raise ValueError(
                    f"actions must be button ids in [0, {NUM_LIGHTS}), got values from "
                    f"{int(actions.min())} to {int(actions.max())}"
                )
        return actions

    def step(self, actions: torch.Tensor):
        """Press one button per env. Returns obs, reward, terminated, truncated, info (all tensors on device)."""
        if self._needs_reset:
            raise RuntimeError("call reset() before step()")
        actions = self._validate_actions(actions)
        # The next tasks' random numbers first: a draw from a named generator splits a torch.compile graph, so
        # drawn here the rest of the step compiles as one graph (the stream is the same as drawing them later).
        draws = self._task_draws()

        self.board ^= self._press_bool[actions]
        self.episode_length += 1
        success = (self.board == self.goal).all(dim=1)
        # success - step cost, written as two constants so the float32 values are exactly 0.9 and -0.1
        reward = torch.where(success, SUCCESS_REWARD - STEP_COST, -STEP_COST).to(torch.float32)
        self.episode_return += reward
        terminated = success
        truncated = (self.episode_length >= self.max_steps) & ~terminated
        done = terminated | truncated

        final_obs = self._obs()
        info = {
            "final_obs": final_obs,
            "episode_done": done,
            "episode_success": success.float(),
            "episode_length": self.episode_length.clone(),
            "episode_return": self.episode_return.clone(),
        }

        # SAME_STEP autoreset: finished rows get a fresh task, the others keep theirs
        new_board, new_goal = self._sample_tasks(draws)
        self.board.copy_(torch.where(done[:, None], new_board, self.board))
        self.goal.copy_(torch.where(done[:, None], new_goal, self.goal))
        self.episode_length.masked_fill_(done, 0)
        self.episode_return.masked_fill_(done, 0.0)
        return self._obs(), reward, terminated, truncated, info

    def render_text(self, index=0, with_goal=True):
        """Env `index` as text, for a human: its board ('#' on, '.' off), and beside it the goal board."""
        if not -self.num_envs <= index < self.num_envs:
            raise IndexError(f"index {index} is out of range for {self.num_envs} envs")
        board = render(self.board[index]).splitlines()
        if not with_goal:
            return "\n".join(board)
        goal = render(self.goal[index]).splitlines()
        return "\n".join([f"{'board':{COLS}s}  goal"] + [f"{b}  {g}" for b, g in zip(board, goal)])
