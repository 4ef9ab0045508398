"""LightsOut-4x5: toggle algebra, solver, task splits, step rules, determinism, bad input, CPU vs CUDA."""

import numpy as np
import pytest
import torch

from envs.lightsout import (
    NUM_LIGHTS,
    PRESS_INVERSE,
    PRESS_MATRIX,
    LightsOutVecEnv,
    gf2_inverse,
    gf2_rank,
    min_solution_length,
    press,
    render,
    solve,
)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def board(text):
    """Parse a 4-row picture ('#' on, '.' off) into a (20,) uint8 board."""
    rows = text.split()
    return torch.tensor([[c == "#" for c in row] for row in rows], dtype=torch.uint8).reshape(20)


def one_button(i):
    mask = torch.zeros(NUM_LIGHTS, dtype=torch.uint8)
    mask[i] = 1
    return mask


def random_distinct_sets(n, gen):
    """(n,20) uint8 masks with a random number (1..20) of distinct buttons each."""
    sizes = torch.randint(1, NUM_LIGHTS + 1, (n,), generator=gen)
    ranks = torch.rand(n, NUM_LIGHTS, generator=gen).argsort(dim=1).argsort(dim=1)
    return (ranks < sizes[:, None]).to(torch.uint8)


def goal_reaching_actions(obs):
    """Per env, one button of the minimal solution (the lowest-numbered one)."""
    presses = solve(obs["observation"].bool() ^ obs["desired_goal"].bool())
    return presses.to(torch.uint8).argmax(dim=1)


def wrong_actions(obs):
    """Per env, a button outside the minimal solution (never finishes a task of length < 20)."""
    presses = solve(obs["observation"].bool() ^ obs["desired_goal"].bool())
    return (~presses).to(torch.uint8).argmax(dim=1)


# ---------------------------------------------------------------------------
# toggle algebra
# ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "button, expected",
    [
        (0, "##... #.... ..... ....."),  # top-left corner: itself, right, below
        (19, "..... ..... ....# ...##"),  # bottom-right corner
        (2, ".###. ..#.. ..... ....."),  # top edge: left, right, below
        (10, "..... #.... ##... #...."),  # left edge, row 2: up, down, right
        (7, "..#.. .###. ..#.. ....."),  # centre (row 1, col 2): all four neighbours
        (13, "..... ...#. ..### ...#."),  # centre (row 2, col 3)
    ],
)
def test_press_toggles_expected_cells(button, expected):
    empty = torch.zeros(NUM_LIGHTS, dtype=torch.uint8)
    assert torch.equal(press(empty, one_button(button)), board(expected))
    assert torch.equal(PRESS_MATRIX[button], board(expected))
    # toggling, not setting: on a full board the same cells go off
    full = torch.ones(NUM_LIGHTS, dtype=torch.uint8)
    assert torch.equal(press(full, one_button(button)), 1 - board(expected))


def test_press_accepts_grid_shape_and_keeps_dtype():
    b = torch.zeros(3, 4, 5, dtype=torch.bool)
    out = press(b, one_button(7).expand(3, 20))
    assert out.shape == (3, 4, 5) and out.dtype == torch.bool
    assert torch.equal(out.reshape(3, 20)[0].to(torch.uint8), PRESS_MATRIX[7])


def test_press_twice_is_identity_and_presses_commute():
    gen = torch.Generator().manual_seed(0)
    boards = torch.randint(0, 2, (500, NUM_LIGHTS), generator=gen)
    a = random_distinct_sets(500, gen)
    b = random_distinct_sets(500, gen)
    assert torch.equal(press(press(boards, a), a), boards)
    assert torch.equal(press(press(boards, a), b), press(press(boards, b), a))
    # pressing buttons one at a time equals pressing the whole mask at once
    step_by_step = boards.clone()
    for i in range(NUM_LIGHTS):
        step_by_step = press(step_by_step, a * one_button(i))
    assert torch.equal(step_by_step, press(boards, a))


def test_press_matrix_full_rank_and_inverse():
    assert PRESS_MATRIX.shape == (20, 20)
    assert torch.equal(PRESS_MATRIX, PRESS_MATRIX.T)  # neighbourhood is symmetric
    assert gf2_rank(PRESS_MATRIX) == 20
    eye = torch.eye(20, dtype=torch.int64)
    assert torch.equal((PRESS_MATRIX.long() @ PRESS_INVERSE.long()) % 2, eye)
    assert torch.equal((PRESS_INVERSE.long() @ PRESS_MATRIX.long()) % 2, eye)
    # gf2 helpers on a known singular matrix (5x5 LightsOut has rank 23 of 25; a repeated row suffices here)
    singular = torch.tensor([[1, 1], [1, 1]], dtype=torch.uint8)
    assert gf2_rank(singular) == 1
    with pytest.raises(ValueError, match="singular"):
        gf2_inverse(singular)


def test_render():
    text = render(board("#.... .#... ..#.. ...##"))
    assert text == "#....\n.#...\n..#..\n...##"
    assert render(torch.zeros(2, 4, 5)).count("\n\n") == 1


def test_render_text_shows_an_envs_board_beside_its_goal():
    env = LightsOutVecEnv(3, seed=0)
    start, goal = board("#.... .#... ..#.. ...##"), board("..... ..... ..... ....#")
    env.reset(options={"board": torch.stack([goal, start, goal]), "goal": torch.stack([start, goal, start])})
    assert env.render_text(1) == "board  goal\n#....  .....\n.#...  .....\n..#..  .....\n...##  ....#"
    assert env.render_text(1, with_goal=False) == render(start)
    assert env.render_text(-1) == env.render_text(0)
    with pytest.raises(IndexError, match="out of range for 3 envs"):
        env.render_text(3)


# ---------------------------------------------------------------------------
# solver and task generator
# ---------------------------------------------------------------------------
def test_solve_recovers_distinct_press_sets():
    gen = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 2, (2000, NUM_LIGHTS), generator=gen, dtype=torch.uint8)
    sets = random_distinct_sets(2000, gen)
    goals = press(starts, sets)
    assert torch.equal(solve(starts ^ goals), sets)
    assert torch.equal(min_solution_length(starts, goals), sets.sum(1).long())
    assert torch.equal(min_solution_length(starts, starts), torch.zeros(2000, dtype=torch.long))
    # shape (4,5) and single-board inputs
    assert solve((starts ^ goals)[:3].reshape(3, 4, 5)).shape == (3, 20)
    assert torch.equal(solve(starts[0] ^ goals[0]), sets[0])


@pytest.mark.parametrize("split, low, high", [("train", 1, 9), ("unseen", 10, 19)])
def test_generated_task_lengths_cover_split(split, low, high):
    env = LightsOutVecEnv(4096, split=split, seed=0)
    obs, _ = env.reset()
    lengths = min_solution_length(obs["observation"], obs["desired_goal"])
    assert lengths.min() >= low and lengths.max() <= high
    assert set(lengths.tolist()) == set(range(low, high + 1))  # every distance occurs
    # roughly uniform: each of the 9 or 10 values gets a fair share of 4096 draws
    counts = torch.bincount(lengths - low)
    assert counts.min() > 4096 / (high - low + 1) / 2
    # starts are uniform random boards: about half the lights on
    assert 0.45 < obs["observation"].mean() < 0.55


# ---------------------------------------------------------------------------
# step rules
# ---------------------------------------------------------------------------
def test_observation_format():
    env = LightsOutVecEnv(8)
    obs, info = env.reset()
    assert set(obs) == {"observation", "desired_goal"}
    for v in obs.values():
        assert v.shape == (8, 20) and v.dtype == torch.float32
    assert env.single_action_space.n == 20
    assert env.action_space.shape == (8,)
    assert env.single_observation_space["observation"].shape == (20,)
    assert env.observation_space["desired_goal"].shape == (8, 20)
    assert info == {}


def test_reward_and_termination_on_reaching_goal():
    # env 0: the goal is one press (button 7) away; env 1: two presses (0 and 19)
    start = torch.zeros(2, 20, dtype=torch.uint8)
    goal = torch.stack([PRESS_MATRIX[7], PRESS_MATRIX[0] ^ PRESS_MATRIX[19]])
    env = LightsOutVecEnv(2, seed=0)
    obs, _ = env.reset(options={"board": start.reshape(2, 4, 5), "goal": goal})
    assert torch.equal(obs["observation"], start.float())

    obs, reward, terminated, truncated, info = env.step(torch.tensor([7, 0]))
    assert torch.equal(reward, torch.tensor([0.9, -0.1]))
    assert reward.dtype == torch.float32
    assert terminated.tolist() == [True, False] and truncated.tolist() == [False, False]
    # env 0 finished: final_obs holds its solved board, obs a fresh task; env 1 goes on
    assert torch.equal(info["final_obs"]["observation"][0], PRESS_MATRIX[7].float())
    assert torch.equal(info["final_obs"]["desired_goal"][0], PRESS_MATRIX[7].float())
    assert torch.equal(info["final_obs"]["observation"][1], obs["observation"][1])
    assert torch.equal(info["final_obs"]["desired_goal"][1], obs["desired_goal"][1])
    assert torch.equal(obs["observation"][1], PRESS_MATRIX[0].float())
    new_len = min_solution_length(obs["observation"][:1], obs["desired_goal"][:1])
    assert 1 <= int(new_len) <= 9
    assert info["episode_done"].tolist() == [True, False]
    assert info["episode_success"][0] == 1.0
    assert info["episode_length"][0] == 1
    assert info["episode_return"][0] == pytest.approx(0.9)

    obs, reward, terminated, truncated, info = env.step(torch.tensor([wrong_actions(obs)[0].item(), 19]))
    assert reward[1] == pytest.approx(0.9) and terminated[1] and not truncated[1]
    assert info["episode_done"][1] and info["episode_success"][1] == 1.0
    assert info["episode_length"][1] == 2
    assert info["episode_return"][1] == pytest.approx(-0.1 + 0.9)
    assert reward[0] == pytest.approx(-0.1)  # the fresh task of env 0 took a wrong press


def test_truncation_after_exactly_max_steps():
    env = LightsOutVecEnv(16, split="train", seed=3)
    obs, _ = env.reset()
    first_tasks = {k: v.clone() for k, v in obs.items()}
    for t in range(1, 21):
        obs, reward, terminated, truncated, info = env.step(wrong_actions(obs))
        assert not terminated.any()
        assert torch.allclose(reward, torch.full((16,), -0.1))
        if t < 20:
            assert not truncated.any() and not info["episode_done"].any()
        else:
            assert truncated.all() and info["episode_done"].all()
    assert torch.equal(info["episode_length"], torch.full((16,), 20, dtype=info["episode_length"].dtype))
    assert torch.allclose(info["episode_return"], torch.full((16,), -2.0))
    assert torch.equal(info["episode_success"], torch.zeros(16))
    # the final obs is the old task's goal, the new obs is a fresh task
    assert torch.equal(info["final_obs"]["desired_goal"], first_tasks["desired_goal"])
    assert not torch.equal(obs["desired_goal"], first_tasks["desired_goal"])
    lengths = min_solution_length(obs["observation"], obs["desired_goal"])
    assert lengths.min() >= 1 and lengths.max() <= 9
    # counters restarted: the next truncation comes 20 steps later again
    for t in range(19):
        obs, _, _, truncated, _ = env.step(wrong_actions(obs))
        assert not truncated.any()


def test_optimal_policy_solves_every_task_in_min_length():
    env = LightsOutVecEnv(256, split="unseen", seed=5, check_actions=False)
    obs, _ = env.reset()
    lengths = min_solution_length(obs["observation"], obs["desired_goal"])
    done_at = torch.zeros(256, dtype=torch.long)
    success = torch.zeros(256)
    returns = torch.zeros(256)
    for t in range(1, 20):
        obs, reward, terminated, truncated, info = env.step(goal_reaching_actions(obs).int())
        first = info["episode_done"] & (done_at == 0)
        done_at[first] = t
        success[first] = info["episode_success"][first]
        returns[first] = info["episode_return"][first]
        assert not truncated.any()
    assert torch.equal(done_at, lengths)
    assert torch.equal(success, torch.ones(256))
    assert torch.allclose(returns, 1.0 - 0.1 * lengths.float(), atol=1e-5)


def test_max_steps_argument():
    env = LightsOutVecEnv(4, max_steps=3)
    obs, _ = env.reset()
    for _ in range(3):
        obs, _, terminated, truncated, info = env.step(wrong_actions(obs))
    assert truncated.all() and torch.equal(info["episode_length"], torch.full((4,), 3, dtype=torch.int32))


# ---------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------
def rollout(env, seed, steps=30):
    obs, _ = env.reset(seed=seed)
    trace = [obs["observation"], obs["desired_goal"]]
    for t in range(steps):
        actions = torch.arange(env.num_envs) * 7 % 20 if t % 3 else goal_reaching_actions(obs)
        obs, reward, *_ = env.step(actions)
        trace += [obs["observation"], obs["desired_goal"], reward]
    return trace


def test_same_seed_same_task_stream():
    a = rollout(LightsOutVecEnv(32, seed=11), seed=None)
    b = rollout(LightsOutVecEnv(32, seed=11), seed=None)
    c = rollout(LightsOutVecEnv(32, seed=0), seed=11)  # reset(seed=) reseeds like the constructor
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(torch.equal(x, y) for x, y in zip(a, c))
    d = rollout(LightsOutVecEnv(32, seed=12), seed=None)
    assert not torch.equal(a[1], d[1])
    assert not all(torch.equal(x, y) for x, y in zip(a, d))


def test_reset_without_seed_continues_stream():
    env = LightsOutVecEnv(32, seed=0)
    first, _ = env.reset()
    second, _ = env.reset()
    assert not torch.equal(first["desired_goal"], second["desired_goal"])


# ---------------------------------------------------------------------------
# bad input
# ---------------------------------------------------------------------------
def test_bad_constructor_args():
    with pytest.raises(ValueError, match="split must be 'train' or 'unseen'"):
        LightsOutVecEnv(4, split="test")
    with pytest.raises(ValueError, match="num_envs must be a positive integer"):
        LightsOutVecEnv(0)
    with pytest.raises(ValueError, match="num_envs must be a positive integer"):
        LightsOutVecEnv(-3)
    with pytest.raises(ValueError, match="max_steps must be a positive integer"):
        LightsOutVecEnv(4, max_steps=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available; pass device='cpu'"):
            LightsOutVecEnv(4, device="cuda")


def test_bad_actions():
    env = LightsOutVecEnv(4)
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        env.step(torch.zeros(4, dtype=torch.long))
    env.reset()
    with pytest.raises(ValueError, match=r"actions must have shape \(4,\)"):
        env.step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"actions must have shape \(4,\)"):
        env.step(torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(TypeError, match="actions must be an integer tensor.*actions.long()"):
        env.step(torch.zeros(4))
    with pytest.raises(TypeError, match="actions must be an integer tensor"):
        env.step(torch.zeros(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"actions must be button ids in \[0, 20\), got values from 0 to 20"):
        env.step(torch.tensor([0, 1, 2, 20]))
    with pytest.raises(ValueError, match=r"in \[0, 20\), got values from -1"):
        env.step(torch.tensor([-1, 1, 2, 3]))
    # other integer dtypes and numpy arrays are fine
    env.step(torch.tensor([0, 1, 2, 3], dtype=torch.int32))
    env.step(torch.tensor([0, 1, 2, 3], dtype=torch.uint8))
    env.step(np.array([0, 1, 2, 3]))
    # with check_actions=False the range check (a host sync) is skipped, type and shape checks stay
    fast = LightsOutVecEnv(4, check_actions=False)
    fast.reset()
    with pytest.raises(TypeError, match="integer"):
        fast.step(torch.zeros(4))


def test_bad_given_states():
    env = LightsOutVecEnv(2)
    ok = torch.zeros(2, 20)
    with pytest.raises(ValueError, match=r"options\['board'\] must have shape \(2, 20\) or \(2, 4, 5\)"):
        env.reset(options={"board": torch.zeros(3, 20), "goal": ok})
    with pytest.raises(ValueError, match=r"options\['goal'\] must have shape"):
        env.reset(options={"board": ok, "goal": torch.zeros(2, 5, 4)})
    with pytest.raises(ValueError, match=r"options\['board'\] must contain only 0s and 1s"):
        env.reset(options={"board": torch.full((2, 20), 2.0), "goal": ok})
    with pytest.raises(ValueError, match="options must be None or {'board': states, 'goal': states}"):
        env.reset(options={"board": ok})
    with pytest.raises(ValueError, match="options must be None or"):
        env.reset(options={"board": ok, "goal": ok, "dist": 3})
    with pytest.raises(TypeError, match="must be a tensor or array"):
        env.reset(options={"board": [[0] * 20] * 2, "goal": ok})
    with pytest.raises(TypeError, match="seed must be an int"):
        env.reset(seed=1.5)
    # numpy and bool states are accepted
    obs, _ = env.reset(options={"board": np.ones((2, 4, 5)), "goal": ok.bool()})
    assert torch.equal(obs["observation"], torch.ones(2, 20))


def test_bad_helper_input():
    with pytest.raises(ValueError, match=r"board must have shape \(\.\.\., 20\) or \(\.\.\., 4, 5\)"):
        press(torch.zeros(3, 19), torch.zeros(3, 20))
    with pytest.raises(ValueError, match="board_diff must contain only 0s and 1s"):
        solve(torch.full((20,), 3))
    with pytest.raises(ValueError, match="one mask per board"):
        press(torch.zeros(3, 20), torch.zeros(2, 20))


# ---------------------------------------------------------------------------
# CPU vs CUDA
# ---------------------------------------------------------------------------
@cuda
def test_cpu_and_cuda_agree():
    gen = torch.Generator().manual_seed(2)
    n = 512
    starts = torch.randint(0, 2, (n, 20), generator=gen)
    sets = random_distinct_sets(n, gen)
    goals = press(starts, sets)
    assert torch.equal(press(starts.cuda(), sets.cuda()).cpu(), goals)
    assert torch.equal(solve((starts ^ goals).cuda()).cpu(), sets)

    envs = {d: LightsOutVecEnv(n, device=d, seed=0) for d in ("cpu", "cuda")}
    for env in envs.values():
        env.reset(options={"board": starts, "goal": goals})
    alive = torch.ones(n, dtype=torch.bool)  # rows still in their given episode (new tasks differ by device RNG)
    for t in range(25):
        actions = torch.randint(0, 20, (n,), generator=gen)
        out = {d: e.step(actions.to(d) if d == "cpu" else actions) for d, e in envs.items()}
        (o_cpu, r_cpu, te_cpu, tr_cpu, i_cpu), (o_gpu, r_gpu, te_gpu, tr_gpu, i_gpu) = out["cpu"], out["cuda"]
        assert o_gpu["observation"].device.type == "cuda" and r_gpu.device.type == "cuda"
        a = alive
        assert torch.equal(r_cpu[a], r_gpu.cpu()[a])
        assert torch.equal(te_cpu[a], te_gpu.cpu()[a]) and torch.equal(tr_cpu[a], tr_gpu.cpu()[a])
        for k in ("observation", "desired_goal"):
            assert torch.equal(i_cpu["final_obs"][k][a], i_gpu["final_obs"][k].cpu()[a])
        for k in ("episode_done", "episode_success", "episode_length", "episode_return"):
            assert torch.equal(i_cpu[k][a], i_gpu[k].cpu()[a])
        alive = alive & ~i_cpu["episode_done"]
        for k in ("observation", "desired_goal"):
            assert torch.equal(o_cpu[k][alive], o_gpu[k].cpu()[alive])


@cuda
def test_cuda_task_stream_reproducible_and_in_split():
    def stream(seed):
        env = LightsOutVecEnv(2048, split="unseen", device="cuda", seed=seed)
        obs, _ = env.reset()
        return obs
    a, b = stream(4), stream(4)
    assert torch.equal(a["desired_goal"], b["desired_goal"])
    lengths = min_solution_length(a["observation"], a["desired_goal"])
    assert lengths.device.type == "cuda"
    assert set(lengths.cpu().tolist()) == set(range(10, 20))


def test_state_is_updated_in_place():
    """CUDA graphs replay on fixed addresses: reset and step must write the state in place."""
    env = LightsOutVecEnv(32, seed=0)
    names = ("board", "goal", "episode_length", "episode_return")
    env.reset()
    addresses = {name: getattr(env, name).data_ptr() for name in names}
    generator = torch.Generator().manual_seed(0)
    for _ in range(45):  # crosses several auto-resets
        env.step(torch.randint(0, 20, (32,), generator=generator))
    env.reset()
    assert {name: getattr(env, name).data_ptr() for name in names} == addresses
