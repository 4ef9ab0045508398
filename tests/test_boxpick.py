"""BoxPick rules (docs/reference.md, BoxPick): transitions, reward, generators, determinism, bad input."""

import gymnasium as gym
import pytest
import torch

import envs
from envs import boxpick as bp
from envs.boxpick import (AGENT, AGENT_CARRYING_BOX, AGENT_ON_BOX, AGENT_ON_BOX_CARRYING_BOX, AGENT_ON_TARGET,
                          AGENT_ON_TARGET_CARRYING_BOX, AGENT_ON_TARGET_WITH_BOX,
                          AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, BOX, BOX_ON_TARGET, DOWN, LEFT, PICK_UP,
                          PUT_DOWN, RIGHT, TARGET, UP, BoxPickVecEnv)


def make_grid(cells):
    """A 36-cell grid from {(row, col): code}."""
    grid = torch.zeros(36, dtype=torch.int8)
    for (r, c), code in cells.items():
        grid[r * 6 + c] = code
    return grid


def env_from(cells_list, **kwargs):
    env = BoxPickVecEnv(len(cells_list), **kwargs)
    env.reset(options={"grid": torch.stack([make_grid(c) for c in cells_list])})
    return env


# Each case: start cells, action, expected cells after the step. Every start has one box per
# target so it is a legal task; the other box/target pair sits far away at (5, 5)/(5, 4).
FAR = {(5, 5): BOX, (5, 4): TARGET}
TRANSITIONS = [
    # plain moves over empty cells, and every wall
    ("move up", {(2, 2): AGENT}, UP, {(1, 2): AGENT}),
    ("move down", {(2, 2): AGENT}, DOWN, {(3, 2): AGENT}),
    ("move left", {(2, 2): AGENT}, LEFT, {(2, 1): AGENT}),
    ("move right", {(2, 2): AGENT}, RIGHT, {(2, 3): AGENT}),
    ("wall up", {(0, 2): AGENT}, UP, {(0, 2): AGENT}),
    ("wall down", {(4, 0): TARGET, (5, 0): AGENT_ON_BOX}, DOWN, {(4, 0): TARGET, (5, 0): AGENT_ON_BOX}),
    ("wall left", {(3, 0): AGENT_CARRYING_BOX, (3, 1): TARGET}, LEFT, {(3, 0): AGENT_CARRYING_BOX, (3, 1): TARGET}),
    ("wall right", {(3, 5): AGENT}, RIGHT, {(3, 5): AGENT}),
    # moving onto and off boxes and targets, not carrying
    ("onto box", {(2, 2): AGENT, (2, 3): BOX, (0, 0): TARGET}, RIGHT,
     {(2, 3): AGENT_ON_BOX, (0, 0): TARGET}),
    ("off box", {(2, 3): AGENT_ON_BOX, (0, 0): TARGET}, LEFT, {(2, 2): AGENT, (2, 3): BOX, (0, 0): TARGET}),
    ("onto target", {(2, 2): AGENT}, UP, {(1, 2): AGENT}),
    ("onto target cell", {(2, 2): AGENT, (1, 2): TARGET, (0, 0): BOX}, UP,
     {(1, 2): AGENT_ON_TARGET, (0, 0): BOX}),
    ("off target", {(1, 2): AGENT_ON_TARGET, (0, 0): BOX}, DOWN, {(1, 2): TARGET, (2, 2): AGENT, (0, 0): BOX}),
    ("onto box on target", {(2, 2): AGENT, (2, 1): BOX_ON_TARGET}, LEFT, {(2, 1): AGENT_ON_TARGET_WITH_BOX}),
    ("off box on target", {(2, 1): AGENT_ON_TARGET_WITH_BOX}, RIGHT, {(2, 1): BOX_ON_TARGET, (2, 2): AGENT}),
    # moving while carrying
    ("carry onto empty", {(2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}, DOWN,
     {(3, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}),
    ("carry onto box", {(2, 2): AGENT_CARRYING_BOX, (3, 2): BOX, (0, 0): TARGET, (0, 1): TARGET}, DOWN,
     {(3, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}),
    ("carry off box", {(3, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}, UP,
     {(2, 2): AGENT_CARRYING_BOX, (3, 2): BOX, (0, 0): TARGET, (0, 1): TARGET}),
    ("carry onto target", {(2, 2): AGENT_CARRYING_BOX, (2, 3): TARGET}, RIGHT, {(2, 3): AGENT_ON_TARGET_CARRYING_BOX}),
    ("carry off target", {(2, 3): AGENT_ON_TARGET_CARRYING_BOX}, RIGHT,
     {(2, 3): TARGET, (2, 4): AGENT_CARRYING_BOX}),
    ("carry onto box on target", {(2, 2): AGENT_CARRYING_BOX, (1, 2): BOX_ON_TARGET, (0, 0): TARGET}, UP,
     {(1, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET}),
    ("carry off box on target", {(1, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET}, DOWN,
     {(1, 2): BOX_ON_TARGET, (2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}),
    # PICK_UP: works from a box cell only, never while carrying
    ("pick up box", {(2, 2): AGENT_ON_BOX, (0, 0): TARGET}, PICK_UP, {(2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}),
    ("pick up box on target", {(2, 2): AGENT_ON_TARGET_WITH_BOX}, PICK_UP, {(2, 2): AGENT_ON_TARGET_CARRYING_BOX}),
    ("pick up nothing", {(2, 2): AGENT}, PICK_UP, {(2, 2): AGENT}),
    ("pick up from target", {(2, 2): AGENT_ON_TARGET, (0, 0): BOX}, PICK_UP, {(2, 2): AGENT_ON_TARGET, (0, 0): BOX}),
    ("pick up while carrying", {(2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}, PICK_UP,
     {(2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}),
    ("pick up on box while carrying", {(2, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}, PICK_UP,
     {(2, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}),
    ("pick up on target box while carrying", {(2, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET},
     PICK_UP, {(2, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET}),
    ("put down on target box", {(2, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET},
     PUT_DOWN, {(2, 2): AGENT_ON_TARGET_WITH_BOX_CARRYING_BOX, (0, 0): TARGET}),
    # PUT_DOWN: exact inverse of the two pick-ups, nothing else
    ("put down", {(2, 2): AGENT_CARRYING_BOX, (0, 0): TARGET}, PUT_DOWN, {(2, 2): AGENT_ON_BOX, (0, 0): TARGET}),
    ("put down on target", {(2, 2): AGENT_ON_TARGET_CARRYING_BOX}, PUT_DOWN, {(2, 2): AGENT_ON_TARGET_WITH_BOX}),
    ("put down not carrying", {(2, 2): AGENT_ON_BOX, (0, 0): TARGET}, PUT_DOWN, {(2, 2): AGENT_ON_BOX, (0, 0): TARGET}),
    ("put down onto a box", {(2, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}, PUT_DOWN,
     {(2, 2): AGENT_ON_BOX_CARRYING_BOX, (0, 0): TARGET, (0, 1): TARGET}),
    ("put down empty-handed", {(2, 2): AGENT}, PUT_DOWN, {(2, 2): AGENT}),
]


@pytest.mark.parametrize("name,start,action,expected", TRANSITIONS, ids=[t[0] for t in TRANSITIONS])
def test_transition(name, start, action, expected):
    start, expected = {**FAR, **start}, {**FAR, **expected}
    env = env_from([start])
    obs, reward, terminated, truncated, info = env.step(torch.tensor([action]))
    assert env.grid[0].tolist() == make_grid(expected).tolist(), bp.render(env.grid[0])
    assert reward.item() == 0.0  # the far box is never on its target here
    assert not terminated.item() and not truncated.item()
    assert obs["observation"][0].tolist() == bp.hide_targets(make_grid(expected)).tolist()


def test_every_code_hides_targets_and_removes_agent_consistently():
    for code in range(12):
        box, target, agent, carrying = bp.CODE_FLAGS[code]
        hidden = bp.CODE_FLAGS[int(bp.hide_targets(torch.tensor([code]))[0])]
        assert hidden == (box, 0, agent, carrying)
        removed = bp.CODE_FLAGS[int(bp.remove_agent(torch.tensor([code]))[0])]
        assert removed == (box, target, 0, 0)


def test_reward_and_success_when_last_box_is_put_on_its_target():
    # One box carried onto its target: PUT_DOWN solves the task unless the agent is away from start.
    env = env_from([{(2, 2): AGENT_ON_TARGET_CARRYING_BOX}])
    _, reward, _, _, _ = env.step(torch.tensor([PUT_DOWN]))
    assert reward.item() == 1.0
    # Picking it up again loses the reward: the carried box is not on the target.
    _, reward, _, _, _ = env.step(torch.tensor([PICK_UP]))
    assert reward.item() == 0.0
    _, reward, _, _, _ = env.step(torch.tensor([PUT_DOWN]))
    _, reward, _, _, _ = env.step(torch.tensor([UP]))  # the agent position is ignored by the reward
    assert reward.item() == 1.0


def test_goal_is_the_solved_grid_in_the_agents_view():
    env = env_from([{(1, 1): AGENT_ON_BOX, (4, 4): TARGET, (0, 3): BOX_ON_TARGET}])
    expected = bp.hide_targets(make_grid({(1, 1): AGENT, (4, 4): BOX_ON_TARGET, (0, 3): BOX_ON_TARGET}))
    assert env.goal[0].tolist() == expected.tolist()
    assert env._obs()["observation"][0].tolist() == make_grid({(1, 1): AGENT_ON_BOX, (0, 3): BOX}).tolist()


def test_episode_runs_100_steps_whatever_success_and_reports_stats():
    env = env_from([{(2, 2): AGENT_ON_TARGET_WITH_BOX}, {(2, 2): AGENT_ON_BOX, (0, 0): TARGET}])
    actions = torch.tensor([PUT_DOWN, PUT_DOWN])  # does nothing; env 0 stays solved
    for t in range(1, 101):
        obs, reward, terminated, truncated, info = env.step(actions)
        assert reward.tolist() == [1.0, 0.0]
        assert not terminated.any()
        assert truncated.tolist() == [t == 100] * 2
    assert info["episode_done"].tolist() == [True, True]
    assert info["episode_success"].tolist() == [1.0, 0.0]
    assert info["episode_boxes_on_target"].tolist() == [1.0, 0.0]
    assert info["episode_length"].tolist() == [100, 100]
    # Auto-reset: a fresh Exact-4 task; final_obs keeps the finished one.
    assert info["final_obs"]["observation"][0].tolist() == bp.hide_targets(
        make_grid({(2, 2): AGENT_ON_TARGET_WITH_BOX})).tolist()
    box, target, agent, _ = bp.decode(env.grid)
    assert box.sum(1).tolist() == [4, 4] and target.sum(1).tolist() == [4, 4] and agent.sum(1).tolist() == [1, 1]
    assert env.steps.tolist() == [0, 0]


def sample(variant, split, n=4000, seed=0):
    env = BoxPickVecEnv(n, variant=variant, split=split, seed=seed)
    box, target, agent_start, allowed = env.sample_tasks(n)
    return env, box, target, agent_start, allowed


def quadrant_of(cells):
    rows, cols = cells // 6, cells % 6
    return (rows >= 3).long() * 2 + (cols >= 3).long()


@pytest.mark.parametrize("variant,n_boxes", [("Exact-3", 3), ("Exact-4", 4)])
@pytest.mark.parametrize("split", ["train", "unseen"])
def test_exact_generator_invariants(variant, n_boxes, split):
    env, box, target, agent_start, allowed = sample(variant, split)
    assert (box.sum(1) == n_boxes).all() and (target.sum(1) == n_boxes).all()
    assert not (box & target).any()
    box_quadrants = quadrant_of(box.nonzero()[:, 1]).view(-1, n_boxes)
    target_quadrants = quadrant_of(target.nonzero()[:, 1]).view(-1, n_boxes)
    assert (box_quadrants == box_quadrants[:, :1]).all() and (target_quadrants == target_quadrants[:, :1]).all()
    pairs = set(zip(box_quadrants[:, 0].tolist(), target_quadrants[:, 0].tolist()))
    expected = bp.TRAIN_QUADRANT_PAIRS if split == "train" else bp.UNSEEN_QUADRANT_PAIRS
    assert pairs == set(expected)  # all pairs appear, and no others
    assert (quadrant_of(agent_start) == box_quadrants[:, 0]).all()
    # The agent starts on every cell of its quadrant, boxes included.
    assert len(set(agent_start.tolist())) == 36
    # Quarter region: bounding box of the two quadrants (3x6 for adjacent, the whole grid for diagonal).
    assert (allowed.sum(1) == (18 if split == "train" else 36)).all()


@pytest.mark.parametrize("variant,moving", [("Generalize-4-1", 1), ("Generalize-4-2", 2)])
@pytest.mark.parametrize("split", ["train", "unseen"])
def test_generalize_generator_invariants(variant, moving, split):
    env, box, target, agent_start, allowed = sample(variant, split)
    moving = 4 if split == "unseen" else moving
    assert (box.sum(1) == 4).all() and (target.sum(1) == 4).all()
    assert ((box & target).sum(1) == 4 - moving).all()  # boxes already on targets
    assert len(set(agent_start.tolist())) == 36  # uniform start, possibly on a box or target
    counts = torch.bincount(agent_start, minlength=36).float()
    assert counts.min() > 0.5 * counts.mean()
    assert allowed.all()


def oracle_actions(observation, goal):
    """A scripted plan from what the agent sees (targets hidden): walk to each box that is not in the goal,
    pick it up, carry it to the nearest goal box cell that is still empty, put it down."""
    box_codes = (BOX, AGENT_ON_BOX, AGENT_ON_BOX_CARRYING_BOX)
    boxes = {c for c in range(36) if observation[c] in box_codes}
    goal_boxes = {c for c in range(36) if goal[c] in box_codes}
    position = next(c for c in range(36) if observation[c] in (AGENT, AGENT_CARRYING_BOX, AGENT_ON_BOX,
                                                               AGENT_ON_BOX_CARRYING_BOX))
    sources, destinations, plan = sorted(boxes - goal_boxes), sorted(goal_boxes - boxes), []

    def walk(start, end):
        (r0, c0), (r1, c1) = divmod(start, 6), divmod(end, 6)
        return [DOWN if r1 > r0 else UP] * abs(r1 - r0) + [RIGHT if c1 > c0 else LEFT] * abs(c1 - c0)

    def distance(a, b):
        return abs(a // 6 - b // 6) + abs(a % 6 - b % 6)

    while sources:
        source = min(sources, key=lambda c: distance(position, c))
        destination = min(destinations, key=lambda c: distance(source, c))
        plan += walk(position, source) + [PICK_UP] + walk(source, destination) + [PUT_DOWN]
        sources.remove(source), destinations.remove(destination)
        position = destination
    return plan


@pytest.mark.parametrize("variant", ["Exact-3", "Exact-4", "Generalize-4-1", "Generalize-4-2"])
@pytest.mark.parametrize("split", ["train", "unseen"])
def test_every_generated_task_is_solved_by_a_scripted_plan(variant, split):
    """The tasks are solvable from the agent's view and success fires at the last step: a plan that fits in
    the episode always succeeds, and it fits for nearly every task."""
    env = BoxPickVecEnv(64, variant=variant, split=split, seed=1)
    obs, _ = env.reset()
    plans = [oracle_actions(o.tolist(), g.tolist()) for o, g in zip(obs["observation"], obs["desired_goal"])]
    for t in range(100):  # after its plan, an env repeats PUT_DOWN, which does nothing when not carrying
        actions = torch.tensor([plan[t] if t < len(plan) else PUT_DOWN for plan in plans])
        _, _, _, _, info = env.step(actions)
    fits = torch.tensor([len(plan) <= 100 for plan in plans])
    assert fits.float().mean() > 0.9
    assert info["episode_success"][fits].eq(1).all()
    assert info["episode_boxes_on_target"][fits].eq(4 if variant != "Exact-3" else 3).all()


def test_reset_from_generator_builds_consistent_grids():
    env = BoxPickVecEnv(512, variant="Generalize-4-1", seed=3)
    obs, _ = env.reset()
    box, target, agent, carrying = bp.decode(env.grid)
    assert (agent.sum(1) == 1).all() and not carrying.any()
    assert (agent.long().argmax(1) == env.agent_pos).all()
    assert (box.sum(1) == 4).all() and (target.sum(1) == 4).all()
    assert obs["observation"].dtype == torch.int8


def test_quarter_filter_truncates_when_agent_leaves_the_region():
    env = BoxPickVecEnv(1, variant="Exact-3", quarter_filter=True)
    env.reset(seed=0)
    env.allowed[0] = False
    env.allowed[0, env.agent_pos[0]] = True
    _, _, _, truncated, info = env.step(torch.tensor([PICK_UP]))  # staying inside: no truncation
    assert not truncated.item()
    row = int(env.agent_pos[0]) // 6
    _, _, _, truncated, info = env.step(torch.tensor([DOWN if row < 5 else UP]))
    assert truncated.item() and info["episode_length"].item() == 2


def test_quarter_filter_is_refused_on_generalize():
    with pytest.raises(ValueError, match="Exact"):
        BoxPickVecEnv(2, variant="Generalize-4-1", quarter_filter=True)


def rollout(env, steps=150, seed=0):
    actions = torch.Generator().manual_seed(seed)
    out = []
    obs, _ = env.reset(seed=seed)
    out.append(obs["observation"].cpu())
    for _ in range(steps):
        obs, reward, _, _, _ = env.step(torch.randint(6, (env.num_envs,), generator=actions).to(env.device))
        out.append(torch.cat([obs["observation"], obs["desired_goal"]], 1).cpu())
        out.append(reward.cpu())
    return out


def test_determinism_from_seed():
    a = rollout(BoxPickVecEnv(32, variant="Exact-4"), seed=7)
    b = rollout(BoxPickVecEnv(32, variant="Exact-4"), seed=7)
    c = rollout(BoxPickVecEnv(32, variant="Exact-4"), seed=8)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_matches_cpu_on_given_states():
    grid = torch.stack([make_grid({**FAR, **start}) for _, start, _, _ in TRANSITIONS])
    actions = torch.tensor([a for _, _, a, _ in TRANSITIONS])
    results = []
    for device in ["cpu", "cuda"]:
        env = BoxPickVecEnv(len(TRANSITIONS), device=device)
        env.reset(options={"grid": grid})
        for _ in range(20):
            env.step(actions.to(device))
        results.append(env.grid.cpu())
    assert torch.equal(*results)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_generator_invariants():
    env = BoxPickVecEnv(4096, variant="Exact-4", split="unseen", device="cuda")
    box, target, agent_start, _ = env.sample_tasks(4096)
    assert (box.sum(1) == 4).all() and (target.sum(1) == 4).all()


STATE = ("grid", "goal", "agent_pos", "steps", "allowed")


def test_state_is_updated_in_place():
    """A CUDA graph that captured reset/step replays on the addresses it saw: the state must never be
    replaced by new tensors (a replaced tensor is freed, and the graph would write into freed memory)."""
    env = BoxPickVecEnv(64, variant="Exact-4", episode_length=5, seed=0)
    addresses = {name: getattr(env, name).data_ptr() for name in STATE}
    env.reset()
    generator = torch.Generator().manual_seed(0)
    for _ in range(12):  # crosses two auto-resets
        _, _, _, _, info = env.step(torch.randint(0, 6, (64,), generator=generator))
    env.reset(options={"grid": env.grid.clone()})
    assert {name: getattr(env, name).data_ptr() for name in STATE} == addresses


def test_returned_goal_is_a_copy():
    env = BoxPickVecEnv(8, variant="Exact-4", episode_length=1, seed=0)
    obs, _ = env.reset()
    goal = obs["desired_goal"].clone()
    _, _, _, _, info = env.step(torch.zeros(8, dtype=torch.long))  # every env auto-resets to a new task
    assert torch.equal(obs["desired_goal"], goal) and torch.equal(info["final_obs"]["desired_goal"], goal)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_graph_replay_matches_eager_steps():
    """Steps replayed from a CUDA graph follow the same trajectories as eager steps on the same states."""
    graphed, eager = (BoxPickVecEnv(256, variant="Generalize-4-1", device="cuda", seed=0, check_actions=False)
                      for _ in range(2))  # the range check syncs, which capture forbids
    actions = torch.zeros(256, dtype=torch.long, device="cuda")
    graphed.reset()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graphed.step(actions)  # warm-up, as torch.cuda.graphs requires
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    graph.register_generator_state(graphed.generator)  # the auto-reset draws tasks from it in every step
    with torch.cuda.graph(graph):
        graph_obs, graph_reward, _, _, _ = graphed.step(actions)
    eager.reset()
    graphed.reset(options={"grid": eager.grid.clone()})  # in place: the graph sees this state
    generator = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(60):  # within one 100-step episode: no auto-reset draws involved
        actions.copy_(torch.randint(0, 6, (256,), generator=generator, device="cuda"))
        graph.replay()
        obs, reward, _, _, _ = eager.step(actions)
        assert torch.equal(graph_obs["observation"], obs["observation"]) and torch.equal(graph_reward, reward)
    assert torch.equal(graphed.grid, eager.grid) and torch.equal(graphed.steps, eager.steps)


def test_registered_ids_make_batched_envs():
    for env_id in envs.BOXPICK_IDS:
        env = gym.make_vec(env_id, num_envs=3, split="unseen")
        obs, _ = env.reset(seed=0)
        assert obs["observation"].shape == (3, 36)
        assert env.unwrapped.split == "unseen"


# ----- bad input -----

def test_unknown_id_and_split_and_variant():
    with pytest.raises(ValueError, match="FlexLoop registers"):
        envs.make_vec("BoxPick-Exact-5-v0", 4)
    with pytest.raises(ValueError, match="split='train' or split='unseen'"):
        BoxPickVecEnv(4, split="test")
    with pytest.raises(ValueError, match="choose one of"):
        BoxPickVecEnv(4, variant="Exact-9")


@pytest.mark.parametrize("num_envs", [0, -3])
def test_num_envs_must_be_positive(num_envs):
    with pytest.raises(ValueError, match="positive"):
        BoxPickVecEnv(num_envs)


def test_bad_actions_are_refused_and_state_is_untouched():
    env = BoxPickVecEnv(4)
    env.reset(seed=0)
    before = env.grid.clone()
    with pytest.raises(ValueError, match=r"shape \(4,\)"):
        env.step(torch.zeros(3, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        env.step(torch.zeros(4))
    with pytest.raises(ValueError, match="0..5"):
        env.step(torch.tensor([0, 1, 6, 2]))
    with pytest.raises(ValueError, match="0..5"):
        env.step(torch.tensor([0, -1, 0, 2]))
    assert torch.equal(env.grid, before) and env.steps.sum() == 0


def test_illegal_given_states_are_refused():
    env = BoxPickVecEnv(1)
    with pytest.raises(ValueError, match="exactly one"):
        env.reset(options={"grid": make_grid({(0, 0): BOX, (1, 1): TARGET})[None]})
    with pytest.raises(ValueError, match="exactly one"):
        env.reset(options={"grid": make_grid({(0, 0): AGENT, (1, 1): AGENT_ON_TARGET_WITH_BOX})[None]})
    with pytest.raises(ValueError, match="as many boxes as targets"):
        env.reset(options={"grid": make_grid({(0, 0): AGENT, (1, 1): BOX})[None]})
    with pytest.raises(ValueError, match="0..11"):
        env.reset(options={"grid": torch.full((1, 36), 12)})
    with pytest.raises(ValueError, match="shape"):
        env.reset(options={"grid": torch.zeros(1, 35, dtype=torch.long)})
    with pytest.raises(TypeError, match="integer"):
        env.reset(options={"grid": torch.zeros(1, 36)})
    with pytest.raises(ValueError, match="not both"):
        env.reset(options={"grid": make_grid({(0, 0): AGENT_ON_BOX, (1, 1): TARGET})[None], "agent_pos": [3]})


def test_reset_from_agent_position_and_carrying_flag():
    env = BoxPickVecEnv(2)
    grid = torch.stack([make_grid({(0, 0): TARGET, (1, 1): BOX, (2, 2): TARGET}), make_grid({(4, 4): TARGET})])
    env.reset(options={"grid": grid, "agent_pos": [[1, 1], [5, 0]], "carrying": [True, True]})
    assert env.grid[0, 7].item() == AGENT_ON_BOX_CARRYING_BOX
    assert env.grid[1, 30].item() == AGENT_CARRYING_BOX
    assert env.agent_pos.tolist() == [7, 30]


def test_render_shows_every_cell_kind():
    text = bp.render(make_grid({(0, 0): AGENT_CARRYING_BOX, (0, 1): BOX, (0, 2): TARGET, (0, 3): BOX_ON_TARGET}))
    first = text.splitlines()[0]
    assert first.split()[:4] == ["A", "#", "o", "@"]
    assert len(text.splitlines()) == 6


@pytest.mark.parametrize("variant", ["Exact-4", "Generalize-4-1"])
def test_a_compiled_step_is_one_graph_after_its_single_random_draw(variant):
    """torch.compile cannot trace a draw from an explicit torch.Generator, and every such draw split the step
    into pieces that recompiled per env (dynamo's recompile limit, issue 14). The step now makes one draw for all
    its randomness, first, so the rest compiles as one graph."""
    torch._dynamo.reset()
    env = BoxPickVecEnv(8, variant=variant, seed=0, check_actions=False)
    env.reset()
    explanation = torch._dynamo.explain(env.step)(torch.zeros(8, dtype=torch.long))
    assert explanation.graph_break_count <= 1, [str(b.reason)[:200] for b in explanation.break_reasons]


def test_tasks_are_a_pure_function_of_the_noise():
    """Same noise, same tasks; the draw is the only randomness (so a seeded env replays its task stream)."""
    env = BoxPickVecEnv(64, variant="Exact-4", seed=0)
    noise = env._task_noise(64)
    first, second = env.sample_tasks(64, noise), env.sample_tasks(64, noise.clone())
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(env.sample_tasks(64)[0], first[0])


def topk_tasks(env, noise):
    """Exact's tasks of `noise` built the plain way (topk thresholds, scatters into the quadrants' cells): what
    the fused sampler must reproduce exactly."""
    n, k = noise.shape[0], env.settings["num_boxes"]
    cells = torch.tensor(bp.QUADRANT_CELLS)
    pairs = torch.tensor(bp.TRAIN_QUADRANT_PAIRS if env.split == "train" else bp.UNSEEN_QUADRANT_PAIRS)
    pair = pairs[(noise[:, 0] * len(pairs)).long().clamp(max=len(pairs) - 1)]
    planes = []
    for side, draws in enumerate([noise[:, 1:10], noise[:, 10:19]]):
        threshold = torch.topk(draws, k, dim=1, largest=False).values[:, -1:]
        planes.append(torch.zeros(n, 36, dtype=torch.bool).scatter_(1, cells[pair[:, side]], draws <= threshold))
    agent = cells[pair[:, 0]].gather(1, (noise[:, -1] * 9).long().clamp(max=8)[:, None])[:, 0]
    return planes[0], planes[1], agent


@pytest.mark.parametrize("variant", ["Exact-3", "Exact-4"])
@pytest.mark.parametrize("split", ["train", "unseen"])
def test_task_sampler_matches_topk_and_scatter_exactly(variant, split):
    """Exact's sampler counts ranks pairwise and builds planes cell by cell (so torch.compile fuses it); it must
    pick the same cells as topk thresholds and scatters, also when draws tie (coarse noise makes ties common)."""
    env = BoxPickVecEnv(512, variant=variant, split=split, seed=0)
    for noise in [env._task_noise(512), torch.randint(0, 6, (512, env._noise_width())) / 6]:
        box, target, agent_start, _ = env.sample_tasks(512, noise)
        expected_box, expected_target, expected_agent = topk_tasks(env, noise)
        assert torch.equal(box, expected_box) and torch.equal(target, expected_target)
        assert torch.equal(agent_start, expected_agent)
