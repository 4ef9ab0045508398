"""Run a study of the paper to completion, across interruptions, and print its table.

    python reproduce.py --list                                  # the studies (studies.py)
    python reproduce.py boxpick-exact4 --seeds 1 2 3            # every GPU of this machine, one run each
    python reproduce.py boxpick-exact4 --gpus 0 1 --per-gpu 2   # two runs per GPU (CUDA MPS helps)
    python reproduce.py boxpick-exact4 --dry-run                # the commands, nothing run
    python reproduce.py boxpick-exact4 --slurm --partition gpu --time 240   # one SLURM job per run (submitit)
    python reproduce.py mine --no-cuda --workers 2 --studies-file my_studies.py  # your own, on the CPU

Each run has its own folder, runs/<study>/<run>/seed<N>/, so running the same command again finds everything: a
finished run is skipped, an unfinished one resumes from its latest.pt, and a finished study only prints its table.
Ctrl-C or SIGTERM reaches every run, each writes latest.pt and stops; the next invocation goes on. A run that fails
is reported with its log's last line, the runs that need it are skipped, and the others go on. docs/reproduce.md
says more, and when W&B sweeps (sweeps/) suit better.
"""

import argparse
import difflib
import fcntl
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent
PLACEHOLDER = re.compile(r"\{([^{}]+)\}")  # {pretrain}: where run `pretrain` of the same seed writes
MARKER = "reproduce.json"  # in each run's folder: which study, run and seed it holds, and the command
LOG = "log.txt"  # each run's output, appended across resumes
SLURM_GOING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "RESIZING", "SUSPENDED")


def fail(message):
    sys.exit(f"reproduce.py: error: {message}")


# ----------------------------------------------------------------------------------------------------- the plan


@dataclass
class Job:
    """One run of one seed (or of every seed, for a dataset), with its folder and the jobs it waits for."""
    study: str  # the study whose folder holds it (its home)
    run: object  # a studies.Run
    seed: int  # None for a run shared by every seed
    folder: Path  # runs/<study>/<run>/seed<N>/: the marker, the log, and the script's run folder inside
    needs: list = field(default_factory=list)
    state: str = "queued"  # queued, running, done, failed, skipped, stopped
    detail: str = ""
    where: str = ""

    @property
    def name(self):
        return f"{self.study}/{self.run.name}" + ("" if self.seed is None else f" seed {self.seed}")


def load_studies(path):
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # a file of your own may `import studies` for its builders
    return module.STUDIES


def plan(studies, seeds, runs_dir):
    """The jobs of these studies in order, a run shared by two studies once (one folder, one job)."""
    jobs = {}
    for study in studies:
        for seed in seeds:
            by_name, not_this_seed = {}, set()
            for run in study.runs:
                if run.per_seed and run.seeds is not None and seed not in run.seeds:
                    not_this_seed.add(run.name)
                    continue
                home = run.home or study.name
                folder = runs_dir / home / run.name / (f"seed{seed}" if run.per_seed else "")
                job = jobs.setdefault(folder, Job(home, run, seed if run.per_seed else None, folder))
                if job.run.command != run.command:
                    fail(f"{study.name}'s run {run.name} shares {folder} with another study's run but not its "
                         "flags; give one of them another name or the same flags")
                names = [name for token in run.command for name in PLACEHOLDER.findall(token) if name != run.name]
                for name in names:
                    if name in not_this_seed:
                        fail(f"{study.name}'s run {run.name} uses {{{name}}}, which does not run for seed {seed}; "
                             f"give {run.name} the seeds of {name}")
                    if name not in by_name:
                        fail(f"{study.name}'s run {run.name} uses {{{name}}}, which is not a run listed before it")
                job.needs = [by_name[name] for name in dict.fromkeys(names)]
                by_name[run.name] = job
    return list(jobs.values())


def output(job, data_dir):
    """Where a job writes, as the runs that read it see it: the script's run folder, the evaluation's folder or
    the dataset folder. None while a training run has not made its folder yet."""
    if job.run.kind == "data":
        return data_dir
    if job.run.kind == "eval":
        return job.folder
    inside = [path for path in job.folder.iterdir() if path.is_dir()] if job.folder.is_dir() else []
    if len(inside) > 1:
        raise RuntimeError(f"{job.folder} holds {len(inside)} run folders, not one; keep the one to go on with")
    return inside[0] if inside else None


def is_done(job, data_dir):
    """A dataset when its files are there, a training run at its final.pt, an evaluation when its results.json is
    newer than the checkpoints it read (a run done again is evaluated again)."""
    if job.run.kind == "data":
        return all((data_dir / name).exists() for name in job.run.creates)
    if job.run.kind == "eval":
        results, trained = job.folder / "results.json", [need for need in job.needs if need.run.kind == "train"]
        if not results.exists() or not all(is_done(need, data_dir) for need in trained):
            return False
        return all(results.stat().st_mtime >= (output(need, data_dir) / "final.pt").stat().st_mtime
                   for need in trained)
    run_folder = output(job, data_dir)
    return run_folder is not None and (run_folder / "final.pt").exists()


def identity(job):
    return {"study": job.study, "run": job.run.name, "seed": job.seed, "command": list(job.run.command)}


def check_folder(job):
    """A folder that holds another study's run, or the same run with other flags, is refused: resuming it would
    mix two runs."""
    marker = job.folder / MARKER
    if not marker.exists():
        if job.folder.is_dir() and any(p.name not in (LOG, ".lock") for p in job.folder.iterdir()):
            return (f"{job.folder} holds files that reproduce.py did not write; move them away or pick another "
                    "--runs-dir")
        return None
    theirs, ours = json.loads(marker.read_text()), identity(job)
    if (theirs["study"], theirs["run"], theirs["seed"]) != (ours["study"], ours["run"], ours["seed"]):
        return (f"{job.folder} holds run {theirs['run']} seed {theirs['seed']} of study {theirs['study']}, not this "
                f"one; move it away or pick another --runs-dir")
    if theirs["command"] != ours["command"]:
        return (f"{job.folder} holds this run started with other flags ({' '.join(theirs['command'])}); move it "
                "away to start over with the study's flags")
    return None


def command(job, data_dir, machine_flags, track, dry=False):
    """The command that takes the job to its end from where it stands: fresh, or resuming from latest.pt. With dry,
    a folder not made yet shows as a pattern (a run folder's name holds its start time), and nothing is touched."""
    def where(name):
        run = job if name == job.run.name else next(n for n in job.needs if n.run.name == name)
        made = output(run, data_dir)
        return made if made is not None else run.folder / "*"

    argv = [sys.executable, *(PLACEHOLDER.sub(lambda m: str(where(m.group(1))), token) for token in job.run.command)]
    if job.run.kind == "data":
        return argv
    argv += machine_flags
    if job.run.kind == "eval":
        return argv + ["--out-dir", str(job.folder)] + (["--track", "--wandb-group", job.study] if track else [])
    run_folder = output(job, data_dir)
    if run_folder is not None and (run_folder / "latest.pt").exists():
        return argv + ["--resume", str(run_folder / "latest.pt")]
    if run_folder is not None and not dry:  # stopped before its first checkpoint: nothing to resume, start again
        shutil.rmtree(run_folder)
    argv += ["--run-dir", str(job.folder), "--seed", str(job.seed), "--exp-name", f"{job.study}-{job.run.name}"]
    return argv + (["--track", "--wandb-group", job.study] if track else [])


def last_line(path):
    """The last line of a log, progress bars included (they end lines with \\r)."""
    try:
        with open(path, "rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 4096))
            lines = [line.strip() for line in re.split(r"[\r\n]", file.read().decode(errors="replace"))]
    except OSError:
        return ""
    return next((line for line in reversed(lines) if line), "")


# --------------------------------------------------------------------------------------------- running the runs


def take_lock(folder):
    """The run's lock: taken here, then held by the process that runs it (the script inherits it), so that a second
    reproduce.py finds a run that an earlier one left going and does not start it twice."""
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(f"{folder} is being run by another process (one an earlier reproduce.py started?); wait "
                           "for it to end or stop it") from None
    return fd


def start_child(make_argv, folder, env=None):
    """The run, holding its folder's lock, in a process group of its own, so that a terminal's Ctrl-C reaches it once,
    through reproduce.py; SIGUSR2 ignored, since SLURM sends it to every process of a job before a time-out, and
    submitit handles it. The command is made once the lock is held: making it may clear an unstarted run folder."""
    lock = take_lock(folder)
    try:
        argv = make_argv()
    except RuntimeError:
        os.close(lock)
        raise
    with open(folder / LOG, "a") as log:
        log.write(f"\n$ {' '.join(argv)}\n")
        log.flush()
        child = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(lock,),
                                 start_new_session=True,
                                 preexec_fn=lambda: signal.signal(signal.SIGUSR2, signal.SIG_IGN))
    os.close(lock)
    return child


class LocalLauncher:
    """Runs on this machine: slots are GPUs (CUDA_VISIBLE_DEVICES per run), several runs per GPU, or CPU workers."""

    def __init__(self, slots):
        self.free, self.children = list(slots), {}

    def start(self, job, make_argv):
        slot = self.free[0]
        # nvidia-smi's numbering (PCI order), which --gpus uses, not CUDA's default fastest-first
        env = dict(os.environ, CUDA_DEVICE_ORDER="PCI_BUS_ID",
                   CUDA_VISIBLE_DEVICES="" if slot is None else str(slot[0]))
        env.setdefault("OMP_NUM_THREADS", "1")  # small networks: one thread per run is fastest
        self.children[id(job)] = (start_child(make_argv, job.folder, env), self.free.pop(0))
        job.where = "cpu" if slot is None else f"gpu {slot[0]}"

    def has_room(self):
        return bool(self.free)

    def poll(self, job):
        """None while the run goes on, else how it ended."""
        child, slot = self.children[id(job)]
        if child.poll() is None:
            return None
        del self.children[id(job)]
        self.free.append(slot)
        return f"exit status {child.returncode}"

    def stop(self, job):
        child, _ = self.children[id(job)]
        if child.poll() is None:
            os.kill(child.pid, signal.SIGTERM)  # the script writes latest.pt and exits


class RunToEnd:
    """A SLURM job (submitit): runs one command to its end. On a time-out or preemption, submitit calls checkpoint():
    the run is stopped (it writes latest.pt) and the job requeued, and the next start resumes from latest.pt."""

    def __init__(self, job, data_dir, machine_flags, track):
        self.job, self.data_dir, self.machine_flags, self.track = job, data_dir, machine_flags, track
        self.child = None

    def __call__(self):
        if is_done(self.job, self.data_dir):  # requeued just as it finished
            return 0
        signal.signal(signal.SIGTERM, self.stop_run)  # scancel, or reproduce.py stopping the study
        try:
            self.child = start_child(lambda: command(self.job, self.data_dir, self.machine_flags, self.track),
                                     self.job.folder)
        except RuntimeError as error:  # into the run's log, where reproduce.py reads why a run failed
            with open(self.job.folder / LOG, "a") as log:
                log.write(f"\nreproduce.py: {error}\n")
            raise
        while self.child.poll() is None:  # poll, not wait(): checkpoint() may run in between, in this thread
            time.sleep(1)
        return self.child.returncode

    def stop_run(self, *_):
        """SIGTERM to the run, which writes latest.pt and exits."""
        try:
            os.kill(self.child.pid, signal.SIGTERM)
        except (AttributeError, ProcessLookupError):  # not started yet, or already gone
            pass

    def checkpoint(self, *args):
        import submitit
        if self.child is not None:
            self.stop_run()
            try:  # the pid, not Popen.wait(): this handler may interrupt a poll() holding Popen's lock
                os.waitpid(self.child.pid, 0)
            except ChildProcessError:  # already reaped by that poll()
                pass
        return submitit.helpers.DelayedSubmission(RunToEnd(self.job, self.data_dir, self.machine_flags, self.track))


class SubmititLauncher:
    """One SLURM job per run through submitit (or submitit's local executor, to try this path on one machine)."""

    def __init__(self, cli, data_dir, machine_flags):
        try:
            import submitit
        except ImportError:
            fail("--slurm needs submitit: pip install 'submitit>=1.5' (or pip install -e '.[slurm]')")
        self.submitit, self.cluster = submitit, not cli.slurm_local
        self.logs = logs = Path(cli.slurm_logs).resolve()
        if cli.slurm_local:
            self.executor = submitit.LocalExecutor(folder=logs, max_num_timeout=cli.max_requeues)
            self.executor.update_parameters(timeout_min=cli.time, gpus_per_node=cli.gpus_per_job,
                                            signal_delay_s=cli.signal_delay)
        else:
            if shutil.which("sbatch") is None:
                fail("--slurm found no sbatch on this machine; run it on the cluster's login node (or try "
                     "--slurm-local)")
            self.executor = submitit.SlurmExecutor(folder=logs, max_num_timeout=cli.max_requeues)
            if not all("=" in item for item in cli.slurm_arg):
                fail(f"--slurm-arg {' '.join(cli.slurm_arg)}: give each as KEY=VALUE, e.g. account=abc")
            extra = dict(item.split("=", 1) for item in cli.slurm_arg)
            self.executor.update_parameters(partition=cli.partition, time=int(cli.time),
                                            gpus_per_node=cli.gpus_per_job, cpus_per_task=cli.cpus_per_job,
                                            signal_delay_s=cli.signal_delay, additional_parameters=extra)
        # the job unpickles studies.py's Run, so it imports studies.py from here wherever it starts (jobs inherit
        # this environment; a `setup` line instead would put a shell between the local executor and its job)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        self.run_args, self.jobs = (data_dir, machine_flags, cli.track), {}

    def start(self, job, make_argv):  # the job makes its command when it starts (again, after a requeue)
        job_id_file = job.folder / "slurm_job_id"
        if self.cluster and job_id_file.exists():  # submitted by an earlier reproduce.py: follow it if it goes on
            earlier = self.submitit.SlurmJob(folder=self.logs, job_id=job_id_file.read_text().strip())
            if earlier.state in SLURM_GOING:
                self.jobs[id(job)], job.where = earlier, f"job {earlier.job_id}"
                return
        self.executor.update_parameters(job_name=job.name.replace(" ", "-").replace("/", "-"))
        self.jobs[id(job)] = self.executor.submit(RunToEnd(job, *self.run_args))
        job.where = f"job {self.jobs[id(job)].job_id}"
        if self.cluster:
            job_id_file.write_text(self.jobs[id(job)].job_id)

    def has_room(self):
        return True  # the cluster queues them

    def poll(self, job):
        """None while the job is queued or running (or requeued), else how it ended. Whether the run finished is read
        from its files, and why it did not from its log, so submitit's result file is not waited for."""
        submitted = self.jobs[id(job)]
        if not submitted.done():
            return None
        del self.jobs[id(job)]
        if not last_line(job.folder / LOG):  # it failed before the run started: submitit's log says why
            with open(job.folder / LOG, "a") as log:
                log.write(f"submitit: {last_line(submitted.paths.stderr)}\n")
        return f"job {submitted.job_id} ended"

    def stop(self, job):
        submitted = self.jobs[id(job)]
        if getattr(submitted, "_process", None) is not None:  # the local executor: SIGTERM reaches the run
            submitted._process.send_signal(signal.SIGTERM)
        else:
            submitted.cancel(check=False)  # scancel: SLURM sends SIGTERM to the run, which writes latest.pt


def schedule(jobs, launcher, data_dir, machine_flags, track, status_every):
    """Start each job once the jobs it needs are done, as the launcher has room; skip those whose needs failed.
    Returns True when a stop signal ended it."""
    stop = []  # the handler only notes the signal (printing there could interrupt a print); the loop acts on it

    def request_stop(signum, frame):
        stop.append(signum)

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    running, told, shown, last_shown = [], set(), None, 0.0
    try:
        while True:
            if stop and not told:
                print(f"\n{signal.Signals(stop[0]).name}: stopping every run (each writes latest.pt); run the same "
                      "command again to go on", flush=True)
                told.add(None)
            for job in running:  # each run is told once
                if stop and id(job) not in told:
                    launcher.stop(job)
                    told.add(id(job))
            for job in list(running):
                ended = launcher.poll(job)
                if ended is None:
                    job.detail = last_line(job.folder / LOG)
                    continue
                running.remove(job)
                if is_done(job, data_dir):
                    job.state, job.detail = "done", ""
                elif stop:
                    job.state, job.detail = "stopped", "latest.pt written" if job.run.kind == "train" else ""
                else:
                    job.state = "failed"
                    job.detail = f"{ended}: {last_line(job.folder / LOG)} (log: {job.folder / LOG})"
            for job in jobs:
                if job.state == "queued" and any(n.state in ("failed", "skipped") for n in job.needs):
                    job.state, job.detail = "skipped", "needs " + ", ".join(
                        n.name for n in job.needs if n.state in ("failed", "skipped"))
                elif (job.state == "queued" and not stop and launcher.has_room()
                      and all(n.state == "done" for n in job.needs)):
                    job.folder.mkdir(parents=True, exist_ok=True)
                    (job.folder / MARKER).write_text(json.dumps(identity(job), indent=1))
                    try:
                        launcher.start(job, lambda job=job: command(job, data_dir, machine_flags, track))
                    except RuntimeError as error:
                        job.state, job.detail = "failed", str(error)
                        continue
                    job.state = "running"
                    running.append(job)
            states = [(job.state, job.detail if job.state != "running" else "") for job in jobs]
            if states != shown or (running and time.monotonic() - last_shown > status_every):
                print_status(jobs)
                shown, last_shown = states, time.monotonic()
            if not running and (stop or not any(job.state == "queued" for job in jobs)):
                return bool(stop)
            time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def print_status(jobs):
    width = max(len(job.name) for job in jobs)
    print(f"\n{time.strftime('%H:%M:%S')} " + ", ".join(
        f"{sum(job.state == state for job in jobs)} {state}" for state in
        ("done", "running", "queued", "failed", "skipped", "stopped") if any(job.state == state for job in jobs)))
    for job in jobs:
        detail = f"  {job.where}  {job.detail[-100:]}" if job.state == "running" else f"  {job.detail}"
        print(f"  {job.name:<{width}}  {job.state:<8}{detail}")
    sys.stdout.flush()


# ------------------------------------------------------------------------------------------------------ tables


def table_text(results_paths):
    """bench/seed_table.py's table for splits (BoxPick, LightsOut); for OGBench's tasks, the mean over seeds of
    full-depth and adaptive success per task, which seed_table.py does not read yet."""
    first = json.loads(Path(results_paths[0]).read_text())
    if "train" in first["checkpoints"][0]["elasticity"]:
        made = subprocess.run([sys.executable, "bench/seed_table.py", *map(str, results_paths)], cwd=REPO,
                              capture_output=True, text=True)
        if made.returncode != 0:
            raise RuntimeError(f"bench/seed_table.py failed: {made.stderr.strip().splitlines()[-1:]}")
        return made.stdout
    by_label = {}
    for path in results_paths:
        for checkpoint in json.loads(Path(path).read_text())["checkpoints"]:
            by_label.setdefault(checkpoint["label"], []).append(checkpoint)
    lines = [f"{len(results_paths)} seeds: " + ", ".join(map(str, results_paths)),
             "| model | task | full depth | adaptive at calibrated eps: success at mean depth |", "|---|---|---|---|"]
    for label, runs in by_label.items():
        for group in runs[0]["elasticity"]:
            calibrated = [run["calibration"]["results"][group] for run in runs]
            lines.append(f"| {label} | {group} | {mean_std(run['elasticity'][group][-1] for run in runs)} | "
                         f"{mean_std(c['success'] for c in calibrated)} at "
                         f"{mean_std(c['mean_depth'] for c in calibrated)} |")
    return "\n".join(lines) + "\n"


def mean_std(values):
    values = list(values)
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.3f}"
    std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5
    return f"{mean:.3f} ± {std:.3f}"


def print_tables(study, jobs, runs_dir):
    """Each evaluation's table over the seeds, written to runs/<study>/<eval>.table.md and printed; a table
    already written for these seeds is printed as it is."""
    for run in study.runs:
        if run.kind != "eval":
            continue
        home = run.home or study.name
        evals = [job for job in jobs if job.study == home and job.run.name == run.name]
        if not evals:  # a run for other seeds than these
            continue
        path = runs_dir / home / f"{run.name}.table.md"
        header = f"{home} {run.name}, seeds {' '.join(str(job.seed) for job in evals)}\n"
        if not all(job.state == "done" for job in evals):
            print(f"\n{home}: no {run.name} table yet ({sum(j.state == 'done' for j in evals)} of {len(evals)} "
                  "seeds evaluated)")
            continue
        newest = max((job.folder / "results.json").stat().st_mtime for job in evals)
        if not (path.exists() and path.read_text().startswith(header) and path.stat().st_mtime >= newest):
            path.write_text(header + table_text([job.folder / "results.json" for job in evals]))
        print("\n" + path.read_text(), end="")


# --------------------------------------------------------------------------------------------------------- main


def visible_gpus():
    try:
        listed = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                                text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [int(line) for line in listed.stdout.split()] if listed.returncode == 0 else []


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("studies", nargs="*", help="the studies to run (--list names them)")
    parser.add_argument("--list", action="store_true", help="name the studies and exit")
    parser.add_argument("--dry-run", action="store_true", help="print each run's state and command; run nothing")
    parser.add_argument("--seeds", type=int, nargs="+", metavar="N", help="the seeds (default: each study's, 1 2 3)")
    parser.add_argument("--runs-dir", default="runs", help="the runs go to <runs-dir>/<study>/<run>/seed<N>/")
    parser.add_argument("--data-dir", default="~/.ogbench/data", help="OGBench datasets: used where present "
                        "(downloaded), generated there where missing")
    parser.add_argument("--studies-file", default=str(REPO / "studies.py"), help="read the studies (STUDIES) "
                        "from this file: your own grids")
    parser.add_argument("--track", action="store_true", help="log every run to W&B, grouped by study")
    parser.add_argument("--status-every", type=float, default=300, help="reprint the status table this often (s)")
    local = parser.add_argument_group("this machine")
    local.add_argument("--gpus", type=int, nargs="+", metavar="ID", help="the GPUs to use (default: every GPU "
                       "nvidia-smi lists)")
    local.add_argument("--per-gpu", type=int, default=1, help="runs per GPU at once")
    local.add_argument("--no-cuda", action="store_true", help="run on the CPU (tests, tiny studies)")
    local.add_argument("--workers", type=int, default=1, help="with --no-cuda: runs at once")
    slurm = parser.add_argument_group("SLURM (submitit)")
    slurm.add_argument("--slurm", action="store_true", help="submit each run as a SLURM job, requeued on a "
                       "time-out or preemption and resumed from latest.pt")
    slurm.add_argument("--slurm-local", action="store_true", help="the same jobs through submitit's local "
                       "executor on this machine (to try the path)")
    slurm.add_argument("--partition", help="SLURM partition")
    slurm.add_argument("--time", type=float, default=240, help="time limit per job, minutes; a run that needs "
                       "more is requeued and resumes")
    slurm.add_argument("--gpus-per-job", type=int, default=1, help="GPUs per job (0 with --no-cuda)")
    slurm.add_argument("--cpus-per-job", type=int, default=8, help="CPUs per job")
    slurm.add_argument("--slurm-logs", default="runs/slurm-logs", help="submitit's folder (job scripts, logs)")
    slurm.add_argument("--slurm-arg", nargs="+", default=[], metavar="KEY=VALUE", help="more sbatch options, "
                       "e.g. account=abc qos=high constraint=h200")
    slurm.add_argument("--max-requeues", type=int, default=30, help="time-outs a job may be requeued after")
    slurm.add_argument("--signal-delay", type=int, default=120, help="seconds before the time limit that the "
                       "job is told to stop and requeue")
    return parser.parse_args(argv)


def main(argv=None):
    cli = parse(argv)
    studies_path = Path(cli.studies_file)
    if not studies_path.exists():
        fail(f"--studies-file {studies_path} does not exist")
    known = load_studies(studies_path)
    if cli.list or not cli.studies:
        width = max(map(len, known))
        for study in known.values():
            per_seed = sum(run.per_seed for run in study.runs)
            print(f"{study.name:<{width}}  {per_seed} runs per seed, seeds {' '.join(map(str, study.seeds))}: "
                  f"{study.about}")
        return 0
    for name in cli.studies:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            fail(f"unknown study {name!r}" + (f" (did you mean {', '.join(close)}?)" if close else "")
                 + "; python reproduce.py --list names them")
    studies = [known[name] for name in dict.fromkeys(cli.studies)]
    seeds = cli.seeds or list(studies[0].seeds)
    if any(seed < 0 for seed in seeds) or len(set(seeds)) < len(seeds):
        fail(f"--seeds {' '.join(map(str, seeds))}: give distinct seeds >= 0")
    runs_dir, data_dir = Path(cli.runs_dir).resolve(), Path(cli.data_dir).expanduser().resolve()

    # where the runs go: the machine flags they get, and the slots they take
    if cli.slurm or cli.slurm_local:
        if cli.no_cuda:
            cli.gpus_per_job = 0
        machine_flags = ["--no-cuda"] if cli.gpus_per_job == 0 else ["--require-cuda"]
    elif cli.no_cuda:
        if cli.gpus:
            fail("--gpus and --no-cuda contradict each other; give one")
        if cli.workers < 1:
            fail(f"--workers {cli.workers}: give 1 or more")
        machine_flags, slots = ["--no-cuda"], [None] * cli.workers
    elif cli.dry_run and not visible_gpus():  # the commands a GPU machine would run, printed on this one
        machine_flags, slots = ["--require-cuda"], []
    else:
        found = visible_gpus()
        if not found:
            fail("no GPU found (nvidia-smi lists none); --no-cuda --workers N runs on the CPU, --slurm on a cluster")
        gpus = cli.gpus if cli.gpus is not None else found
        missing = [gpu for gpu in gpus if gpu not in found]
        if missing:
            fail(f"GPU {', '.join(map(str, missing))} does not exist: this machine has GPU "
                 f"{', '.join(map(str, found))}")
        if cli.per_gpu < 1:
            fail(f"--per-gpu {cli.per_gpu}: give 1 or more")
        machine_flags, slots = ["--require-cuda"], [(gpu, k) for k in range(cli.per_gpu) for gpu in gpus]

    jobs = plan(studies, seeds, runs_dir)
    problems = [problem for problem in map(check_folder, jobs) if problem]
    if problems:
        fail(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    for job in jobs:
        try:
            if is_done(job, data_dir):
                job.state = "done"
        except RuntimeError as error:
            fail(str(error))

    if cli.dry_run:
        for job in jobs:
            if job.state == "done":
                print(f"# {job.name}: done")
                continue
            argv = command(job, data_dir, machine_flags, cli.track, dry=True)
            print(f"# {job.name}" + (f" (after {', '.join(n.name for n in job.needs)})" if job.needs else ""))
            print(shlex.join(["python", *argv[1:]]).replace(os.getcwd() + "/", ""))
        return 0

    if all(job.state == "done" for job in jobs):
        print(f"{', '.join(s.name for s in studies)}: every run is done (seeds {' '.join(map(str, seeds))})")
    else:
        slurm = cli.slurm or cli.slurm_local
        launcher = SubmititLauncher(cli, data_dir, machine_flags) if slurm else LocalLauncher(slots)
        stopped = schedule(jobs, launcher, data_dir, machine_flags, cli.track, cli.status_every)
        if stopped:
            return 130
    for study in studies:
        print_tables(study, jobs, runs_dir)
    failed = [job for job in jobs if job.state in ("failed", "skipped")]
    if failed:
        print(f"\nreproduce.py: {len(failed)} run(s) failed or skipped: " + "; ".join(
            f"{job.name}: {job.state}" for job in failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
