"""envs/ogbench_data.py: generation round trip, OGBench goal sampling, clear errors. CPU, no network."""

import time
import urllib.error

import numpy as np
import pytest
import torch

pytest.importorskip("ogbench")
import ogbench  # noqa: E402

from envs import ogbench_data as od  # noqa: E402

PM = "pointmaze-large-stitch-v0"
CUBE = "cube-double-play-v0"
PM_EPISODES, PM_STEPS = 6, 60
CUBE_EPISODES, CUBE_STEPS = 2, 80
TINY = [(PM, PM_EPISODES, PM_STEPS, 3), (CUBE, CUBE_EPISODES, CUBE_STEPS, 1)]  # name, episodes, steps, val eps


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    # generate once: tiny pointmaze (3 val episodes) and cube-double (1 val episode) datasets
    out = tmp_path_factory.mktemp("ogbench")
    od.generate_dataset(PM, str(out), PM_EPISODES, PM_STEPS, seed=0, workers=1, val_fraction=0.5, progress=False)
    od.generate_dataset(CUBE, str(out), CUBE_EPISODES, CUBE_STEPS, seed=0, workers=1, progress=False)
    return out


def _synthetic(traj_lens, **kw):
    """A GCDataset whose observation is its own index, so goals can be read back as indices."""
    n = sum(traj_lens)
    valids = np.ones(n, dtype=np.float32)
    valids[np.cumsum(traj_lens) - 1] = 0.0
    obs = np.arange(n, dtype=np.float32)[:, None]
    return od.GCDataset(obs, np.zeros((n, 1), np.float32), valids, **kw)


def _gen(seed=0):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ----------------------------------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("name,episodes,steps,n_val", TINY)
def test_files_load_through_ogbench(data_dir, name, episodes, steps, n_val):
    spec = od.DATASETS[name]
    path = str(data_dir / f"{name}.npz")
    raw = np.load(path)
    assert {"observations", "actions", "terminals", "qpos", "qvel"} <= set(raw.files)
    assert raw["observations"].dtype == np.float32 and raw["actions"].dtype == np.float32
    assert raw["terminals"].dtype == bool
    assert raw["observations"].shape == (episodes * steps, spec.obs_dim)
    assert raw["actions"].shape == (episodes * steps, spec.action_dim)
    np.testing.assert_array_equal(np.nonzero(raw["terminals"])[0], np.arange(1, episodes + 1) * steps - 1)
    assert np.abs(raw["actions"]).max() <= 1.0

    # ogbench's own loader, regular and compact layouts (it also finds the -val file itself)
    env, train, val = ogbench.make_env_and_datasets(name, dataset_path=path)
    assert env.observation_space.shape == (spec.obs_dim,)
    assert train["observations"].shape == (episodes * (steps - 1), spec.obs_dim)
    assert train["next_observations"].shape == train["observations"].shape
    np.testing.assert_array_equal(train["next_observations"][: steps - 2], raw["observations"][1 : steps - 1])
    assert val["observations"].shape == (n_val * (steps - 1), spec.obs_dim)
    _, train_c, _ = ogbench.make_env_and_datasets(name, dataset_path=path, compact_dataset=True)
    assert train_c["valids"].sum() == episodes * (steps - 1)


@pytest.mark.parametrize("name,episodes,steps,n_val", TINY)
def test_load_dataset(data_dir, name, episodes, steps, n_val):
    train, val = od.load_dataset(name, dataset_dir=str(data_dir), with_val=True, download=False)
    same = od.load_dataset(name, dataset_path=str(data_dir / f"{name}.npz"))
    raw = np.load(data_dir / f"{name}.npz")
    for ds in (train, same):
        assert ds.size == episodes * steps and ds.num_valid == episodes * (steps - 1)
        assert ds.num_trajectories == episodes
        assert ds.observations.dtype == torch.float32 and ds.actions.dtype == torch.float32
        assert ds.observations.device.type == "cpu"
        np.testing.assert_array_equal(ds.observations.numpy(), raw["observations"])
        ends = np.arange(1, episodes + 1) * steps - 1
        np.testing.assert_array_equal(np.nonzero(ds.valids.numpy() == 0)[0], ends)
        # the last valid index of each trajectory, and trajectory ids, for every valid index
        v = ds.valid_idxs.numpy()
        np.testing.assert_array_equal(ds.final_idxs.numpy()[v], (v // steps + 1) * steps - 2)
        np.testing.assert_array_equal(ds.traj_ids.numpy(), np.arange(ds.size) // steps)
    assert val.num_trajectories == n_val and val.size == n_val * steps


def _write_like_ogbench(src, dst):
    """Re-save a file the way OGBench's data_gen_scripts write the files it serves: lists of steps turned into
    arrays (terminals bool, button_states int64, the rest float32), then np.savez_compressed(path, **dataset)."""
    raw = np.load(src)
    dataset = {}
    for k in raw.files:
        dtype = bool if k == "terminals" else np.int64 if k == "button_states" else np.float32
        dataset[k] = np.array([step for step in raw[k]], dtype=dtype)
    np.savez_compressed(dst, **dataset)


def _assert_loader_cannot_tell(name, generated_dir, downloaded_dir):
    """The generated file and an OGBench-written one have the same members, dtypes and shapes, and every loader
    (ogbench's, compact and not, and load_dataset with its -val file) returns the same arrays for both."""
    gen, down = np.load(generated_dir / f"{name}.npz"), np.load(downloaded_dir / f"{name}.npz")
    assert gen.files == down.files
    for k in gen.files:
        assert gen[k].dtype == down[k].dtype and gen[k].shape == down[k].shape, k
    for compact in (False, True):
        a = ogbench.load_dataset(str(generated_dir / f"{name}.npz"), compact_dataset=compact)
        b = ogbench.load_dataset(str(downloaded_dir / f"{name}.npz"), compact_dataset=compact)
        assert a.keys() == b.keys()
        for k in a:
            assert a[k].dtype == b[k].dtype
            np.testing.assert_array_equal(a[k], b[k])
    ga, gv = od.load_dataset(name, dataset_dir=str(generated_dir), with_val=True, download=False)
    da, dv = od.load_dataset(name, dataset_dir=str(downloaded_dir), with_val=True, download=False)
    for x, y in [(ga, da), (gv, dv)]:
        for attr in ["observations", "actions", "valids", "valid_idxs", "final_idxs", "traj_ids"]:
            assert torch.equal(getattr(x, attr), getattr(y, attr)), attr


@pytest.mark.parametrize("name", [PM, CUBE])
def test_loader_cannot_tell_generated_from_downloaded(data_dir, tmp_path, name):
    for suffix in ["", "-val"]:
        _write_like_ogbench(data_dir / f"{name}{suffix}.npz", tmp_path / f"{name}{suffix}.npz")
    _assert_loader_cannot_tell(name, data_dir, tmp_path)


def test_generation_is_seeded(tmp_path, monkeypatch):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    od.generate_dataset(PM, str(a), 3, 30, seed=1, workers=1, progress=False)
    real_time = time.time
    monkeypatch.setattr(time, "time", lambda: real_time() + 3600)  # an hour later: no time stamp in the bytes
    od.generate_dataset(PM, str(b), 3, 30, seed=1, workers=1, progress=False)
    od.generate_dataset(PM, str(c), 3, 30, seed=2, workers=1, progress=False)
    for name in (f"{PM}.npz", f"{PM}-val.npz"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
        assert (a / name).read_bytes() != (c / name).read_bytes()
    fa = np.load(a / f"{PM}.npz")
    # the stitch oracle moves: actions are clipped unit directions plus noise, positions change
    assert np.abs(np.diff(fa["observations"], axis=0)).max() > 0.05


@pytest.mark.slow  # spawned workers each import mujoco, ogbench and torch
def test_generation_bytes_do_not_depend_on_workers(tmp_path):
    for workers in (1, 2):
        od.generate_dataset(PM, str(tmp_path / str(workers)), 3, 30, seed=1, workers=workers, progress=False)
    for name in (f"{PM}.npz", f"{PM}-val.npz"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


@pytest.mark.parametrize("name", ["scene-play-v0", "puzzle-4x4-play-v0"])
def test_generate_scene_and_puzzle_smoke(tmp_path, name):
    od.generate_dataset(name, str(tmp_path), 1, 30, seed=0, workers=1, progress=False)
    raw = np.load(tmp_path / f"{name}.npz")
    assert raw["button_states"].dtype == np.int64
    ds = od.load_dataset(name, dataset_dir=str(tmp_path), download=False)
    assert ds.obs_dim == od.DATASETS[name].obs_dim and ds.num_valid == 29
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for suffix in ["", "-val"]:
        _write_like_ogbench(tmp_path / f"{name}{suffix}.npz", downloaded / f"{name}{suffix}.npz")
    _assert_loader_cannot_tell(name, tmp_path, downloaded)


def test_table_matches_eval_envs():
    for name in [PM, "antmaze-medium-stitch-v0", CUBE]:
        spec = od.DATASETS[name]
        env = od.make_eval_env(name)
        assert env.observation_space.shape == (spec.obs_dim,)
        assert env.action_space.shape == (spec.action_dim,)
        assert env.spec.max_episode_steps == spec.episode_limit
    assert set(od.DATASETS) == {
        "scene-play-v0",
        "cube-double-play-v0",
        "puzzle-4x4-play-v0",
        "antmaze-medium-stitch-v0",
        "pointmaze-large-stitch-v0",
    }


# ----------------------------------------------------------------------------------------------------------- sampler


def test_sampler_on_generated_data(data_dir):
    from flexloop_gciql import DATASET_HYPERPARAMETERS  # the actor's goal probabilities live with GC-IQL

    ds = od.load_dataset(PM, dataset_dir=str(data_dir), download=False,
                         actor_goals=DATASET_HYPERPARAMETERS[PM].actor_goals)
    n = 200_000
    b = ds.sample(n, _gen(0), return_goal_kind=True)
    idx, vg, ag = b["idxs"], b["value_goal_idxs"], b["actor_goal_idxs"]
    vk, ak = b["value_goal_kinds"], b["actor_goal_kinds"]
    for k in ["observations", "actions", "next_observations", "value_goals", "actor_goals", "rewards", "masks"]:
        assert b[k].dtype == torch.float32 and b[k].shape[0] == n

    # goal-type frequencies: value 0.2 / 0.5 / 0.3, actor (navigation) 0 / 0.5 / 0.5
    vfreq = torch.bincount(vk, minlength=3).float() / n
    afreq = torch.bincount(ak, minlength=3).float() / n
    assert torch.allclose(vfreq, torch.tensor([0.2, 0.5, 0.3]), atol=0.01), vfreq
    assert torch.allclose(afreq, torch.tensor([0.0, 0.5, 0.5]), atol=0.01), afreq

    # transitions never cross a trajectory boundary
    assert (ds.valids[idx] == 1).all()
    assert (ds.traj_ids[idx] == ds.traj_ids[idx + 1]).all()
    assert torch.equal(b["next_observations"], ds.observations[idx + 1])
    assert torch.equal(b["observations"], ds.observations[idx])
    assert torch.equal(b["value_goals"], ds.observations[vg])
    assert torch.equal(b["actor_goals"], ds.observations[ag])

    # current goals are the current index; trajectory goals stay in the trajectory, ahead, at most its last valid
    # state; random goals are valid states
    final = ds.final_idxs[idx]
    for goals, kinds in [(vg, vk), (ag, ak)]:
        assert (goals[kinds == od.GOAL_CURRENT] == idx[kinds == od.GOAL_CURRENT]).all()
        t = kinds == od.GOAL_TRAJECTORY
        assert (ds.traj_ids[goals[t]] == ds.traj_ids[idx[t]]).all()
        assert (goals[t] >= torch.minimum(idx[t] + 1, final[t])).all() and (goals[t] <= final[t]).all()
        assert (ds.valids[goals[kinds == od.GOAL_RANDOM]] == 1).all()
    # geometric offsets get clipped at the last valid index with short trajectories
    assert (vg[vk == od.GOAL_TRAJECTORY] == final[vk == od.GOAL_TRAJECTORY]).any()

    # OGBench rewards/masks: success iff value goal index == current index
    success = (idx == vg).float()
    assert torch.equal(b["rewards"], success - 1.0) and torch.equal(b["masks"], 1.0 - success)
    assert set(b["rewards"].unique().tolist()) <= {0.0, -1.0}
    assert (success[vk == od.GOAL_CURRENT] == 1).all()
    assert torch.equal(b["value_goals"][success == 1], b["observations"][success == 1])


def test_value_offsets_are_geometric_in_gamma():
    ds = _synthetic([30_000, 30_000, 30_000], gamma=0.99)
    b = ds.sample(400_000, _gen(1), return_goal_kind=True)
    idx, vg, vk = b["idxs"], b["value_goal_idxs"], b["value_goal_kinds"]
    # observation == index, so goals can be read off the batch itself
    assert torch.equal(b["value_goals"][:, 0].long(), vg)
    # rows far from the end are never clipped (P(offset > 3000) ~ 1e-13), so their offsets are pure Geometric(0.01)
    far = (vk == od.GOAL_TRAJECTORY) & (ds.final_idxs[idx] - idx >= 3000)
    off = (vg - idx)[far].double()
    assert far.sum() > 150_000 and off.min() >= 1
    assert abs(off.mean().item() - 100.0) < 1.5  # mean 1/(1-gamma)
    gamma_hat = 1.0 - 1.0 / off.mean().item()
    assert abs(gamma_hat - 0.99) < 2e-4
    for k in [1, 10, 50, 100, 300]:
        assert abs((off <= k).double().mean().item() - (1 - 0.99**k)) < 0.006, k
    # P(offset = j+1) / P(offset = j) = gamma: compare mass of [1, 50] with [51, 100]
    ratio = ((off > 50) & (off <= 100)).double().sum() / (off <= 50).double().sum()
    assert abs(ratio.item() - 0.99**50) < 0.02


def test_actor_trajectory_goals_uniform_for_manipulation():
    from flexloop_gciql import DATASET_HYPERPARAMETERS  # the actor's goal probabilities live with GC-IQL

    spec, (p_cur, p_traj, p_random) = od.DATASETS[CUBE], DATASET_HYPERPARAMETERS[CUBE].actor_goals
    ds = _synthetic(
        [2000, 3000, 1001],
        actor_p_curgoal=p_cur,
        actor_p_trajgoal=p_traj,
        actor_p_randomgoal=p_random,
        actor_geom_sample=spec.actor_geom_sample,
    )
    b = ds.sample(200_000, _gen(2), return_goal_kind=True)
    idx, ag = b["idxs"], b["actor_goal_idxs"]
    assert (b["actor_goal_kinds"] == od.GOAL_TRAJECTORY).all()
    final = ds.final_idxs[idx]
    lo = torch.minimum(idx + 1, final)
    assert (ag >= lo).all() and (ag <= final).all()
    assert (ds.traj_ids[ag] == ds.traj_ids[idx]).all()
    keep = final - lo >= 200  # long enough that the integer grid does not matter
    frac = ((ag - lo).double() / (final - lo).double())[keep]
    for q in [0.1, 0.25, 0.5, 0.75, 0.9]:
        assert abs((frac <= q).double().mean().item() - q) < 0.01


def test_sampler_seeded_and_edge_of_trajectory():
    ds = _synthetic([5, 3, 7])
    a, b = ds.sample(64, _gen(3)), ds.sample(64, _gen(3))
    for k in a:
        assert torch.equal(a[k], b[k])
    # at a trajectory's last valid state every trajectory goal is that state itself (OGBench clipping) -> success
    out = ds.sample(20_000, _gen(4), return_goal_kind=True)
    at_end = (out["idxs"] == ds.final_idxs[out["idxs"]]) & (out["value_goal_kinds"] == od.GOAL_TRAJECTORY)
    assert at_end.any() and (out["rewards"][at_end] == 0).all()


# ------------------------------------------------------------------------------------------------------ bad input


def _assert_says_download_and_generate(msg, name):
    assert "download_datasets" in msg and "rail.eecs.berkeley.edu" in msg
    assert f"python -m envs.ogbench_data generate --env {name}" in msg
    # the scripts' flag, spelled as the command line takes it (dataset_dir= only as the Python keyword)
    assert "pass --dataset-dir DIR" in msg and "pass dataset_dir" not in msg


def test_missing_dataset_clear_error(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError) as e:
        od.load_dataset(CUBE, dataset_dir=str(tmp_path), download=False)
    _assert_says_download_and_generate(str(e.value), CUBE)

    with pytest.raises(FileNotFoundError) as e:
        od.load_dataset(PM, dataset_path=str(tmp_path / "nope.npz"))
    _assert_says_download_and_generate(str(e.value), PM)

    # a failed download (no network) becomes the same clear error; never touches the network here
    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(ogbench, "download_datasets", offline)
    with pytest.raises(FileNotFoundError) as e:
        od.load_dataset(CUBE, dataset_dir=str(tmp_path))
    assert "download failed" in str(e.value)
    _assert_says_download_and_generate(str(e.value), CUBE)


def test_unknown_and_corrupt(tmp_path, data_dir):
    with pytest.raises(ValueError, match="supported: .*scene-play-v0"):
        od.load_dataset("cube-single-play-v0", dataset_dir=str(tmp_path))
    bad = tmp_path / f"{CUBE}.npz"
    bad.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="could not read"):
        od.load_dataset(CUBE, dataset_path=str(bad))
    # a file of another dataset is caught by its shapes
    with pytest.raises(ValueError, match="obs dim 37"):
        od.load_dataset(CUBE, dataset_path=str(data_dir / f"{PM}.npz"))


def test_generate_command_names_the_flag_that_loads_its_output(tmp_path, capsys):
    assert od.main(["generate", "--env", PM, "--out", str(tmp_path), "--episodes", "2", "--episode-steps", "10",
                    "--workers", "1", "--no-progress"]) == 0
    assert f"python flexloop_gciql.py --env-name {PM} --dataset-dir {tmp_path}" in capsys.readouterr().out
    assert (tmp_path / f"{PM}.npz").is_file()


def test_generate_bad_inputs_one_line_errors(tmp_path, capsys):
    assert od.main(["generate", "--env", "antmaze-large-stitch-v0", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown OGBench dataset" in err and "supported: scene-play-v0" in err
    assert od.main(["generate", "--env", PM, "--out", str(tmp_path), "--episodes", "0"]) == 2
    assert "episodes >= 1" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    real_write = od._write_npz
    calls = []

    def fail_on_second_file(f, arrays):  # the train file is written, the val file fails (a full disk, a kill)
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        real_write(f, arrays)

    monkeypatch.setattr(od, "_write_npz", fail_on_second_file)
    with pytest.raises(OSError, match="disk full"):
        od.generate_dataset(PM, str(tmp_path), 2, 10, seed=0, workers=1, progress=False)
    assert list(tmp_path.iterdir()) == []  # neither file, nor a .tmp, under any name


def test_pointmaze_oracle_reaches_its_stitch_goals():
    # the collector's check: noisy waypoint following reaches goals 4 cells away within the 201-step episodes
    stats = od.waypoint_success(PM, episodes=6)
    assert stats["reached"] >= 0.8 and 0.0 <= stats["at_goal_at_end"] <= stats["reached"]
    with pytest.raises(ValueError, match="not a maze"):
        od.waypoint_success(CUBE)


# ------------------------------------------------------------------------------------------------------- antmaze

ANT = "antmaze-medium-stitch-v0"


@pytest.fixture(scope="module")
def untrained_expert(tmp_path_factory):
    from envs import ant_expert

    torch.manual_seed(0)
    path = str(tmp_path_factory.mktemp("expert") / "expert.pt")
    ant_expert.save_expert(ant_expert.Actor(29, 8, (32, 32)), path, "online-ant-xy-v0", 0, (32, 32))
    return path


def test_antmaze_generation_with_an_expert(tmp_path, untrained_expert):
    _, _, stats = od.generate_dataset(ANT, str(tmp_path), 2, 25, seed=0, workers=1, progress=False,
                                      expert_path=untrained_expert, return_stats=True)
    raw = np.load(tmp_path / f"{ANT}.npz")
    assert set(raw.files) == {"observations", "actions", "terminals", "qpos", "qvel"}
    assert raw["observations"].shape == (50, 29) and raw["actions"].shape == (50, 8)
    assert raw["qpos"].shape == (50, 15) and raw["qvel"].shape == (50, 14)
    assert np.abs(raw["actions"]).max() <= 1.0
    # the ant starts at its cell centre (plus OGBench's start noise): x, y of the first state are a cell's
    env = od.make_eval_env(ANT)
    ij = env.unwrapped.xy_to_ij(raw["observations"][0, :2])
    assert env.unwrapped.maze_map[ij] == 0
    assert stats["expert_env_steps"] == 0 and 0.0 <= stats["mean_reached"] <= 1.0
    ds = od.load_dataset(ANT, dataset_dir=str(tmp_path), download=False)
    assert ds.num_valid == 48 and ds.obs_dim == 29 and ds.action_dim == 8
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for suffix in ["", "-val"]:
        _write_like_ogbench(tmp_path / f"{ANT}{suffix}.npz", downloaded / f"{ANT}{suffix}.npz")
    _assert_loader_cannot_tell(ANT, tmp_path, downloaded)


@pytest.mark.slow  # two spawned workers import mujoco, ogbench and torch
def test_antmaze_bytes_do_not_depend_on_workers(tmp_path, untrained_expert):
    for workers in (1, 2):
        od.generate_dataset(ANT, str(tmp_path / str(workers)), 3, 15, seed=4, workers=workers, progress=False,
                            expert_path=untrained_expert)
    for name in (f"{ANT}.npz", f"{ANT}-val.npz"):
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes()


def test_antmaze_without_an_expert_fails_in_one_line(tmp_path, capsys):
    missing = tmp_path / "no_expert.pt"
    assert od.main(["generate", "--env", ANT, "--out", str(tmp_path / "out"), "--expert", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert f"no ant expert at {missing}" in err and "python -m envs.ant_expert train --device cuda" in err
    assert not (tmp_path / "out").exists()
    # an expert of the wrong shape is refused too
    from envs import ant_expert

    ant_expert.save_expert(ant_expert.Actor(5, 2, (8,)), str(missing), "online-ant-xy-v0", 10, (8,))
    with pytest.raises(ValueError, match="needs 29 .* to 8"):
        od.generate_dataset(ANT, str(tmp_path / "out"), 1, 10, progress=False, expert_path=str(missing))
