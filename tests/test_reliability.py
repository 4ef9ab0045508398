"""Reliability (issue 8): real runs killed by SIGTERM (they save first) or SIGKILL and resumed, with the steps,
metrics.jsonl and W&B run continuing; atomic checkpoint writes under a crash, an interrupt, a full disk or an
unwritable folder; checkpoints that carry code, are cut short, foreign or incomplete; NaN in a loss; bad flags.
tests/test_gc*.py and tests/test_eval_adaptive.py cover the cases not repeated here."""

import errno
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

import eval_adaptive as ea
import flexloop_run
from conftest import flags as as_flags
import flexloop_gcdqn as gcdqn
import flexloop_gciql as gciql
import flexloop_gcppo as gcppo
from envs import ogbench_data

ROOT = Path(__file__).resolve().parent.parent
SUBPROCESS_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
SCRIPTS = {"gcdqn": gcdqn, "gcppo": gcppo, "gciql": gciql}
PM = "pointmaze-large-stitch-v0"

# Tiny runs. GC-DQN: 2 phases x 15 intervals of one 10-step episode in 16 envs + 3 updates (about 2 s).
DQN = dict(num_envs=16, batch_size=16, updates_per_rollout=3, intervals_per_epoch=15, pretrain_epochs=1,
           num_epochs=1, hidden_dim=16, episode_length=10, replay_episodes=4, num_eval_envs=8, eval_every=1000,
           log_every=1, save_every=2, cuda=False)
DQN_INTERVALS = 2 * DQN["intervals_per_epoch"]
# GC-PPO: 2 phases x 40 iterations of 64 env steps and 2 minibatch updates.
PPO = dict(num_envs=8, num_steps=8, num_minibatches=2, update_epochs=1, depth=2, hidden_dim=8,
           pretrain_timesteps=64 * 40, total_timesteps=64 * 40, num_eval_envs=4, eval_every=1000, log_every=1,
           save_every=1000, cuda=False)
# GC-IQL: 2 phases x 200 updates on a generated pointmaze dataset, logged every 5, no evaluation (no MuJoCo).
IQL = dict(env_name=PM, download=False, depth=2, hidden_dim=8, batch_size=16, pretrain_steps=200, total_steps=200,
           log_every=5, save_every=1000, eval_episodes=0, cuda=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("pointmaze")
    ogbench_data.generate_dataset(PM, str(out), episodes=8, episode_steps=60, seed=0, progress=False)
    return out


def script_args(script, run_dir, data_dir=None, **overrides):
    flags = {"gcdqn": DQN, "gcppo": PPO, "gciql": {**IQL, "dataset_dir": str(data_dir)}}[script]
    return SCRIPTS[script].Args(**{**flags, "run_dir": str(run_dir), **overrides})


def read_metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------------------
# Kill and resume: real runs in a subprocess
# ---------------------------------------------------------------------------------------------------------
def start(script, flags, runs, log, env=SUBPROCESS_ENV):
    """The script's CLI in a fresh process; its output goes to a file (a full pipe would block it)."""
    command = [sys.executable, f"flexloop_{script}.py", *as_flags(flags), "--run-dir", str(runs)]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_folder(runs):
    folders = list(runs.iterdir()) if runs.exists() else []
    return folders[0] if folders else None


def count_logged(runs, key):
    """Training records written so far (read while the run writes them)."""
    folder = run_folder(runs)
    metrics = folder / "metrics.jsonl" if folder else None
    return metrics.read_text().count(f'"{key}"') if metrics and metrics.exists() else 0


def saved_interval(runs):
    folder = run_folder(runs)
    if folder is None or not (folder / "latest.pt").exists():
        return -1
    return torch.load(folder / "latest.pt", weights_only=True)["iteration"]


def wait_until(condition, process, log_path, timeout=90):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, f"the run ended before it was killed:\n{log_path.read_text()[-3000:]}"
        assert time.time() < deadline, f"timed out waiting for the run:\n{log_path.read_text()[-3000:]}"
        time.sleep(0.01)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The tiny GC-DQN run, never stopped: what a killed and resumed run must match."""
    return gcdqn.train(gcdqn.Args(**DQN, run_dir=str(tmp_path_factory.mktemp("uninterrupted"))))


def dqn_progress(run_dir):
    """What a kill must not change: every record's step, phase, counters and keys, and the final counters."""
    records = [(r["global_step"], r["phase"], r.get("charts/iteration"), r.get("charts/updates"), sorted(r))
               for r in read_metrics(run_dir)]
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    return records, {key: final[key] for key in ("iteration", "updates", "global_step", "phase")}


@pytest.mark.slow
def test_sigterm_saves_latest_and_exits_then_resume_continues_steps_metrics_and_wandb_run(tmp_path, uninterrupted):
    """SLURM preemption: SIGTERM mid-run writes latest.pt at the interval it stopped in (save_every is too large
    to have written any) and exits 0. --resume (a fresh process, W&B offline) finishes the run with the same
    steps and records as the uninterrupted run, refilling the replay, under the same W&B run id."""
    runs, log_path = tmp_path / "runs", tmp_path / "log.txt"
    env = {**SUBPROCESS_ENV, "WANDB_DIR": str(tmp_path)}  # W&B's ./wandb, here in tmp_path
    with open(log_path, "w") as log:
        process = start("gcdqn", {**DQN, "save_every": 1000, "track": True}, runs, log, env)
        wait_until(lambda: count_logged(runs, "losses/td_loss") >= 3, process, log_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    run_dir = run_folder(runs)
    assert "SIGTERM: saved" in log_path.read_text() and not (run_dir / "final.pt").exists()
    checkpoint = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    last_record = [r for r in read_metrics(run_dir) if "losses/td_loss" in r][-1]
    assert 3 <= checkpoint["iteration"] < DQN_INTERVALS  # stopped mid-run
    assert (checkpoint["iteration"], checkpoint["global_step"]) == (last_record["charts/iteration"],
                                                                   last_record["global_step"])  # nothing lost
    wandb_id = checkpoint["wandb_id"]
    assert wandb_id

    resumed = subprocess.run([sys.executable, "flexloop_gcdqn.py", "--resume", str(run_dir / "latest.pt")], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "the replay refills" in resumed.stdout
    assert dqn_progress(run_dir) == dqn_progress(uninterrupted)
    assert (run_dir / "pretrained.pt").exists()
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["wandb_id"] == wandb_id
    offline_runs = [p.name for p in (tmp_path / "wandb").glob("offline-run-*")]
    assert len(offline_runs) == 2 and all(wandb_id in name for name in offline_runs), offline_runs
    synced = re.search(r"W&B ran offline; upload the run with\n\s+wandb sync (\S+)", resumed.stdout)
    assert (ROOT / synced.group(1)).resolve().parent == (tmp_path / "wandb").resolve()  # plain `wandb sync`'s place


@pytest.mark.parametrize("script", ["gcdqn", "gcppo"])
def test_a_run_stopped_in_its_final_evaluation_evaluates_once_more_when_resumed(tmp_path, script):
    """What a stop in the final evaluation leaves: latest.pt after the last update, and neither final.pt nor the
    final evaluation in metrics.jsonl (tests/test_gciql.py makes that stop for real). Resumed, the run evaluates
    once, then writes final.pt."""
    module, eval_key = SCRIPTS[script], "eval/train/success_depth_1"
    run_dir = Path(module.train(script_args(script, tmp_path)))
    (run_dir / "final.pt").rename(run_dir / "latest.pt")
    records = read_metrics(run_dir)
    last_step = records[-1]["global_step"]
    kept = [r for r in records if not (eval_key in r and r["global_step"] == last_step)]
    assert len(kept) < len(records)  # the final evaluation was there to drop
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))

    module.train(module.Args(resume=str(run_dir / "latest.pt")))
    evaluated = [r["global_step"] for r in read_metrics(run_dir) if eval_key in r]
    assert evaluated[-1] == last_step and evaluated.count(last_step) == 1
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["global_step"] == last_step


@pytest.mark.slow
def test_sigkill_resumes_from_the_last_periodic_checkpoint(tmp_path, uninterrupted):
    """SIGKILL leaves no chance to save: the run resumes from the last periodic latest.pt (every 2 intervals), and
    the records the killed run wrote after it, the last one cut short mid-write, are dropped and written again."""
    runs, log_path = tmp_path / "runs", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        process = start("gcdqn", DQN, runs, log)
        wait_until(lambda: saved_interval(runs) >= 4, process, log_path)
        process.kill()
        process.wait(timeout=60)
    run_dir = run_folder(runs)
    assert not (run_dir / "final.pt").exists()
    assert flexloop_run.load_checkpoint(run_dir / "latest.pt")["iteration"] < DQN_INTERVALS
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"global_step": 99999, "phase": "pre')  # a record the kill cut short
    assert gcdqn.train(gcdqn.Args(resume=str(run_dir / "latest.pt"))) == run_dir
    assert dqn_progress(run_dir) == dqn_progress(uninterrupted)


@pytest.mark.slow
@pytest.mark.parametrize("script, key, step_size, records, counter, final_count", [
    ("gcppo", "losses/policy_loss", 64, 80, "iteration", 80),  # 64 env steps per iteration, logged every iteration
    ("gciql", "losses/critic_loss", 5, 80, "updates", 400),  # logged every 5 updates
])
def test_sigterm_saves_and_resume_finishes_the_run(tmp_path, data_dir, script, key, step_size, records, counter,
                                                   final_count):
    module = SCRIPTS[script]
    flags = PPO if script == "gcppo" else {**IQL, "dataset_dir": str(data_dir)}
    runs, log_path = tmp_path / "runs", tmp_path / "log.txt"
    with open(log_path, "w") as log:
        process = start(script, flags, runs, log)
        wait_until(lambda: count_logged(runs, key) >= 2, process, log_path)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    run_dir = run_folder(runs)
    assert "SIGTERM: saved" in log_path.read_text() and not (run_dir / "final.pt").exists()
    checkpoint = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    last_record = [r for r in read_metrics(run_dir) if key in r][-1]
    # saved where it stopped (GC-IQL can stop between logs), mid-run
    assert last_record["global_step"] <= checkpoint["global_step"] < last_record["global_step"] + step_size
    assert checkpoint["global_step"] < records * step_size

    module.train(module.Args(resume=str(run_dir / "latest.pt")))
    steps = [r["global_step"] for r in read_metrics(run_dir) if key in r]
    assert steps == [step_size * i for i in range(1, records + 1)]  # none repeated, none missing
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert (final["global_step"], final[counter]) == (step_size * records, final_count)


@pytest.mark.parametrize("script, budget", [pytest.param("gcdqn", "num_epochs", marks=pytest.mark.slow),
                                            ("gcppo", "total_timesteps"),
                                            pytest.param("gciql", "total_steps", marks=pytest.mark.slow)])
def test_a_resumed_run_started_from_init_checkpoint_stays_post_training(tmp_path, data_dir, script, budget):
    """--init-checkpoint skips pretraining, and so must the run's resume: its own flags still carry the
    --pretrain-* budget, which a resume that counted it would train (after the FlexLoop rows it had logged)."""
    module = SCRIPTS[script]
    pre_dir = module.train(script_args(script, tmp_path / "pre", data_dir, **{budget: 0}))
    init = str(pre_dir / "final.pt")
    doubled = 2 * getattr(script_args(script, tmp_path, data_dir), budget)
    direct = module.train(script_args(script, tmp_path / "direct", data_dir, init_checkpoint=init,
                                      **{budget: doubled}))
    run_dir = module.train(script_args(script, tmp_path / "cut", data_dir, init_checkpoint=init))
    # stop it where it ended, as if its budget had been twice this: a killed run's latest.pt and no final.pt
    checkpoint = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    checkpoint["args"][budget] *= 2
    flexloop_run.save_checkpoint(run_dir / "latest.pt", checkpoint)
    (run_dir / "final.pt").unlink()
    module.train(module.Args(resume=str(run_dir / "latest.pt")))
    records = read_metrics(run_dir)
    assert {r["phase"] for r in records} == {"flexloop"}
    steps = [r["global_step"] for r in records]
    assert steps == sorted(steps) and steps[-1] == read_metrics(direct)[-1]["global_step"]
    assert flexloop_run.load_checkpoint(run_dir / "final.pt")["global_step"] == \
        flexloop_run.load_checkpoint(direct / "final.pt")["global_step"]


# ---------------------------------------------------------------------------------------------------------
# Atomic writes: whatever fails while a checkpoint is written, the previous one stays whole and no temp file
# stays behind; an OSError names the fix
# ---------------------------------------------------------------------------------------------------------
def checkpoint_payload(module, interval):
    return {"format": flexloop_run.CHECKPOINT_FORMAT, "algorithm": module.ALGORITHM, "args": {}, "env_id": "env",
            "depth": 2, "model": {"w": torch.full((100_000,), float(interval))}, "iteration": interval}


class DiskFull:
    """A file that takes the first half of a write and then fails as a full disk does."""

    def __init__(self, path):
        self.file = open(path, "wb")

    def write(self, data):
        self.file.write(bytes(data)[:len(data) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __getattr__(self, name):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.file.close()


def open_temp_files_with(make_file):
    """A stand-in for flexloop_run's open(): checkpoint temp files come from make_file, the rest as usual."""
    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith(".tmp") and "w" in mode:
            return make_file(path)
        return open(path, mode, *args, **kwargs)
    return fake_open


def crash_in_torch_save(monkeypatch, module):
    def save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 the first bytes of a checkpoint")
        raise RuntimeError("simulated crash while serialising")
    monkeypatch.setattr(torch, "save", save)
    return RuntimeError, "simulated crash"


def interrupt_before_rename(monkeypatch, module):
    def fsync(fd):
        raise KeyboardInterrupt  # a Ctrl-C (or any kill the process sees) after the bytes, before os.replace
    monkeypatch.setattr(os, "fsync", fsync)
    return KeyboardInterrupt, None


def rename_fails(monkeypatch, module):
    def replace_file(src, dst):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "replace", replace_file)
    return OSError, "previous checkpoint is intact"


def disk_full(monkeypatch, module):
    monkeypatch.setattr(flexloop_run, "open", open_temp_files_with(DiskFull), raising=False)
    return OSError, "No space left on device.*previous checkpoint is intact. Free disk space"


def real_full_device(monkeypatch, module):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    monkeypatch.setattr(flexloop_run, "open", open_temp_files_with(lambda path: open("/dev/full", "wb")),
                        raising=False)
    return OSError, "No space left on device.*Free disk space"


def unwritable_folder(monkeypatch, module):
    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
    monkeypatch.setattr(flexloop_run, "open", open_temp_files_with(refuse), raising=False)
    return OSError, "Permission denied.*point --run-dir at a writable folder"


@pytest.mark.parametrize("failure", [crash_in_torch_save, interrupt_before_rename, rename_fails, disk_full,
                                     real_full_device, unwritable_folder])
def test_a_failed_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch, failure):
    module = gcdqn  # every script saves through flexloop_run.save_checkpoint
    path = tmp_path / "latest.pt"
    flexloop_run.save_checkpoint(path, checkpoint_payload(module, 1))
    error, message = failure(monkeypatch, module)
    with pytest.raises(error, match=message):
        flexloop_run.save_checkpoint(path, checkpoint_payload(module, 2))
    monkeypatch.undo()
    previous = flexloop_run.load_checkpoint(path)
    assert previous["iteration"] == 1 and torch.equal(previous["model"]["w"], torch.ones(100_000))
    assert [p.name for p in tmp_path.iterdir()] == ["latest.pt"]  # no temp file left behind


def test_disk_full_mid_run_stops_with_a_clear_error_and_keeps_the_last_checkpoint(tmp_path, monkeypatch):
    writes = []

    def fills_up_at_the_fourth_write(path):
        writes.append(path)
        return DiskFull(path) if len(writes) >= 4 else open(path, "wb")

    monkeypatch.setattr(flexloop_run, "open", open_temp_files_with(fills_up_at_the_fourth_write), raising=False)
    # saves: latest.pt at intervals 1 and 2, pretrained.pt at 3, then latest.pt at 3 finds the disk full
    with pytest.raises(OSError, match="could not write checkpoint .*latest.pt.*Free disk space"):
        gcdqn.train(gcdqn.Args(**{**DQN, "intervals_per_epoch": 3, "save_every": 1}, run_dir=str(tmp_path)))
    run_dir = run_folder(tmp_path)
    assert flexloop_run.load_checkpoint(run_dir / "latest.pt")["iteration"] == 2
    assert flexloop_run.load_checkpoint(run_dir / "pretrained.pt")["iteration"] == 3
    assert not [p for p in run_dir.iterdir() if p.name.endswith(".tmp")]


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_unwritable_run_folder_fails_before_training(tmp_path, monkeypatch, data_dir, script):
    monkeypatch.setattr(os, "access", lambda *args, **kwargs: False)  # root ignores chmod
    with pytest.raises(PermissionError, match="not writable; point --run-dir at a writable folder"):
        SCRIPTS[script].train(script_args(script, tmp_path, data_dir))
    assert not list(run_folder(tmp_path).iterdir())


# ---------------------------------------------------------------------------------------------------------
# Hostile and broken checkpoints, through every loader
# ---------------------------------------------------------------------------------------------------------
LOADERS = {"gcdqn": flexloop_run.load_checkpoint, "gcppo": flexloop_run.load_checkpoint,
           "gciql": flexloop_run.load_checkpoint, "eval_adaptive": lambda path: flexloop_run.load_any_checkpoint(path)[1]}


class MakeFolder:
    """Unpickling this calls os.mkdir(path): the folder shows whether a loader ran the payload."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def algorithm_of(loader):
    return "gcdqn" if loader == "eval_adaptive" else loader


@pytest.mark.parametrize("loader", LOADERS)
def test_a_checkpoint_carrying_code_is_refused_without_running_it(tmp_path, loader):
    marker = tmp_path / "payload_ran"
    payload = checkpoint_payload(SCRIPTS[algorithm_of(loader)], 1)
    torch.save({**payload, "model": {"w": MakeFolder(marker)}}, tmp_path / "hostile.pt")
    torch.load(tmp_path / "hostile.pt", weights_only=False)  # the payload is live: an unsafe load runs it
    assert marker.is_dir()
    marker.rmdir()
    with pytest.raises(ValueError, match="because it can run code when loaded"):
        LOADERS[loader](tmp_path / "hostile.pt")
    assert not marker.exists()


@pytest.mark.parametrize("loader", ["gcppo", "gciql", "eval_adaptive"])
def test_a_truncated_checkpoint_is_refused(tmp_path, loader):
    module = SCRIPTS[algorithm_of(loader)]
    flexloop_run.save_checkpoint(tmp_path / "whole.pt", checkpoint_payload(module, 1))
    data = (tmp_path / "whole.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        LOADERS[loader](tmp_path / "cut.pt")


@pytest.mark.parametrize("loader", ["gcppo", "gciql"])
def test_a_plain_state_dict_is_not_a_checkpoint(tmp_path, loader):
    torch.save(torch.nn.Linear(2, 2).state_dict(), tmp_path / "weights.pt")
    with pytest.raises(ValueError, match="not a FlexLoop checkpoint"):
        LOADERS[loader](tmp_path / "weights.pt")


@pytest.mark.parametrize("loader", LOADERS)
def test_a_checkpoint_missing_a_key_is_refused(tmp_path, loader):
    payload = checkpoint_payload(SCRIPTS[algorithm_of(loader)], 1)
    del payload["model"]
    torch.save(payload, tmp_path / "no_model.pt")
    with pytest.raises(ValueError, match=r"lacks \['model'\]"):
        LOADERS[loader](tmp_path / "no_model.pt")


@pytest.mark.parametrize("script", SCRIPTS)
def test_resuming_from_a_weights_only_checkpoint_names_the_missing_state(tmp_path, script):
    module = SCRIPTS[script]
    flexloop_run.save_checkpoint(tmp_path / "shared.pt", checkpoint_payload(module, 1))  # model, no optimiser or RNG
    with pytest.raises(ValueError, match=r"lacks \[.*'optimizer', 'rng'.*\], which resuming needs.*--init-checkpoint"):
        module.train(module.Args(resume=str(tmp_path / "shared.pt"), run_dir=str(tmp_path / "runs")))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script, theirs, message", [
    ("gcdqn", dict(depth=4), "trained with depth=4 .* pass --depth 4"),
    ("gcdqn", dict(env_id="BoxPick-Exact-3-v0"), "trained on BoxPick-Exact-3-v0 .* pass --env-id BoxPick-Exact-3-v0"),
    ("gciql", dict(env_name="scene-play-v0"), "trained on scene-play-v0 .* pass --env-name scene-play-v0"),
    ("gciql", dict(env_name=PM, depth=3), "trained with depth=3 .* pass --depth 3"),
])
def test_a_pretrained_checkpoint_from_another_env_or_depth_is_refused(tmp_path, data_dir, script, theirs, message):
    module = SCRIPTS[script]
    their_args = replace(script_args(script, tmp_path, data_dir), **theirs)
    env_id = their_args.env_id if script == "gcdqn" else their_args.env_name
    flexloop_run.save_checkpoint(tmp_path / "pretrained.pt", {**checkpoint_payload(module, 1), "args": asdict(their_args),
                                                        "env_id": env_id, "depth": their_args.depth})
    with pytest.raises(ValueError, match=message):
        module.train(script_args(script, tmp_path / "runs", data_dir, init_checkpoint=str(tmp_path / "pretrained.pt")))
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------------------
# NaN/inf in a loss: stop, name the step and the term, keep the last good checkpoint
# ---------------------------------------------------------------------------------------------------------
def poison(monkeypatch, module, name, bad_calls, part=None):
    """Make module.<name> return NaN on the given calls (1-based); `part` picks one element of a tuple result."""
    real, calls = getattr(module, name), []

    def poisoned(*args, **kwargs):
        calls.append(1)
        result = real(*args, **kwargs)
        if len(calls) not in bad_calls:
            return result
        if part is None:
            return result * float("nan")
        return tuple(r * float("nan") if i == part else r for i, r in enumerate(result))

    monkeypatch.setattr(module, name, poisoned)


def assert_finite_checkpoint(module, path, counter, value):
    checkpoint = flexloop_run.load_checkpoint(path)
    assert checkpoint[counter] == value
    assert all(torch.isfinite(t).all() for t in checkpoint["model"].values())


@pytest.mark.parametrize("script, poisoned, part, bad_calls, overrides, message, counter, last_good", [
    # TD target NaN from update 7 on (interval 3 of 3 updates); logs every 2 intervals, saves every interval,
    # so interval 3's save has to check the losses itself
    ("gcdqn", "td_target", None, range(7, 100), dict(log_every=2, save_every=1),
     "losses/td_loss became nan in the updates before update 9", "iteration", 2),
    # value loss NaN in the last of iteration 3's 2 updates only: the other terms stay finite, so the message
    # must name the right one
    ("gcppo", "ppo_loss", 1, [6], dict(log_every=2, save_every=1),
     "losses/value_loss became nan in the updates before update 6", "iteration", 2),
    # the critic's target NaN at update 6 only; logs every 5 updates, saves every 3
    ("gciql", "critic_target", None, [6], dict(log_every=5, save_every=3),
     "losses/critic_loss became nan in the updates before update 6", "global_step", 3),
])
def test_nan_in_a_loss_stops_training_and_keeps_the_last_good_checkpoint(
        tmp_path, monkeypatch, data_dir, script, poisoned, part, bad_calls, overrides, message, counter, last_good):
    module = SCRIPTS[script]
    poison(monkeypatch, module, poisoned, bad_calls, part)
    with pytest.raises(FloatingPointError, match=message):
        module.train(script_args(script, tmp_path, data_dir, **overrides))
    run_dir = run_folder(tmp_path)
    assert_finite_checkpoint(module, run_dir / "latest.pt", counter, last_good)
    assert not (run_dir / "final.pt").exists()


# ---------------------------------------------------------------------------------------------------------
# Bad flags: a clear error before any work
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
@pytest.mark.parametrize("script", ["gcppo", "gciql", "eval_adaptive"])
def test_require_cuda_without_a_gpu(tmp_path, data_dir, script):
    with pytest.raises(RuntimeError, match="--require-cuda was given but no CUDA GPU is visible"):
        if script == "eval_adaptive":
            ea.main(ea.Args(checkpoints=("a.pt",), require_cuda=True, out_dir=str(tmp_path / "out")))
        else:
            SCRIPTS[script].train(script_args(script, tmp_path / "runs", data_dir, require_cuda=True))
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("future_discount", [0.0, 1.0])
def test_gcdqn_future_discount_outside_0_1_is_refused(tmp_path, future_discount):
    with pytest.raises(ValueError, match="--future-discount must lie in"):
        gcdqn.train(gcdqn.Args(**DQN, future_discount=future_discount, run_dir=str(tmp_path)))
    assert not list(tmp_path.iterdir())


def test_a_resumed_run_projects_its_time_only_after_two_iterations_of_its_own():
    """The projected run time waits for two iterations (or 15 s) counted from where this process started. A run
    resumed at iteration 100 of 200 once projected from its first two updates: "16 s for the whole run" for a run
    that took 11 minutes more."""
    import io

    from tqdm import tqdm
    run = object.__new__(flexloop_run.Run)
    run.progress = tqdm(total=200_000, initial=100_000, file=io.StringIO())
    run.iteration = run.first_iteration = 100
    run.first_tick, run.projected, run.started = None, False, time.perf_counter()
    run.device = torch.device("cpu")
    for _ in range(3):
        run.tick(1)
    assert not run.projected
    run.iteration = 102
    run.tick(1)
    assert run.projected


def test_a_gpu_run_projects_its_time_from_30_seconds_not_from_its_first_updates(capsys):
    """GC-IQL's iteration is one update, and the host queues a GPU's first updates far faster than the GPU runs
    them: a pointmaze run projected "2.7 min for the whole run" from its first two, at 8,290 updates/s, and then
    ran at 300 (about 55 minutes). On a GPU the projection waits for 30 s of the run's own pace."""
    import io

    from tqdm import tqdm
    run = object.__new__(flexloop_run.Run)
    run.progress = tqdm(total=1_000_000, initial=0, unit=" updates", file=io.StringIO())
    run.iteration = run.first_iteration = 0
    run.first_tick, run.projected, run.started = None, False, time.perf_counter()
    run.device = torch.device("cuda")
    for _ in range(1_000):
        run.iteration += 1
        run.tick(1)
    assert not run.projected
    capsys.readouterr()
    run.first_tick = (run.first_tick[0] - 30, run.first_tick[1])  # as if the last 999 updates took 30 s
    run.tick(1)
    assert run.projected
    rate = float(re.search(r"\(([0-9.e+]+) updates/s on cuda\)", capsys.readouterr().out).group(1))
    assert rate == pytest.approx(1_000 / 30, rel=0.01)


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_resumed_run_takes_the_machine_flags_from_the_command_line(script):
    """A run started with --require-cuda on a GPU machine must resume on a CPU without it: the machine flags
    describe where a run goes on, not the run (the others, e.g. --save-every-minutes, stay the run's own)."""
    module = SCRIPTS[script]
    checkpoint = {"args": {"require_cuda": True, "cuda": False, "save_every_minutes": 2.0}, "run_name": "r",
                  "rng": {}, "global_step": 1, "updates": 1, **{part: {} for part in module.CHECKPOINT_PARTS}}
    args = flexloop_run.resumed_args(module, checkpoint, module.Args(resume="latest.pt"))
    assert (args.require_cuda, args.cuda, args.save_every_minutes) == (False, True, 2.0)


def test_a_resumed_gciql_run_takes_cuda_streams_and_its_evaluation_flags_from_the_command_line():
    """--cuda-streams changes GC-IQL's speed, not its arithmetic, so a run started on one stream may go on with
    three; the flags that change learning stay the run's own."""
    module = SCRIPTS["gciql"]
    checkpoint = {"args": {"cuda_streams": False, "bf16": True, "batch_size": 256}, "run_name": "r", "rng": {},
                  "global_step": 1, "updates": 1, **{part: {} for part in module.CHECKPOINT_PARTS}}
    given = module.Args(resume="latest.pt", bf16=False, batch_size=1024)  # --cuda-streams left at its default
    args = flexloop_run.resumed_args(module, checkpoint, given)
    assert (args.cuda_streams, args.bf16, args.batch_size) == (True, True, 256)
    checkpoint["args"]["cuda_streams"] = True
    given = module.Args(resume="latest.pt", cuda_streams=False)
    assert flexloop_run.resumed_args(module, checkpoint, given).cuda_streams is False
    # evaluation is not training: how often and on how many episodes may change too, where given
    checkpoint["args"].update(eval_every=100_000, eval_episodes=50, eval_envs=50)
    given = module.Args(resume="latest.pt", eval_every=250_000)
    args = flexloop_run.resumed_args(module, checkpoint, given)
    assert (args.eval_every, args.eval_episodes, args.eval_envs) == (250_000, 50, 50)
    given = module.Args(resume="latest.pt", eval_envs=1250)  # the same episodes, more of them side by side
    assert flexloop_run.resumed_args(module, checkpoint, given).eval_envs == 1250


def test_random_streams_saved_on_another_kind_of_device_restart_from_a_seed(capsys):
    """A CUDA generator's state (16 bytes) does not fit a CPU generator: the stream restarts from a seed taken from
    the saved state, the same one every time, and the run says so. A state of the same kind is restored exactly."""
    same, other = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    saved = flexloop_run.rng_state({"same": same})
    saved["other"] = torch.arange(16, dtype=torch.uint8)  # what a CUDA generator's get_state() returns
    expected_same = torch.rand(3, generator=same)
    flexloop_run.set_rng_state(saved, {"same": same, "other": other})
    assert torch.equal(torch.rand(3, generator=same), expected_same)
    first = torch.rand(3, generator=other)
    flexloop_run.set_rng_state(saved, {"same": same, "other": other})
    assert torch.equal(torch.rand(3, generator=other), first)
    assert "['other'] were saved on another kind of device" in capsys.readouterr().out


def test_an_optimiser_state_from_a_gpu_run_loads_with_this_devices_settings():
    """Adam's capturable flag (on for CUDA graphs) saved by a GPU run must not follow the state onto a CPU, where
    a capturable Adam refuses to step."""
    weight = torch.nn.Parameter(torch.ones(3))
    on_gpu = torch.optim.Adam([weight], capturable=False)
    weight.grad = torch.ones(3)
    on_gpu.step()
    saved = on_gpu.state_dict()
    saved["param_groups"][0]["capturable"] = True  # as a GPU run writes it
    here = torch.optim.Adam([weight], capturable=False)
    here.load_state_dict(flexloop_run.on_this_device(saved, here))
    here.step()
    assert here.param_groups[0]["capturable"] is False and here.state[weight]["step"].item() == 2
    assert flexloop_run.on_this_device({"w": 1}, torch.nn.Linear(1, 1)) == {"w": 1}  # any other part: as it is


@pytest.mark.parametrize("script", SCRIPTS)
def test_an_init_checkpoint_from_before_a_network_flag_is_read_as_its_run_had_it(script):
    """A checkpoint written before --backbone existed holds an IRU: --init-checkpoint accepts it for an IRU run and
    still names a real mismatch (its depth)."""
    module = SCRIPTS[script]
    theirs = asdict(module.Args())
    del theirs["backbone"]
    init = {"args": theirs, "env_id": getattr(module.Args(), module.ENV_FLAG)}
    flexloop_run.check_compatible(module, init, module.Args())
    with pytest.raises(ValueError, match="trained with depth=5 but this run has depth=4; pass --depth 5"):
        flexloop_run.check_compatible(module, init, module.Args(depth=4))
