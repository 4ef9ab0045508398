"""flexloop_run.py as a new user meets it: a stop acts within seconds even mid-collection, a run whose stdout has
gone (`| tee log` and Ctrl-C) still saves, a finished run says where final.pt is and how to evaluate it, TensorBoard
events sit beside metrics.jsonl, and the errors name the problem (W&B's offline runs: test_reliability.py)."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import pytest
import torch

import envs
import flexloop_gcdqn as gcdqn
import flexloop_gcppo as gcppo
import flexloop_run
from conftest import PYTHONPATH, TINY_DQN, flags

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, "COLUMNS": "400"}
ENV.pop("FLEXLOOP_DEBUG", None)


def start(values, tmp_path, stdout):
    command = [sys.executable, str(ROOT / "flexloop_gcdqn.py"), *flags(values), "--run-dir", str(tmp_path / "runs")]
    return subprocess.Popen(command, cwd=tmp_path, env=ENV, stdout=stdout, stderr=subprocess.PIPE, text=True)


def wait_for(condition, process, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert time.time() < deadline, "timed out"
        time.sleep(0.05)


# ---------------------------------------------------------------------------------------------------------
# Stopping: within seconds, and never lost to a closed stdout
# ---------------------------------------------------------------------------------------------------------
def test_ctrl_c_during_a_long_cpu_collection_stops_within_seconds_and_saves(tmp_path):
    """One training episode of 100,000 steps takes minutes on a CPU; Ctrl-C inside it must not wait for its end."""
    values = {**TINY_DQN, "episode_length": 100_000, "replay_episodes": 1, "save_every_minutes": 0}
    process = start(values, tmp_path, subprocess.DEVNULL)
    try:
        wait_for(lambda: list((tmp_path / "runs").glob("*/metrics.jsonl")), process)  # begin() ran: collecting
        time.sleep(1.0)
        process.send_signal(signal.SIGINT)
        stopped = time.time()
        assert process.wait(timeout=60) == 0, process.stderr.read()[-3000:]
        assert time.time() - stopped < 10
    finally:
        process.kill()
    assert "Ctrl-C: saved" in process.stderr.read()
    (latest,) = (tmp_path / "runs").glob("*/latest.pt")
    checkpoint = flexloop_run.load_checkpoint(latest, "gcdqn")
    assert (checkpoint["iteration"], checkpoint["updates"]) == (0, 0)  # resuming redoes the dropped collection


def test_ctrl_c_saves_when_stdout_has_gone_as_with_tee(tmp_path):
    """`python flexloop_gcdqn.py ... | tee log`: Ctrl-C ends tee first, so every later print to stdout fails with
    a broken pipe. The run must still stop cleanly and write latest.pt."""
    values = {**TINY_DQN, "updates_per_rollout": 50, "intervals_per_epoch": 1000, "eval_every": 1,
              "save_every": 1000, "save_every_minutes": 0}
    process = start(values, tmp_path, subprocess.PIPE)
    try:
        assert "running on the CPU" in process.stdout.readline()
        assert "iteration 1 success" in process.stdout.readline()  # an evaluation printed: the loop is running
        process.stdout.close()  # what tee's end does to the pipe
        time.sleep(1.0)  # more evaluations print into the closed pipe meanwhile
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0, process.stderr.read()[-3000:]
    finally:
        process.kill()
    errors = process.stderr.read()
    assert "Ctrl-C: saved" in errors and "Broken pipe" not in errors and "Traceback" not in errors
    assert list((tmp_path / "runs").glob("*/latest.pt"))


# ---------------------------------------------------------------------------------------------------------
# A finished run: where final.pt is, the command that evaluates it, TensorBoard events
# ---------------------------------------------------------------------------------------------------------
def test_a_finished_run_prints_final_pt_and_the_evaluation_command_and_writes_tensorboard_events(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = gcdqn.train(gcdqn.Args(**TINY_DQN, run_dir=str(tmp_path / "runs")))
    out = capsys.readouterr().out
    assert f"finished: {run_dir / 'final.pt'}" in out
    command = shlex.split(re.search(r"evaluate it .*:\n\s+python (.+)", out).group(1))
    assert Path(command[0]).resolve() == ROOT / "eval_adaptive.py" and command[1] == "--checkpoints"
    assert [Path(p) for p in command[2:]] == [run_dir / "pretrained.pt", run_dir / "final.pt"]

    (events,) = run_dir.glob("events.out.tfevents.*")  # TensorBoard's, beside metrics.jsonl
    accumulator = EventAccumulator(str(events)).Reload()
    scalars = accumulator.Tags()["scalars"]
    assert {"losses/td_loss", "losses/depth_kl", "charts/SPS", "eval/unseen/success_depth_5"} <= set(scalars)
    events = accumulator.Scalars("losses/td_loss")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [record for record in records if "losses/td_loss" in record]
    assert [event.step for event in events] == [record["global_step"] for record in logged]
    assert [event.value for event in events] == pytest.approx([record["losses/td_loss"] for record in logged])


# ---------------------------------------------------------------------------------------------------------
# Slim checkpoints: the network alone, to share or commit
# ---------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One finished tiny GC-DQN run that the slim tests read (and never change)."""
    return gcdqn.train(gcdqn.Args(**TINY_DQN, run_dir=str(tmp_path_factory.mktemp("slim") / "runs")))


def test_a_slim_checkpoint_acts_as_the_full_one_and_keeps_what_evaluation_needs(finished_run, tmp_path):
    run_dir = finished_run
    full_path, slim_path = run_dir / "final.pt", tmp_path / "shared" / "final.pt"
    full_bytes = full_path.read_bytes()

    left_out = flexloop_run.slim_checkpoint(full_path, slim_path)

    assert sorted(left_out) == ["optimizer", "target_model"]  # and pretrained_model, None outside Distill Only
    assert full_path.read_bytes() == full_bytes  # the full checkpoint is untouched
    full, slim = flexloop_run.load_checkpoint(full_path), flexloop_run.load_checkpoint(slim_path, "gcdqn")
    assert full["pretrained_model"] is None and full["unfinished_evaluation"] is None
    assert set(full) - set(slim) == {"optimizer", "target_model", "pretrained_model", "unfinished_evaluation"}
    for key in ("args", "rng", "updates", "global_step", "metrics", "run_name"):
        assert repr(slim[key]) == repr(full[key]), key
    obs_goal = torch.randint(0, 12, (2, 5, 36)).float()
    q = [gcdqn.network_from_checkpoint(c)[0].all_depths(*obs_goal) for c in (full, slim)]
    assert torch.equal(q[0], q[1])
    assert slim_path.stat().st_size < full_path.stat().st_size / 2


def test_slimming_refuses_to_overwrite_and_resuming_a_slim_checkpoint_names_the_fix(finished_run, tmp_path):
    run_dir = finished_run
    final = run_dir / "final.pt"
    full_bytes = final.read_bytes()
    with pytest.raises(ValueError, match="is the checkpoint being slimmed; write the slim copy to another path"):
        flexloop_run.slim_checkpoint(final, final)
    with pytest.raises(FileExistsError, match="exists; remove it or choose another path"):
        flexloop_run.slim_checkpoint(final, run_dir / "pretrained.pt")
    assert final.read_bytes() == full_bytes

    slim = tmp_path / "slim.pt"
    flexloop_run.slim_checkpoint(final, slim)
    with pytest.raises(ValueError, match=r"lacks \['target_model', 'optimizer'\].*--init-checkpoint instead"):
        gcdqn.train(gcdqn.Args(**TINY_DQN, run_dir=str(tmp_path / "runs"), resume=str(slim)))


def test_the_slim_command_line_writes_the_copy_or_fails_in_one_line(finished_run, tmp_path):
    run_dir = finished_run
    command = [sys.executable, str(ROOT / "flexloop_run.py"), "slim", str(run_dir / "final.pt")]
    done = subprocess.run([*command, str(tmp_path / "slim.pt")], env=ENV, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "left out: target_model, optimizer\n" in done.stdout
    assert "model" in flexloop_run.load_checkpoint(tmp_path / "slim.pt")

    again = subprocess.run([*command, str(tmp_path / "slim.pt")], env=ENV, capture_output=True, text=True)
    assert again.returncode == 1
    assert again.stderr.strip().splitlines() == [
        f"flexloop_run.py: error: {tmp_path / 'slim.pt'} exists; remove it or choose another path  (--debug shows "
        "the traceback)"]


# ---------------------------------------------------------------------------------------------------------
# Clear messages
# ---------------------------------------------------------------------------------------------------------
def test_eval_adaptive_help_shows_its_flags_in_groups():
    out = subprocess.run([sys.executable, "eval_adaptive.py", "--help"], cwd=ROOT, env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for group, flag in [("experiment", "--checkpoints"), ("evaluation", "--eps"), ("stress", "--stress-envs")]:
        section = out.stdout.split(f"{group} options")[1].split("╰")[0]
        assert flag in section, group
    assert "`divergence` method" in out.stdout  # a copy that changes its loss learns what the stopping rule reads


@pytest.mark.parametrize("env_id", [envs.LIGHTSOUT_ID, "BoxPick-Exact-4-v0"])
def test_gym_make_on_a_vector_only_id_names_make_vec(env_id):
    with pytest.raises(ValueError, match=rf"{env_id} is a batched vector env only.*gym.make_vec\('{env_id}'"):
        gym.make(env_id)
    assert gym.make_vec(env_id, num_envs=2, device="cpu").num_envs == 2


@pytest.mark.parametrize("text", ["notes: run 3 looked good\n", "Notizen über den Lauf — 95 % Erfolg\n",
                                  "coverage: 95%\n"])  # "c" starts a pickle's GLOBAL opcode
def test_a_text_file_given_as_a_checkpoint_is_called_a_text_file(tmp_path, text):
    (tmp_path / "notes.pt").write_text(text)
    with pytest.raises(ValueError, match="is a text file, not a FlexLoop checkpoint"):
        flexloop_run.read_checkpoint_file(tmp_path / "notes.pt")


def test_gcppo_says_what_it_trains_on_and_what_it_evaluates():
    """A run on 1-press goals reports success on the whole train split (1-9 presses): its printout says both."""
    args = gcppo.Args(train_max_presses=1)
    results = {f"eval/{split}/success_depth_{k}": 0.5 for split in ("train", "unseen") for k in range(1, 6)}
    text = gcppo.format_eval(results, args, 3)
    assert "training tasks: at most 1 press" in text
    assert "train (1-9 presses)" in text and "unseen (10-19 presses)" in text


def test_a_stop_keeps_a_background_evaluation_that_it_broke_and_no_stop_raises_its_error():
    """SIGTERM to a run's process group also ends its evaluation's env workers, so the evaluation thread fails with
    them. Seen on a GPU: that error, raised after the stop, lost the latest.pt the stop was writing. The broken
    evaluation stays unlogged and pending, for latest.pt to hold its weights; one that had finished before the stop
    is still logged."""
    def ended_evaluation(outcome):
        thread = threading.Thread(target=lambda: None)
        thread.start()
        thread.join()
        return (thread, outcome, {"charts/evaluated_step": 7}, 7, torch.nn.Linear(1, 1))

    failed = {"error": RuntimeError("an OGBench evaluation worker failed")}
    logged = []
    stopped = SimpleNamespace(background=ended_evaluation(failed), stop=SimpleNamespace(reason="SIGTERM"),
                              record_evaluation=lambda results, iteration: logged.append(results))
    flexloop_run.Run.log_background_evaluation(stopped)
    assert stopped.background is not None and logged == []
    stopped.background = ended_evaluation({"results": {"eval/success_depth_1": 0.5}})
    flexloop_run.Run.log_background_evaluation(stopped)
    assert logged == [{"charts/evaluated_step": 7, "eval/success_depth_1": 0.5}]
    running = SimpleNamespace(background=ended_evaluation(failed), stop=SimpleNamespace(reason=None))
    with pytest.raises(RuntimeError, match="evaluation worker failed"):
        flexloop_run.Run.log_background_evaluation(running)
