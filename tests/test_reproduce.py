"""reproduce.py: studies run to completion across interruptions (locally and through submitit's local executor),
finished studies only print their tables, and bad input gets a one-line error.

The end-to-end tests run tiny versions of real studies: studies.py's own builders (boxpick_main, ogbench) with a
tiny Budget, read by reproduce.py from a studies file of the test's, as a user's own grid would be."""

import dataclasses
import fcntl
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # studies.py beside reproduce.py, wherever pytest starts
import studies  # noqa: E402
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}

TINY_SIZE = ("--num-envs", "16", "--batch-size", "16", "--updates-per-rollout", "3", "--intervals-per-epoch", "2",
             "--depth", "3", "--hidden-dim", "16", "--eval-every", "100", "--num-eval-envs", "8", "--log-every", "1",
             "--save-every", "1", "--episode-length", "10", "--replay-episodes", "4")
TINY_STUDIES = '''
import studies

SIZE = TINY_SIZE
BOXPICK = studies.Budget(pretrain=(*SIZE, "--pretrain-epochs", "PRETRAIN_EPOCHS"), post=(*SIZE, "--num-epochs", "2"),
                         eval=("--num-eval-envs", "8", "--eps", "0", "0.1", "--trace-frames", "2"))
OG_SIZE = ("--depth", "2", "--hidden-dim", "16", "--batch-size", "32", "--log-every", "2", "--save-every", "2",
           "--eval-episodes", "0", "--eval-envs", "1", "--no-eval-async")  # eval_adaptive.py takes the last two
OGBENCH = studies.Budget(pretrain=(*OG_SIZE, "--pretrain-steps", "200"), post=(*OG_SIZE, "--total-steps", "6"),
                         eval=("--num-eval-envs", "1", "--eps", "0", "0.1"),
                         data=("--episodes", "8", "--episode-steps", "60", "--workers", "1", "--no-progress"))
STUDIES = {study.name: study for study in [studies.boxpick_main("exact4", BOXPICK, name="tiny-boxpick"),
                                           studies.ogbench("ogbench-pointmaze-large", OGBENCH)]}
'''.replace("TINY_SIZE", repr(TINY_SIZE))


def reproduce(*args, env=ENV, timeout=1800):
    return subprocess.run([sys.executable, "reproduce.py", *map(str, args)], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("reproduce.py: error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@dataclasses.dataclass
class Tiny:
    flags: list  # reproduce.py's flags that run the tiny studies on the CPU, in runs and data
    runs: Path
    data: Path


@pytest.fixture
def tiny(tmp_path):
    """A studies file with the tiny studies, and where they run."""
    path = tmp_path / "tiny_studies.py"
    path.write_text(TINY_STUDIES.replace("PRETRAIN_EPOCHS", "12"))
    runs, data = tmp_path / "runs", tmp_path / "data"
    return Tiny(["--studies-file", path, "--runs-dir", runs, "--data-dir", data, "--no-cuda", "--workers", "2",
                 "--seeds", "1"], runs, data)


# ----------------------------------------------------------------------------------------------- the studies


def test_list_names_a_study_per_results_family():
    result = reproduce("--list")
    assert result.returncode == 0, result.stderr
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert names == list(studies.STUDIES)
    for name in ["boxpick-exact4", "boxpick-exact3", "boxpick-generalize41", "boxpick-generalize42", "lightsout",
                 "ogbench-scene", "ogbench-cube-double", "ogbench-puzzle-4x4", "ogbench-antmaze-medium",
                 "ogbench-pointmaze-large", "ablation-components", "ablation-lambda", "ablation-depth-target",
                 "ablation-lstm", "depth-k4", "depth-k8", "depth-k10", "ablation-from-scratch"]:
        assert name in names


def test_every_flag_of_every_study_is_a_flag_of_its_script():
    """A renamed flag would fail hours into a study; here it fails at once."""
    import eval_adaptive
    import flexloop_gcdqn
    import flexloop_gciql
    import flexloop_gcppo
    scripts = {"flexloop_gcdqn.py": flexloop_gcdqn, "flexloop_gcppo.py": flexloop_gcppo,
               "flexloop_gciql.py": flexloop_gciql, "eval_adaptive.py": eval_adaptive}
    pretrain = {"gcdqn": flexloop_gcdqn, "gcppo": flexloop_gcppo, "gciql": flexloop_gciql}
    for study in studies.STUDIES.values():
        for run in study.runs:
            if run.kind == "data":
                continue
            script, *flags = run.command
            module = pretrain[flags.pop(0)] if script == "iru_pretrain.py" else scripts[script]
            known = set()
            for field in dataclasses.fields(module.Args):
                name = field.name.replace("_", "-")
                known |= {f"--{name}", f"--no-{name}"}
            unknown = [flag for flag in flags if flag.startswith("--") and flag not in known]
            assert not unknown, f"{study.name}/{run.name}: {unknown} are not flags of {script}"


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path):
    result = reproduce("boxpick-exact4", "--dry-run", "--no-cuda", "--seeds", "2", "--runs-dir", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    runs = tmp_path / "runs" / "boxpick-exact4"
    assert (f"python iru_pretrain.py gcdqn --env-id BoxPick-Exact-4-v0 --pretrain-epochs 50 --no-cuda --run-dir "
            f"{runs}/pretrain/seed2 --seed 2 --exp-name boxpick-exact4-pretrain") in out
    assert (f"--num-epochs 10 --init-checkpoint '{runs}/pretrain/seed2/*/final.pt' --lambda-depth 1 --no-cuda "
            f"--run-dir {runs}/flexloop/seed2") in out
    assert f"--init-checkpoint '{runs}/pretrain/seed2/*/final.pt' --lambda-depth 0" in out
    assert "--labels IRU-5 FlexLoop Self-TD-Only --num-eval-envs 1024 --no-cuda" in out
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_the_gpu_commands_on_any_machine(tmp_path):
    # planning a GPU study from a laptop: without --no-cuda the commands are the GPU machine's, GPU or not here
    result = reproduce("lightsout", "--dry-run", "--seeds", "1", "--runs-dir", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    commands = [line for line in result.stdout.splitlines() if line.startswith("python ")]
    assert commands and all("--require-cuda" in line and "--no-cuda" not in line for line in commands)
    assert not (tmp_path / "runs").exists()


def test_ablations_share_the_main_studys_pretraining(tmp_path):
    result = reproduce("boxpick-exact4", "ablation-lambda", "--dry-run", "--no-cuda", "--seeds", "1",
                       "--runs-dir", tmp_path)
    assert result.returncode == 0, result.stderr
    headers = [line for line in result.stdout.splitlines() if line.startswith("# ")]
    assert sum(line.startswith("# boxpick-exact4/pretrain seed 1") for line in headers) == 1  # one run, not two
    assert any(line.startswith("# ablation-lambda/lambda-0.1 seed 1 (after boxpick-exact4/pretrain seed 1)")
               for line in headers)


def test_ogbench_runs_its_control_for_seed_1_alone(tmp_path):
    """The OGBench control (lambda 0) is one seed's check, evaluated apart from the seeds' IRU-5 and FlexLoop."""
    result = reproduce("ogbench-scene", "--dry-run", "--no-cuda", "--runs-dir", tmp_path / "runs")
    assert result.returncode == 0, result.stderr
    headers = [line.split(" (")[0] for line in result.stdout.splitlines() if line.startswith("# ")]
    assert [h for h in headers if "control" in h] == ["# ogbench-scene/control seed 1",
                                                      "# ogbench-scene/eval-control seed 1"]
    assert [h for h in headers if h.startswith("# ogbench-scene/eval ")] == [
        f"# ogbench-scene/eval seed {seed}" for seed in (1, 2, 3)]
    assert "--labels IRU-5 FlexLoop --" in result.stdout and "--labels Self-TD-Only --" in result.stdout
    seed_2 = reproduce("ogbench-scene", "--dry-run", "--no-cuda", "--seeds", "2", "--runs-dir", tmp_path / "runs")
    assert not [line for line in seed_2.stdout.splitlines() if line.startswith("# ") and "control" in line]


# ------------------------------------------------------------------------------------------------- bad input


def test_unknown_study():
    one_line_error(reproduce("boxpick-exact5", "--no-cuda"), "unknown study 'boxpick-exact5'", "boxpick-exact4",
                   "--list")


@pytest.mark.parametrize("seeds", [["-1"], ["1", "1"]])
def test_seeds_that_do_not_exist(seeds):
    one_line_error(reproduce("boxpick-exact4", "--no-cuda", "--seeds", *seeds), "--seeds")


def test_a_run_that_needs_a_run_of_fewer_seeds(tmp_path):
    path = tmp_path / "my_studies.py"
    path.write_text("import studies\n"
                    "STUDIES = {'mine': studies.Study('mine', 'a run of seed 1 alone, read by every seed', (\n"
                    "    studies.train('a', 'flexloop_gcdqn.py', seeds=(1,)),\n"
                    "    studies.evaluate('eval', {'A': '{a}/final.pt'})))}\n")
    one_line_error(reproduce("mine", "--studies-file", path, "--no-cuda", "--dry-run", "--seeds", "1", "2"),
                   "mine's run eval uses {a}, which does not run for seed 2", "give eval the seeds of a")


def test_gpus_that_do_not_exist(tmp_path):
    one_line_error(reproduce("boxpick-exact4", "--gpus", "0", env={**ENV, "PATH": str(tmp_path)}), "no GPU found",
                   "--no-cuda")
    fake = tmp_path / "nvidia-smi"  # a machine with one GPU, 0
    fake.write_text("#!/bin/sh\necho 0\n")
    fake.chmod(0o755)
    path = f"{tmp_path}:{os.environ['PATH']}"
    one_line_error(reproduce("boxpick-exact4", "--gpus", "0", "3", "--dry-run", env={**ENV, "PATH": path}),
                   "GPU 3 does not exist", "has GPU 0")
    result = reproduce("boxpick-exact4", "--gpus", "0", "--per-gpu", "2", "--dry-run", "--runs-dir", tmp_path / "r",
                       env={**ENV, "PATH": path})
    assert result.returncode == 0 and "--require-cuda" in result.stdout, result.stderr


def test_a_folder_that_holds_another_studys_run(tmp_path):
    folder = tmp_path / "boxpick-exact4" / "pretrain" / "seed1"
    folder.mkdir(parents=True)
    (folder / "reproduce.json").write_text(json.dumps({"study": "boxpick-exact3", "run": "pretrain", "seed": 1,
                                                       "command": []}))
    one_line_error(reproduce("boxpick-exact4", "--no-cuda", "--seeds", "1", "--runs-dir", tmp_path),
                   f"{folder} holds run pretrain seed 1 of study boxpick-exact3")
    (folder / "reproduce.json").write_text(json.dumps({"study": "boxpick-exact4", "run": "pretrain", "seed": 1,
                                                       "command": ["iru_pretrain.py", "gcdqn", "--depth", "4"]}))
    one_line_error(reproduce("boxpick-exact4", "--no-cuda", "--seeds", "1", "--runs-dir", tmp_path),
                   "started with other flags")
    (folder / "reproduce.json").unlink()
    (folder / "BoxPick-Exact-4-v0__mine__1__1").mkdir()
    one_line_error(reproduce("boxpick-exact4", "--no-cuda", "--seeds", "1", "--runs-dir", tmp_path),
                   "did not write")


def test_slurm_without_submitit_or_sbatch(tmp_path):
    hidden = tmp_path / "no_submitit" / "submitit"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('submitit is not installed')\n")
    env = {**ENV, "PYTHONPATH": f"{hidden.parent}:{ENV.get('PYTHONPATH', '')}"}
    one_line_error(reproduce("boxpick-exact4", "--slurm", "--runs-dir", tmp_path / "r", env=env),
                   "pip install 'submitit>=1.5'")
    pytest.importorskip("submitit")
    one_line_error(reproduce("boxpick-exact4", "--slurm", "--runs-dir", tmp_path / "r",
                             env={**ENV, "PATH": os.path.dirname(sys.executable)}), "no sbatch")


STAND_IN_STUDIES = '''
from studies import Run, Study

def make(name, code, *needs):
    """A run of the data kind (done when its file is in --data-dir), with a stand-in command instead of a script."""
    return Run(name, "data", ("-c", code, *(f"{{{need}}}" for need in needs)), per_seed=False, creates=(name,))

def touch(name):
    return f"import os, pathlib; pathlib.Path(os.environ['DATA'], '{name}').touch()"

def record_gpu(name):
    return (f"import os, pathlib, time; time.sleep(2); "
            f"pathlib.Path(os.environ['DATA'], '{name}').write_text(os.environ['CUDA_VISIBLE_DEVICES'])")

STUDIES = {"failing": Study("failing", "a run that fails, one that needs it, and two that do not", (
    make("good", touch("good")),
    make("bad", "raise SystemExit('bad: the dataset is broken')"),
    make("after-bad", touch("after-bad"), "bad"),
    make("after-good", touch("after-good"), "good"),
)), "one": Study("one", "one run", (make("one", touch("one")),)),
    "gpus": Study("gpus", "four runs at once", tuple(make(name, record_gpu(name)) for name in "abcd"))}
'''


def stand_in(tmp_path, study, *flags, env=ENV):
    """Run a study of stand-in runs, which need no torch."""
    (tmp_path / "stand_in.py").write_text(STAND_IN_STUDIES)
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return reproduce(study, "--studies-file", tmp_path / "stand_in.py", "--runs-dir", tmp_path / "runs",
                     "--data-dir", data, *(flags or ("--no-cuda", "--workers", "2")), env={**env, "DATA": str(data)})


def test_a_failed_run_is_reported_its_dependents_skipped_and_the_others_go_on(tmp_path):
    result = stand_in(tmp_path, "failing")
    assert result.returncode == 1
    final = result.stdout.split("\n\n")[-1]
    assert re.search(r"failing/bad +failed +exit status 1: bad: the dataset is broken", final), result.stdout
    assert re.search(r"failing/after-bad +skipped +needs failing/bad\n", final)
    assert re.search(r"failing/after-good +done", final)
    assert sorted(path.name for path in (tmp_path / "data").iterdir()) == ["after-good", "good"]
    assert "failing/bad: failed; failing/after-bad: skipped" in result.stderr


def test_runs_spread_over_the_gpus_several_per_gpu(tmp_path):
    fake = tmp_path / "bin" / "nvidia-smi"  # a machine with GPUs 0, 1 and 2
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nprintf '0\\n1\\n2\\n'\n")
    fake.chmod(0o755)
    result = stand_in(tmp_path, "gpus", "--gpus", "0", "2", "--per-gpu", "2",
                      env={**ENV, "PATH": f"{fake.parent}:{os.environ['PATH']}"})
    assert result.returncode == 0, result.stdout + result.stderr
    used = sorted((tmp_path / "data" / name).read_text() for name in "abcd")
    assert used == ["0", "0", "2", "2"]  # each run sees its GPU alone, two runs on each
    assert re.search(r"4 running\n(.*running +gpu [02].*\n){4}", result.stdout), result.stdout


def test_a_run_that_an_earlier_invocation_left_going_is_not_started_twice(tmp_path):
    assert stand_in(tmp_path, "one").returncode == 0
    (tmp_path / "data" / "one").unlink()  # as if it had not finished
    lock = os.open(tmp_path / "runs" / "one" / "one" / ".lock", os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # held, as the earlier run's script holds it
    result = stand_in(tmp_path, "one")
    assert result.returncode == 1
    assert re.search(r"one/one +failed +.* is being run by another process", result.stdout), result.stdout
    os.close(lock)
    assert stand_in(tmp_path, "one").returncode == 0


# ------------------------------------------------------------------------------------------------ end to end


def artifacts(runs):
    """What a finished tiny study leaves, with the run folders' start times left out."""
    found = set()
    for path in runs.rglob("*"):
        if path.name in ("final.pt", "results.json", "reproduce.json") or path.name.endswith(".table.md"):
            parts = [part.rsplit("__", 1)[0] if "__" in part else part for part in path.relative_to(runs).parts]
            found.add("/".join(parts))
    return sorted(found)


def start_and_interrupt(args, run_folder, sig):
    """Start reproduce.py, and once the run in run_folder has written latest.pt (halfway), send it `sig`."""
    driver = subprocess.Popen([sys.executable, "reproduce.py", *map(str, args)], cwd=REPO, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while not list(run_folder.glob("*/latest.pt")) and time.monotonic() < deadline and driver.poll() is None:
        time.sleep(0.1)
    assert not list(run_folder.glob("*/final.pt")), "the run ended before it could be interrupted"
    driver.send_signal(sig)
    out, err = driver.communicate(timeout=300)
    return driver.returncode, out, err


def check_three_invocations(args, interrupted_run, sig, expected):
    runs = Path(args[args.index("--runs-dir") + 1])
    status, out, err = start_and_interrupt(args, interrupted_run, sig)
    assert status == 130, out + err
    assert "stopping every run" in out and "stopped" in out
    (run_folder,) = [path for path in interrupted_run.iterdir() if path.is_dir()]
    assert (run_folder / "latest.pt").exists() and not (run_folder / "final.pt").exists()
    assert "SIGTERM" in (interrupted_run / "log.txt").read_text()  # the run was told, and saved

    second = reproduce(*args)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "resuming" in (interrupted_run / "log.txt").read_text()
    assert artifacts(runs) == expected

    logs = {path: path.stat().st_size for path in runs.rglob("log.txt")}
    started = time.monotonic()
    third = reproduce(*args)
    assert third.returncode == 0, third.stderr
    assert "every run is done" in third.stdout and "| IRU-5 |" in third.stdout
    assert {path: path.stat().st_size for path in runs.rglob("log.txt")} == logs  # nothing ran
    assert time.monotonic() - started < 10
    return second.stdout


def expected_artifacts(study, env_id, seeds=(1,), evals=("eval",), extra=()):
    """The folders and files of a finished tiny study: its three training runs, the evaluations and their tables."""
    trained = ("pretrain", "flexloop", "control")
    return sorted([f"{study}/{run}/seed{seed}/{env_id}__{study}-{run}__{seed}/final.pt"
                   for run in trained for seed in seeds]
                  + [f"{study}/{run}/seed{seed}/reproduce.json" for run in (*trained, *evals) for seed in seeds]
                  + [f"{study}/{run}/seed{seed}/results.json" for run in evals for seed in seeds]
                  + [f"{study}/{run}.table.md" for run in evals] + list(extra))


@pytest.mark.slow
def test_boxpick_study_survives_sigterm_and_completes(tiny):
    """Two seeds, so that the table is over seeds (mean ± std)."""
    out = check_three_invocations(["tiny-boxpick", *tiny.flags, "--seeds", "1", "2"],
                                  tiny.runs / "tiny-boxpick" / "pretrain" / "seed1", signal.SIGTERM,
                                  expected_artifacts("tiny-boxpick", "BoxPick-Exact-4-v0", seeds=(1, 2)))
    assert "2 seeds: " in out and re.search(r"\| IRU-5 \| train \| [0-9.]+ ± [0-9.]+ \|", out), out
    assert "| Self-TD-Only | unseen |" in out
    runs = tiny.runs / "tiny-boxpick"
    import torch
    for run, updates in [("pretrain", 12 * 2 * 3), ("flexloop", 2 * 2 * 3), ("control", 2 * 2 * 3)]:
        (final,) = (runs / run / "seed1").glob("*/final.pt")
        checkpoint = torch.load(final, weights_only=True)
        assert checkpoint["updates"] == updates
    (flexloop,) = (runs / "flexloop" / "seed1").glob("*/final.pt")
    (pretrain,) = (runs / "pretrain" / "seed1").glob("*/final.pt")
    assert torch.load(flexloop, weights_only=True)["args"]["init_checkpoint"] == str(pretrain)

    flexloop.touch()  # as if FlexLoop had been run again: its evaluation is out of date, and only that
    plan = reproduce("tiny-boxpick", *tiny.flags, "--dry-run").stdout
    assert [line for line in plan.splitlines() if line.startswith("#")] == [
        "# tiny-boxpick/pretrain seed 1: done", "# tiny-boxpick/flexloop seed 1: done",
        "# tiny-boxpick/control seed 1: done", "# tiny-boxpick/eval seed 1 (after tiny-boxpick/pretrain seed 1, "
        "tiny-boxpick/flexloop seed 1, tiny-boxpick/control seed 1)"]


@pytest.mark.slow
def test_ogbench_study_survives_ctrl_c_and_completes(tiny):
    expected = expected_artifacts("ogbench-pointmaze-large", "pointmaze-large-stitch-v0",
                                  evals=("eval", "eval-control"), extra=["ogbench-pointmaze-large/data/reproduce.json"])
    out = check_three_invocations(["ogbench-pointmaze-large", *tiny.flags],
                                  tiny.runs / "ogbench-pointmaze-large" / "pretrain" / "seed1", signal.SIGINT, expected)
    assert "| FlexLoop | task1 |" in out and "| Self-TD-Only | task1 |" in out
    assert sorted(path.name for path in tiny.data.iterdir()) == ["pointmaze-large-stitch-v0-val.npz",
                                                                "pointmaze-large-stitch-v0.npz"]


def tiny_pretraining_seconds_per_epoch(folder):
    """This machine's wall clock per epoch of tiny-boxpick's pretraining, start-up excluded (two runs' difference)."""
    def seconds(epochs):
        start = time.monotonic()
        subprocess.run([sys.executable, "iru_pretrain.py", "gcdqn", *TINY_SIZE, "--pretrain-epochs", str(epochs),
                        "--no-cuda", "--run-dir", str(folder / str(epochs))], cwd=REPO, env=ENV, check=True,
                       capture_output=True)
        return time.monotonic() - start
    return max(seconds(60) - seconds(20), 1e-3) / 40


@pytest.mark.slow
def test_submitit_local_executor_requeues_on_timeout_and_survives_sigterm(tiny, tmp_path):
    """submitit's local executor: the study is stopped with SIGTERM once the pretraining has written latest.pt; the
    next invocation's pretraining job times out (USR2 30 s in: submitit's checkpoint hook stops the run, which
    writes latest.pt, and requeues the job, which resumes) and the study completes; a third prints its table."""
    pytest.importorskip("submitit")
    # Each attempt of a local job gets 30 s before USR2 (--time 2, --signal-delay 90), and submitit's local executor
    # makes at most 6. So the pretraining should take about 70 s on this machine: the signal lands mid-run, and the
    # attempts finish it. Its speed differs 3x between 2-core machines (checkpoint writes every iteration), so it
    # is measured first.
    epochs = max(200, math.ceil(70 / tiny_pretraining_seconds_per_epoch(tmp_path / "probe")))
    (tmp_path / "tiny_studies.py").write_text(TINY_STUDIES.replace("PRETRAIN_EPOCHS", str(epochs)))
    args = ["tiny-boxpick", *tiny.flags, "--slurm-local", "--time", "2", "--signal-delay", "90",
            "--slurm-logs", tmp_path / "slurm-logs"]
    pretrain = tiny.runs / "tiny-boxpick" / "pretrain" / "seed1"
    check_three_invocations(args, pretrain, signal.SIGTERM, expected_artifacts("tiny-boxpick", "BoxPick-Exact-4-v0"))
    log = (pretrain / "log.txt").read_text()
    assert log.count("--resume") >= 2  # resumed after the SIGTERM, and after the time-out's requeue
    submitit_logs = "".join(path.read_text() for path in (tmp_path / "slurm-logs").glob("*_log.out"))
    assert "Calling checkpoint method" in submitit_logs and "Requeued job" in submitit_logs
