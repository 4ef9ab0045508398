"""The run plumbing that FlexLoop's scripts share, as CleanRL's scripts share cleanrl_utils: flags in groups, run
setup, checkpoints (save, load, check, refuse code), the metrics log (metrics.jsonl, TensorBoard, W&B), RNG state,
stop signals and the timer, progress, CUDA-graph capture, and loading the script that a checkpoint names. Run as a
script, it writes a checkpoint's slim copy: python flexloop_run.py slim SOURCE DESTINATION.

Nothing here knows an algorithm. A script passes itself, and this module reads the names it defines:

    run = flexloop_run.Run(sys.modules[__name__], args)

    Args, check_args       the flags (a dataclass made of groups) and their check
    ALGORITHM              the algorithm a checkpoint is of ("gcdqn"); --init-checkpoint and --resume must match it
    ENV_FLAG               the flag naming the env (run names, checkpoints)
    NETWORK_FLAGS          the flags an --init-checkpoint must share with the run
    CHECKPOINT_PARTS       the state dicts a checkpoint holds
    RESUME_FLAGS           the flags --resume takes from the command line
    GPU_SIZED_FLAGS        the flags whose defaults need a GPU (a warning on a CPU)
    LOSS_NAMES             flexloop_losses' terms: metrics, NaN checks
    format_eval            evaluate()'s results as printed lines
"""

import codecs
import contextlib
import gc
import hashlib
import importlib.machinery
import importlib.util
import io
import json
import os
import pickletools
import random
import re
import signal
import sys
import threading
import time
import zipfile
from dataclasses import asdict, fields, make_dataclass, replace
from functools import partial
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import tyro
from tqdm.auto import tqdm

CHECKPOINT_FORMAT = "flexloop-checkpoint-v2"
CUDA_GRAPH_WARMUP = 3  # eager calls before a capture, as torch.cuda.graphs requires; they do real work
CPU_HELP = 'README.md, "On a CPU"'
# A resumed run takes these from the command line, given or not: they say how it runs here, not what it learns
# (cuda_streams: GC-IQL's CUDA streams, where a script lists it in its RESUME_FLAGS).
MACHINE_FLAGS = ("cuda", "require_cuda", "debug", "cuda_streams")
EVALUATOR = Path(__file__).resolve().with_name("eval_adaptive.py")


def shown_path(path):
    """A path as a command line shows it: relative to the working folder when it lies below it."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


# ---------------------------------------------------------------------------------------------------------
# Flags, errors and output
# ---------------------------------------------------------------------------------------------------------
def parse_args(Args, argv=None, default=None, prog=None, description=None):
    """The command line as a flat Args. --help lists the flags in the groups Args is made of (ExperimentArgs shows
    as "experiment options"), under flat names (--lambda-depth); `default` replaces the defaults (iru_pretrain.py
    shows its own this way)."""
    default = Args() if default is None else default
    groups = {group.__name__.removesuffix("Args").lower(): group for group in reversed(Args.__bases__)}
    flags = make_dataclass("Flags", [(name, Annotated[group, tyro.conf.OmitArgPrefixes])
                                     for name, group in groups.items()])
    defaults = flags(**{name: group(**{f.name: getattr(default, f.name) for f in fields(group)})
                        for name, group in groups.items()})
    given = tyro.cli(flags, args=argv, prog=prog, description=description, default=defaults)
    return Args(**{f.name: getattr(getattr(given, name), f.name) for name, group in groups.items()
                   for f in fields(group)})


class NoGPUError(RuntimeError):
    """--require-cuda on a machine without a GPU."""


@contextlib.contextmanager
def errors_in_one_line():
    """The errors raised on purpose (bad flags, checkpoints or data, a full disk, NaN in a loss) end the program
    with their message in one line and exit status 1, not a traceback; --debug or FLEXLOOP_DEBUG=1 shows it."""
    try:
        yield
    except (ValueError, OSError, FloatingPointError, NoGPUError) as error:
        if "--debug" in sys.argv or os.environ.get("FLEXLOOP_DEBUG") == "1":
            raise
        print(f"{Path(sys.argv[0]).name}: error: {error}  (--debug shows the traceback)", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:  # before the stop signals are set up, or a second Ctrl-C
        print(f"{Path(sys.argv[0]).name}: interrupted; nothing was saved since the last checkpoint", file=sys.stderr)
        sys.exit(130)


def say(text, file=None):
    """Print above the progress bar. Output is never worth a run: when stdout has gone (`... | tee log`, where
    Ctrl-C ends tee first), the text is dropped and stdout writes to /dev/null from then on, as Python's docs
    advise for a broken pipe, so that no later print or the flush at exit fails either."""
    try:
        tqdm.write(text, file=file)
    except OSError:  # BrokenPipeError, or EIO when the terminal has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), (file or sys.stdout).fileno())


def script_name(script):
    """What checkpoints and run names call a script: its file's stem (flexloop_gcdqn, my_gcdqn)."""
    return Path(script.__file__).stem


def pick_device(script, args):
    """CUDA when there is a GPU and --cuda, else the CPU; say which, and warn when GPU-sized flags meet a CPU."""
    if args.require_cuda and not torch.cuda.is_available():
        raise NoGPUError("--require-cuda was given but no CUDA GPU is visible; drop the flag or use --no-cuda")
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
    say(f"{script_name(script)}: running on "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'the CPU'}")
    sized_for_gpu = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in script.GPU_SIZED_FLAGS
                     if getattr(args, name) == getattr(script.Args(), name)]
    if device.type == "cpu" and sized_for_gpu:
        say(f"warning: {', '.join(sized_for_gpu)} are sized for a GPU, and on a CPU this run takes days. For a CPU "
            f"run that finishes in minutes, see {CPU_HELP}.")
    return device


# ---------------------------------------------------------------------------------------------------------
# Checkpoints: written atomically, read with weights_only, checked against the script and the run
# ---------------------------------------------------------------------------------------------------------
def args_from_checkpoint(Args, checkpoint, path="the checkpoint"):
    """The flags a checkpoint was trained with, as `Args` (flags added since it was written take their defaults).
    Flags that Args does not have mean another script wrote it."""
    unknown = sorted(set(checkpoint["args"]) - {f.name for f in fields(Args)})
    if unknown:
        raise ValueError(f"{path} has flags {unknown} that {Args.__module__}.py does not know; it was written by "
                         f"{checkpoint.get('script', 'another script')}.py: use that script for it")
    return Args(**checkpoint["args"])


def resumed_args(script, checkpoint, given):
    """A resumed run keeps its own flags. Only the script's RESUME_FLAGS come from the command line: the
    machine's (MACHINE_FLAGS) always, since they describe where it runs now, the others only where given."""
    missing = [k for k in ("run_name", *script.CHECKPOINT_PARTS, "rng", "global_step", "updates")
               if k not in checkpoint]
    if missing:
        raise ValueError(f"--resume {given.resume} lacks {missing}, which resuming needs; start a new run from its "
                         "weights with --init-checkpoint instead")
    overrides = {name: getattr(given, name) for name in script.RESUME_FLAGS
                 if name in MACHINE_FLAGS or getattr(given, name) != getattr(script.Args(), name)}
    return replace(args_from_checkpoint(script.Args, checkpoint, given.resume), **overrides)


SEEDED_PATH_FLAGS = ("init_checkpoint", "teacher_checkpoint")  # where "{seed}" stands for --seed


def with_seed_in_paths(args):
    """args with "{seed}" in a checkpoint flag's path replaced by the run's seed: a W&B sweep over seeds can then
    start each seed from its own pretrained checkpoint with one value. The run records the path it read."""
    seeded = {name: getattr(args, name).replace("{seed}", str(args.seed)) for name in SEEDED_PATH_FLAGS
              if isinstance(getattr(args, name, None), str) and "{seed}" in getattr(args, name)}
    return replace(args, **seeded)


def check_compatible(script, init, args):
    """An --init-checkpoint must match this run's env and network shape (the script's NETWORK_FLAGS)."""
    theirs = args_from_checkpoint(script.Args, init, "--init-checkpoint")
    for key in script.NETWORK_FLAGS:
        if getattr(theirs, key) != getattr(args, key):
            raise ValueError(f"--init-checkpoint was trained with {key}={getattr(theirs, key)!r} but this run has "
                             f"{key}={getattr(args, key)!r}; pass --{key.replace('_', '-')} {getattr(theirs, key)}")
    env_flag = script.ENV_FLAG
    if init["env_id"] != getattr(args, env_flag):
        raise ValueError(f"--init-checkpoint was trained on {init['env_id']} but this run is on "
                         f"{getattr(args, env_flag)}; pass --{env_flag.replace('_', '-')} {init['env_id']}")


def save_checkpoint(path, payload):
    """Serialise in memory, write a temp file, then os.replace: a kill, a crash or a full disk never leaves a
    broken checkpoint or a stray temp file, and the previous checkpoint stays as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    buffer = io.BytesIO()
    torch.save(payload, buffer)  # in memory first: a full disk then fails in write() as an OSError, not deep in torch
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:  # also an interrupt mid-write: no half-written temp file stays behind
        tmp.unlink(missing_ok=True)
        if not isinstance(error, OSError):
            raise
        raise OSError(error.errno, f"could not write checkpoint {path} ({error}); the previous checkpoint is intact. "
                      "Free disk space or point --run-dir at a writable folder.") from error


def pickled_globals(path):
    """module.name of every Python object a pickle names (objects that unpickling would call), read without
    unpickling; [] when the file holds no readable pickle."""
    data = Path(path).read_bytes()
    if zipfile.is_zipfile(path):  # torch's format: the pickle is the archive's data.pkl
        with zipfile.ZipFile(path) as archive:
            data = next((archive.read(n) for n in archive.namelist() if n.endswith("data.pkl")), b"")
    names, strings = [], []
    try:
        for opcode, arg, _ in pickletools.genops(data):
            if opcode.name in ("GLOBAL", "INST"):
                names.append(arg.replace(" ", "."))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(".".join(strings[-2:]))
            elif isinstance(arg, str):
                strings.append(arg)
    except Exception:  # not a pickle, or cut short: what was read so far
        pass
    return names


def is_text(head):
    """Whether a file's first bytes read as UTF-8 text (notes, a log, JSON), a character cut at the end allowed."""
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\t\r\n" for c in text)


def read_checkpoint_file(path):
    """torch.load with weights_only=True, so that a file holding code is refused and the code never runs. When a
    file cannot be loaded, the error says what it is instead."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist; pass a .pt file written by a FlexLoop script, "
                                "e.g. runs/<run_name>/latest.pt")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        head = path.read_bytes()[:4096]
        refused = re.findall(r"GLOBAL ([\w.]+)", str(error))  # torch names the callable it refused
        code = refused or [name for name in pickled_globals(path) if not name.startswith(("torch.", "collections."))]
        if not head:
            why = "is empty, not a FlexLoop checkpoint; use an earlier checkpoint (latest.pt, pretrained.pt)"
        elif is_text(head):  # before the code check: a text's letters can read as pickle opcodes
            why = "is a text file, not a FlexLoop checkpoint (a .pt file that flexloop_*.py writes into runs/<run>/)"
        elif code:
            why = (f"was refused, and not loaded, because it can run code when loaded (it calls {code[0]}). Do not "
                   "load this file: use a checkpoint that a FlexLoop script wrote")
        elif zipfile.is_zipfile(path) or head.startswith(b"PK"):
            why = ("is corrupt or truncated (an incomplete torch archive), not a loadable FlexLoop checkpoint; use an "
                   "earlier checkpoint (latest.pt, pretrained.pt) or copy the file again")
        else:
            why = (f"is not a FlexLoop checkpoint: torch cannot read it ({type(error).__name__}); it is corrupt, "
                   "truncated or another kind of file")
        raise ValueError(f"{path} {why}") from error


def load_checkpoint(path, algorithm=None):
    """A FlexLoop checkpoint, read safely (read_checkpoint_file), checked to be one and, when `algorithm` is given,
    to be of that algorithm."""
    checkpoint = read_checkpoint_file(path)
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a FlexLoop checkpoint (no '{CHECKPOINT_FORMAT}' format tag)")
    missing = [k for k in ("algorithm", "args", "env_id", "depth", "model") if k not in checkpoint]
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing}; it was not written by a FlexLoop script")
    checkpoint.setdefault("script", f"flexloop_{checkpoint['algorithm']}")  # one that names none: the original's
    if algorithm is not None and checkpoint["algorithm"] != algorithm:
        raise ValueError(f"checkpoint {path} is from {checkpoint['algorithm']!r}, not {algorithm!r}; use "
                         f"{checkpoint['script']}.py for it")
    return checkpoint


def slim_checkpoint(source, destination):
    """Copy a checkpoint with the network's weights alone, to share or commit it: the optimiser, the target network,
    any frozen helper network (pretrained_model, teacher_model) and an unfinished background evaluation's weights are
    left out, the run's flags, step counts, RNG state and last metrics kept. Evaluation and --init-checkpoint read it
    as they read the full one (GC-IQL's target critic then starts from the critic); --resume does not take it.
    Returns the parts left out that held something."""
    source, destination = Path(source), Path(destination)
    if destination.exists():
        if destination.resolve() == source.resolve():
            raise ValueError(f"{destination} is the checkpoint being slimmed; write the slim copy to another path, "
                             "so the full one (optimiser and target network, which resuming needs) is kept")
        raise FileExistsError(f"{destination} exists; remove it or choose another path")
    checkpoint = load_checkpoint(source)
    dropped = [key for key in checkpoint
               if key in ("optimizer", "unfinished_evaluation") or (key.endswith("_model") and key != "model")]
    destination.parent.mkdir(parents=True, exist_ok=True)
    save_checkpoint(destination, {key: value for key, value in checkpoint.items() if key not in dropped})
    return [key for key in dropped if checkpoint[key] is not None]  # a part the run did not use is saved as None


def on_this_device(state_dict, part):
    """An optimiser's state with this device's settings (Adam's capturable and fused flags), so that a run can move
    between a GPU and a CPU; any other part's state as it is."""
    if "param_groups" not in state_dict:
        return state_dict
    groups = [{**saved, **{key: now[key] for key in ("capturable", "fused") if key in now}}
              for saved, now in zip(state_dict["param_groups"], part.param_groups)]
    return {**state_dict, "param_groups": groups}


# ---------------------------------------------------------------------------------------------------------
# The script a checkpoint names. A checkpoint never chooses which code runs: only a file that is a FlexLoop
# script, which its text shows before anything is imported from it, is imported.
# ---------------------------------------------------------------------------------------------------------
FLEXLOOP_SCRIPT_LINE = re.compile(r'^FLEXLOOP_SCRIPT = "flexloop-script-v1"', re.MULTILINE)


def is_flexloop_script(path):
    """Whether `path` is a FlexLoop script, read as text (never imported): a .py file holding the line
    FLEXLOOP_SCRIPT = "flexloop-script-v1", which every flexloop_*.py (and so a copy of one) carries."""
    path = Path(path)
    try:
        text = path.read_text(errors="replace") if path.suffix == ".py" and path.is_file() else ""
        return FLEXLOOP_SCRIPT_LINE.search(text) is not None
    except OSError:
        return False


def find_script(name, checkpoint_path):
    """The file of the script a checkpoint names: <name>.py next to the checkpoint's run (in its folder or the two
    above it, where runs/ usually sits), else the module <name> on the import path (found, not imported)."""
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", str(name)):
        raise ValueError(f"checkpoint {checkpoint_path} names the script {name!r}, which is not a Python module name; "
                         "pass --script PATH to the FlexLoop script that wrote it")
    run = Path(checkpoint_path).resolve().parent
    for folder in (run, run.parent, run.parent.parent):
        if (folder / f"{name}.py").is_file():
            return folder / f"{name}.py"
    spec = importlib.machinery.PathFinder.find_spec(name)
    if spec is not None and spec.origin not in (None, "built-in", "frozen"):
        return Path(spec.origin)
    raise ModuleNotFoundError(f"checkpoint {checkpoint_path} was written by {name}.py, which is neither next to its "
                              f"run nor on the import path; pass --script PATH/TO/{name}.py")


def import_script(path):
    """The module of a FlexLoop script file. Anything else is refused before it is imported. A script that is
    already imported from the same file is that module; a copy with the same name is imported beside it."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"script {path} does not exist")
    if not is_flexloop_script(path):
        raise ValueError(f"{path} is not a FlexLoop script (a .py file with the line FLEXLOOP_SCRIPT = "
                         '"flexloop-script-v1"), so nothing was imported from it; use a flexloop_*.py or your copy of '
                         "one (eval_adaptive.py: --script PATH)")
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None and Path(getattr(loaded, "__file__", None) or "").resolve() == path:
        return loaded
    if loaded is not None:
        name = f"{name}__{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the script runs
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_any_checkpoint(path, script=None):
    """The module of the script that rebuilds a checkpoint's network (`script`, else the one the checkpoint names)
    and the checkpoint, checked to be of that script's algorithm."""
    checkpoint = load_checkpoint(path)
    module = import_script(script if script is not None else find_script(checkpoint["script"], path))
    return module, load_checkpoint(path, module.ALGORITHM)


# ---------------------------------------------------------------------------------------------------------
# The metrics log: runs/<run_name>/metrics.jsonl and TensorBoard events, always; W&B with --track
# ---------------------------------------------------------------------------------------------------------
def parses(line):
    """Whether a metrics.jsonl line is a whole JSON record: a kill mid-write can leave the last one cut short."""
    try:
        json.loads(line)
        return True
    except json.JSONDecodeError:
        return False


class MetricsLog:
    """runs/<name>/metrics.jsonl and TensorBoard events in runs/<name>/, always; W&B too when tracked. On resume,
    records past the checkpoint's step (written by the run that was killed) are dropped, so the file has no
    duplicate or missing steps."""

    def __init__(self, path, resume_step=None, wandb_run=None):
        from torch.utils.tensorboard import SummaryWriter

        self.path, self.wandb_run = Path(path), wandb_run
        if resume_step is not None and self.path.exists():
            kept = [line for line in self.path.read_text().splitlines()
                    if parses(line) and json.loads(line)["global_step"] <= resume_step]
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, self.path)
        self.file = open(self.path, "a")
        purge = None if resume_step is None else resume_step + 1  # TensorBoard hides the killed run's later points
        self.tensorboard = SummaryWriter(str(self.path.parent), purge_step=purge)

    def write(self, metrics, global_step):
        values = {name: value.item() if torch.is_tensor(value) else value for name, value in metrics.items()}
        record = {"global_step": global_step, **values}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        for name, value in record.items():
            if isinstance(value, (int, float)) and name != "global_step":  # bools too; not the phase's name
                self.tensorboard.add_scalar(name, value, global_step)
        self.tensorboard.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(record, step=global_step)
        return record

    def close(self):
        self.file.close()
        self.tensorboard.close()


def check_finite(metrics, updates):
    """Stop at a NaN or inf, naming the term: no checkpoint is written with weights it has reached."""
    for name, value in metrics.items():
        if torch.is_tensor(value) and not torch.isfinite(value).all():
            raise FloatingPointError(f"{name} became {value.item()} in the updates before update {updates}; "
                                     "stopping. The last checkpoint written (latest.pt) is from before this.")


def wandb_sync_command(wandb_run):
    """The command that uploads an offline W&B run, or None for an online one."""
    if wandb_run is None or wandb_run.settings.mode not in ("offline", "dryrun"):
        return None
    return f"wandb sync {os.path.relpath(Path(wandb_run.dir).parent)}"


# ---------------------------------------------------------------------------------------------------------
# RNG state, stop signals, CUDA graphs
# ---------------------------------------------------------------------------------------------------------
def rng_state(generators):
    state = {"python": random.getstate()[1], "numpy": np.random.get_state()[1].tolist(), "torch": torch.get_rng_state()}
    state.update({name: g.get_state() for name, g in generators.items()})
    return state


def set_rng_state(state, generators):
    random.setstate((3, tuple(state["python"]), None))
    np_state = np.random.get_state()
    np.random.set_state((np_state[0], np.array(state["numpy"], dtype=np.uint32), *np_state[2:]))
    torch.set_rng_state(state["torch"])
    moved = []
    for name, g in generators.items():
        if state[name].numel() == g.get_state().numel():
            g.set_state(state[name])
        else:  # saved on another kind of device (a GPU run resumed on a CPU, or back): that stream cannot go on here
            g.manual_seed(int(state[name].long().sum()))
            moved.append(name)
    if moved:
        say(f"note: the random streams {moved} were saved on another kind of device; they restart from a seed "
            "taken from the saved state, so the run goes on, but not draw for draw as it would have there")


class StopRequested(BaseException):
    """A stop (SIGTERM, Ctrl-C) inside an interruptible block: collection or evaluation, which change no weights.
    A BaseException, so that no `except Exception` on the way swallows it."""


class StopSignals:
    """SIGTERM (SLURM preemption, kill) and Ctrl-C ask the run to stop: it finishes the update in progress, or
    drops the collection or evaluation in progress, writes latest.pt, prints the command that resumes it and exits
    cleanly. A second Ctrl-C quits at once."""

    def __init__(self):
        self.reason, self.previous, self.interruptible = None, {}, False
        if threading.current_thread() is threading.main_thread():  # Python takes signals in the main thread only
            self.previous = {sig: signal.signal(sig, self.request) for sig in (signal.SIGTERM, signal.SIGINT)}

    def request(self, signum, frame):
        if self.reason is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.reason = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
        print(f"\n{self.reason}: stopping to write latest.pt (Ctrl-C again quits without it)", file=sys.stderr,
              flush=True)
        if self.interruptible:
            self.interruptible = False
            raise StopRequested(self.reason)

    def restore(self):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def capture_cuda_graph(fn, generators, pool=None, warmup=CUDA_GRAPH_WARMUP):
    """Record fn() in a CUDA graph and return a function that replays it and returns fn's (static) outputs.

    `warmup` calls run on a side stream first, as torch.cuda.graphs requires; they do real work (the capture itself
    runs nothing). One is enough for work without autograd (GC-PPO's rollout, whose one warm-up call is a real
    rollout of the run); updates take CUDA_GRAPH_WARMUP. The random
    generators fn draws from are registered, so every replay draws fresh numbers. `pool` shares memory between
    graphs that never replay at the same time (eval_adaptive.py's bucket sizes).

    Runs capture again mid-run (GC-DQN: each phase has its own update; eval_adaptive.py: new bucket sizes, after
    earlier checkpoints' graphs became garbage). On an H200 such captures failed (cudaErrorStreamCaptureImplicit,
    cudaErrorStreamCaptureInvalidated) with the default global capture mode and the garbage collector free to run
    inside a capture; collecting first, pausing the collector and a thread-local capture mode avoid it."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    for generator in generators:
        graph.register_generator_state(generator)
    collector_was_on = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            outputs = fn()
    finally:
        if collector_was_on:
            gc.enable()

    def replay():
        graph.replay()
        return outputs

    return replay


def duration(seconds):
    minutes, hours = seconds / 60, seconds / 3600
    return f"{hours / 24:.1f} days" if hours >= 48 else f"{hours:.1f} h" if minutes >= 90 else \
        f"{minutes:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


# ---------------------------------------------------------------------------------------------------------
# One training run
# ---------------------------------------------------------------------------------------------------------
class Run:
    """One training run's bookkeeping, in the order a script's train uses it:

        run = Run(script, args)    flags checked (a resumed run's own), checkpoints read, device, seeds; no files yet
        run.begin(...)             run folder, W&B, metrics log, state restored on --resume, stop signals, progress
        with run:                  closes the log, W&B and the progress bar whatever happens
            run.evaluate_unfinished_in_background(fn, ...)   if run.unfinished_evaluation: one a stop cut off
            while run.running():   until the last iteration, or a stop (SIGTERM, Ctrl-C)
                run.phase()                 (phase, lambda_depth) of this iteration
                with run.interruptible():   collection: a stop ends it at once
                run.update_steps(n)         the iteration's update loop; it ends early when a stop comes
                run.end_iteration()         the counters move on (False when a stop cut the updates short)
                run.log_due() / run.log(metrics), run.evaluate_due() / run.evaluate(fn, ...), run.save_due()
                run.evaluate_in_background(fn, ...) / run.log_background_evaluation(): training goes on meanwhile
            run.evaluate_if_owed(fn, ...)   a run stopped in its final evaluation, resumed, evaluates again
        run.finish()               final.pt and how to evaluate it, or latest.pt and the command that resumes the run

    `script` is the module of the script (sys.modules[__name__]): the names this module's docstring lists.
    Counters: `iteration` counts collect -> update rounds, `global_step` env steps (GC-IQL: updates), `updates`
    gradient steps; checkpoints and metrics use these names."""

    def __init__(self, script, args):
        self.script = script
        script.check_args(args)
        if args.save_every_minutes < 0:
            raise ValueError(f"--save-every-minutes must be >= 0 (0: never), got {args.save_every_minutes}")
        self.checkpoint = load_checkpoint(args.resume, script.ALGORITHM) if args.resume else None
        self.args = args = with_seed_in_paths(resumed_args(script, self.checkpoint, args) if self.checkpoint else args)
        self.init = None
        if args.init_checkpoint and self.checkpoint is None:
            self.init = load_checkpoint(args.init_checkpoint, script.ALGORITHM)
            check_compatible(script, self.init, args)
        self.device = pick_device(script, args)
        self.compile = args.compile and self.device.type == "cuda"  # on a CPU compiling does not pay
        self.cuda_graph = args.cuda_graph and self.device.type == "cuda"
        random.seed(args.seed)
        np.random.seed(args.seed)
        torch.manual_seed(args.seed)
        torch.backends.cudnn.deterministic = args.torch_deterministic
        torch.backends.cuda.matmul.allow_tf32 = True  # float32 matmuls in TF32 on a GPU, as JAX's default is there

    def begin(self, phases, parts, generators, loss_sums, steps_per_iteration, updates_per_iteration,
              progress="updates"):
        """phases: (name, iterations, lambda_depth) in order; parts: the CHECKPOINT_PARTS (modules, the optimiser;
        None where absent), read whenever a checkpoint is written; loss_sums: the LOSS_NAMES summed on the device
        since the last log; progress: what the progress bar counts, "updates" or "env steps"."""
        args, checkpoint, script = self.args, self.checkpoint, self.script
        self.phases = [p for p in phases if p[1] > 0]
        if not self.phases:
            raise ValueError("nothing to train: every phase has a budget of 0; raise the pretraining or the "
                             "post-training budget")
        self.total_iterations = sum(length for _, length, _ in self.phases)
        self.parts, self.generators, self.loss_sums = parts, generators, loss_sums
        self.steps_per_iteration, self.updates_per_iteration = steps_per_iteration, updates_per_iteration
        self.name = checkpoint["run_name"] if checkpoint else \
            f"{getattr(args, script.ENV_FLAG)}__{args.exp_name}__{args.seed}__{int(time.time())}"
        # A resumed run continues in the folder its checkpoint lies in, wherever that folder has moved.
        self.dir = Path(args.resume).resolve().parent if checkpoint else Path(args.run_dir) / self.name
        self.dir.mkdir(parents=True, exist_ok=True)
        if not os.access(self.dir, os.W_OK):
            raise PermissionError(f"run folder {self.dir} is not writable; point --run-dir at a writable folder")
        self.iteration = self.global_step = self.updates = self.iteration_updates = 0
        self.last_metrics, self.wandb_id = {}, None
        self.background = None  # evaluate_in_background's thread, outcome, step and iteration evaluated, weights
        if checkpoint is not None:
            for name, part in parts.items():
                if part is not None and checkpoint.get(name) is not None:
                    part.load_state_dict(on_this_device(checkpoint[name], part))
            set_rng_state(checkpoint["rng"], generators)
            self.iteration, self.global_step, self.updates = (checkpoint[k] for k in ("iteration", "global_step",
                                                                                       "updates"))
            self.iteration_updates = checkpoint["iteration_updates"]
            self.last_metrics, self.wandb_id = checkpoint.get("metrics", {}), checkpoint.get("wandb_id")
            say(f"resuming {self.name} at iteration {self.iteration}/{self.total_iterations}, update {self.updates} "
                "(what checkpoints do not hold starts afresh: the replay refills, the envs start new episodes)")
        # A stop during a background evaluation leaves its weights in latest.pt, to be evaluated when resumed.
        self.unfinished_evaluation = checkpoint.get("unfinished_evaluation") if checkpoint else None
        # A run stopped after its last update was stopped in its final evaluation: resumed, it evaluates again, once
        # (a finished run's folder holds final.pt; resuming its latest.pt re-evaluates nothing).
        self.final_evaluation_owed = (checkpoint is not None and self.iteration == self.total_iterations
                                      and not (self.dir / "final.pt").exists() and self.unfinished_evaluation is None)
        self.wandb_run = None
        if args.track:  # W&B keeps its files in ./wandb (or $WANDB_DIR), where `wandb sync` looks
            import wandb
            self.wandb_run = wandb.init(project=args.wandb_project_name, entity=args.wandb_entity,
                                        group=args.wandb_group, tags=list(args.wandb_tags), config=asdict(args),
                                        name=self.name, id=self.wandb_id, resume="allow", save_code=True)
            self.wandb_id = self.wandb_run.id
        self.metrics_log = MetricsLog(self.dir / "metrics.jsonl", self.global_step if checkpoint else None,
                                      self.wandb_run)
        self.stop = StopSignals()
        self.progress_unit = progress
        per_iteration = updates_per_iteration if progress == "updates" else steps_per_iteration
        done = self.updates if progress == "updates" else self.global_step
        self.progress = tqdm(total=self.total_iterations * per_iteration, initial=done, desc=self.name,
                             unit=" " + progress, dynamic_ncols=True)
        self.started = self.last_save = self.clock = time.perf_counter()
        self.first_tick, self.projected, self.first_iteration = None, False, self.iteration
        self.train_seconds, self.logged = 0.0, (self.global_step, self.updates)
        return self

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        """Whatever happens: the progress bar, the metrics log and W&B closed, the signal handlers given back. A
        stop inside an interruptible block ends the loop here, and finish() writes latest.pt."""
        self.progress.close()
        self.metrics_log.close()
        self.stop.restore()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        return kind is not None and issubclass(kind, StopRequested)

    @contextlib.contextmanager
    def interruptible(self):
        """A block that a stop (SIGTERM, Ctrl-C) ends at once instead of at its end: collection and evaluation,
        which change no weights, so latest.pt holds the weights of the last whole update. A CPU episode can take
        minutes; a stop must act within seconds."""
        if self.stop.reason is not None:
            raise StopRequested(self.stop.reason)
        self.stop.interruptible = True
        try:
            yield
        finally:
            self.stop.interruptible = False

    def phase_of(self, iteration):
        start = 0
        for name, length, lambda_depth in self.phases:
            if iteration < start + length:
                return name, lambda_depth
            start += length
        return self.phases[-1][0], self.phases[-1][2]

    def phase(self):
        return self.phase_of(self.iteration)

    def running(self):
        return self.iteration < self.total_iterations and self.stop.reason is None

    def compiled(self, fn):
        """fn compiled by torch.compile with --compile on a GPU, fn itself otherwise. --combo-kernels, where a
        script has it, turns on inductor's combo kernels (independent kernels fused side by side)."""
        if not self.compile:
            return fn
        if getattr(self.args, "combo_kernels", False):
            torch._inductor.config.combo_kernels = True
        return torch.compile(fn)

    def graphed(self, fn, generators, *args):
        """fn(*args) replayed from a CUDA graph with --cuda-graph on a GPU, eager otherwise."""
        fn = partial(fn, *args)
        return capture_cuda_graph(fn, generators) if self.cuda_graph else fn

    def graphed_update(self, update, generators):
        """The update replayed from a CUDA graph (see graphed); the capture's warm-up updates are counted."""
        if self.cuda_graph:
            self.updates += CUDA_GRAPH_WARMUP
        return self.graphed(update, generators)

    def update_steps(self, count):
        """range(count) for an iteration's update loop. It ends early, within one update, when a stop comes, and
        skips the updates that a stopped iteration had done before it was resumed. Counts each update, moves the
        progress bar and writes latest.pt every --save-every-minutes."""
        for i in range(self.iteration_updates, count):
            if self.stop.reason is not None:
                return
            yield i
            self.updates += 1
            self.iteration_updates += 1
            self.tick(1 if self.progress_unit == "updates" else 0)
            if 0 < self.args.save_every_minutes <= (time.perf_counter() - self.last_save) / 60:
                self.save("latest.pt")

    def end_iteration(self):
        """The counters move on to the next iteration; False (and they stay) when a stop cut the updates short."""
        if self.iteration_updates < self.updates_per_iteration:
            return False
        self.iteration += 1
        self.global_step += self.steps_per_iteration
        self.iteration_updates = 0
        self.tick(self.steps_per_iteration if self.progress_unit == "env steps" else 0)
        return True

    def tick(self, amount):
        """The progress bar, and once, after a measured stretch, the projected time of the whole run."""
        self.progress.update(amount)
        now = time.perf_counter()
        if self.first_tick is None and self.progress.n > self.progress.initial:
            self.first_tick = (now, self.progress.n)
        elif self.first_tick is not None and not self.projected and self.progress.n > self.first_tick[1]:
            measured = now - self.first_tick[0]
            # the host runs ahead of a GPU until its launch queue fills (and GC-IQL's iteration is a single
            # update), so a GPU run measures 30 s; on a CPU the host's pace is the run's, and two iterations do
            if self.device.type == "cuda":
                long_enough = measured >= 30
            else:
                long_enough = measured >= 15 or self.iteration - self.first_iteration >= 2
            if not long_enough:
                return
            rate = (self.progress.n - self.first_tick[1]) / measured
            left = (self.progress.total - self.progress.n) / rate
            say(f"projected: {duration(now - self.started + left)} for the whole run, "
                f"{duration(left)} left ({rate:.3g}{self.progress.unit}/s on {self.device.type})"
                + (f"; for a CPU run that finishes in minutes see {CPU_HELP}"
                   if self.device.type == "cpu" and left > 3600 else ""))
            self.projected = True

    def due(self, every):
        return self.iteration % every == 0 or self.iteration == self.total_iterations

    def phase_ends(self):
        return self.phase_of(self.iteration - 1)[0] != self.phase_of(self.iteration)[0]

    def log_due(self):
        return self.due(self.args.log_every)

    def evaluate_due(self):
        return self.due(self.args.eval_every) or self.phase_ends()

    def log(self, metrics):
        """The loss means since the last log, the counters, speed and the given metrics: metrics.jsonl,
        TensorBoard and W&B."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.train_seconds += now - self.clock
        steps, updates = self.global_step - self.logged[0], self.updates - self.logged[1]
        loss_names = self.script.LOSS_NAMES
        metrics = {"phase": self.phase_of(self.iteration - 1)[0], "charts/iteration": self.iteration,
                   "charts/updates": self.updates, **dict(zip(loss_names, self.loss_sums / max(updates, 1))),
                   "charts/SPS": int(steps / max(self.train_seconds, 1e-9)),
                   "charts/updates_per_second": updates / max(self.train_seconds, 1e-9), **metrics}
        check_finite({name: metrics[name] for name in loss_names}, self.updates)
        self.loss_sums.zero_()
        self.last_metrics = self.metrics_log.write(metrics, self.global_step)
        self.progress.set_postfix({name.split("/")[-1]: f"{self.last_metrics[name]:.3g}" for name in loss_names[:2]})
        self.train_seconds, self.logged, self.clock = 0.0, (self.global_step, self.updates), time.perf_counter()

    def evaluate(self, evaluate, *args, **kwargs):
        """evaluate(*args, **kwargs) -> {metric: value}, logged and printed; its time is not training time (SPS).
        A stop ends it at once (it changes no weights)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        self.train_seconds += time.perf_counter() - self.clock
        with self.interruptible():
            results = evaluate(*args, **kwargs)
        self.record_evaluation({"phase": self.phase_of(self.iteration - 1)[0], **results}, self.iteration)
        self.clock = time.perf_counter()
        return results

    def evaluate_if_owed(self, evaluate, *args, **kwargs):
        """evaluate as Run.evaluate does, in a run resumed after a stop in its final evaluation; else nothing."""
        if self.final_evaluation_owed:
            self.evaluate(evaluate, *args, **kwargs)

    def evaluate_in_background(self, evaluate, model, *args, **kwargs):
        """evaluate(model, *args, **kwargs) in a thread while training goes on, one at a time (the last one is logged
        first, waited for if it still runs). `model` is a copy of the weights, which training must not change under
        it; a checkpoint written while the evaluation runs holds them (see evaluate_unfinished_in_background). It is
        logged when it ends (log_background_evaluation), with charts/evaluated_step, the step it evaluated, which
        W&B plots its eval/* against."""
        self.log_background_evaluation(wait=True)
        taken = {"phase": self.phase_of(self.iteration - 1)[0], "charts/evaluated_step": self.global_step}
        self.start_background(evaluate, model, args, kwargs, taken, self.iteration)

    def evaluate_unfinished_in_background(self, evaluate, model, *args, **kwargs):
        """In a run resumed from a checkpoint written during a background evaluation (a stop, or a periodic save):
        that evaluation again, of the same weights, loaded into `model`, and logged with the step they were taken
        at. Call it before the training loop, once run.unfinished_evaluation says there is one. The thread starts
        at the next log_background_evaluation, after the loop's first update: compiling that update traces every
        module call, and an evaluation running meanwhile failed (an H100, 2026-12-07: "module is not installed as
        a submodule")."""
        unfinished, self.unfinished_evaluation = self.unfinished_evaluation, None
        model.load_state_dict(unfinished["weights"])
        self.start_background(evaluate, model, args, kwargs, unfinished["taken"], unfinished["iteration"],
                              start=False)

    def start_background(self, evaluate, model, args, kwargs, taken, iteration, start=True):
        """The thread of a background evaluation, whose record will carry `taken`; started now, or (start=False)
        by the next log_background_evaluation."""
        if self.wandb_run is not None:
            self.wandb_run.define_metric("eval/*", step_metric="charts/evaluated_step")
        outcome = {}

        def evaluate_apart():
            try:
                outcome["results"] = evaluate(model, *args, **kwargs)
            except BaseException as error:  # raised again in the training loop
                outcome["error"] = error

        thread = threading.Thread(target=evaluate_apart, name="evaluation", daemon=True)
        if start:
            thread.start()
        self.background = (thread, outcome, taken, iteration, model)

    def log_background_evaluation(self, wait=False):
        """The background evaluation's metrics, logged once it has ended (with wait, once it ends); an error in it is
        raised here, except in a stopped run. A stopped run does not wait: its last evaluation goes unlogged, and
        latest.pt keeps its weights to evaluate when resumed."""
        if self.background is None:
            return
        thread, outcome, taken, iteration, _ = self.background
        if thread.ident is None:  # queued by evaluate_unfinished_in_background
            thread.start()
        if thread.is_alive() and not wait:
            return
        thread.join()
        if "error" in outcome:
            if self.stop.reason is not None:  # the stop's SIGTERM ended the evaluation's env workers too (one
                return                        # process group); raising would lose the latest.pt it is writing
            raise outcome["error"]
        self.background = None
        self.record_evaluation({**taken, **outcome["results"]}, iteration)

    def record_evaluation(self, results, iteration):
        """An evaluation's metrics (of the weights after `iteration` iterations): logged at the current step and
        printed."""
        self.last_metrics.update(self.metrics_log.write(results, self.global_step))
        say(self.script.format_eval(results, self.args, iteration))

    def save_due(self):
        """pretrained.pt when pretraining ends; latest.pt every --save-every iterations and at the end."""
        if self.phase_of(self.iteration - 1)[0] == "pretrain" and self.phase_ends():
            self.save("pretrained.pt")  # the IRU-K baseline
        if self.due(self.args.save_every):
            self.save("latest.pt")

    def save(self, name):
        """A checkpoint: everything that evaluating or resuming this run needs, written atomically."""
        script = self.script
        check_finite(dict(zip(script.LOSS_NAMES, self.loss_sums)), self.updates)  # never save weights a NaN reached
        save_checkpoint(self.dir / name, {
            "format": CHECKPOINT_FORMAT, "algorithm": script.ALGORITHM, "script": script_name(script),
            "args": asdict(self.args), "env_id": getattr(self.args, script.ENV_FLAG), "depth": self.args.depth,
            "run_name": self.name, "phase": self.phase_of(max(self.iteration - 1, 0))[0],
            "iteration": self.iteration, "iteration_updates": self.iteration_updates,
            "global_step": self.global_step, "updates": self.updates, "rng": rng_state(self.generators),
            "metrics": self.last_metrics, "wandb_id": self.wandb_id, "unfinished_evaluation": self.unfinished(),
            **{name: None if part is None else part.state_dict() for name, part in self.parts.items()}})
        self.last_save = time.perf_counter()

    def unfinished(self):
        """The background evaluation not yet logged, for a checkpoint: the step and iteration, and the weights."""
        if self.background is None:
            return None
        _, _, taken, iteration, model = self.background
        return {"taken": taken, "iteration": iteration, "weights": model.state_dict()}

    def finish(self):
        """final.pt and the command that evaluates it when the run is complete; when it was stopped, latest.pt and
        the command that resumes it. The checkpoint is written before anything is printed."""
        sync = wandb_sync_command(self.wandb_run)
        if self.stop.reason is None:
            self.save("final.pt")
            checkpoints = [self.dir / name for name in ("pretrained.pt", "final.pt") if (self.dir / name).exists()]
            say(f"finished: {self.dir / 'final.pt'}\nevaluate it (success at every depth, adaptive depth, plots):\n"
                f"    python {shown_path(EVALUATOR)} --checkpoints {' '.join(map(str, checkpoints))}")
        else:
            self.save("latest.pt")
            say(f"{self.stop.reason}: saved {self.dir / 'latest.pt'} at iteration {self.iteration} (update "
                f"{self.updates}); resume with\n    python {shown_path(self.script.__file__)} --resume "
                f"{self.dir / 'latest.pt'}", file=sys.stderr)
        if sync:
            say(f"W&B ran offline; upload the run with\n    {sync}")
        return self.dir


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(prog="python flexloop_run.py", description="checkpoint tools")
    commands = parser.add_subparsers(dest="command", required=True)
    slim = commands.add_parser("slim", help=slim_checkpoint.__doc__.split(":")[0],
                               description=slim_checkpoint.__doc__.split(" Returns")[0])
    slim.add_argument("source", help="a checkpoint written by a FlexLoop script (final.pt, latest.pt, pretrained.pt)")
    slim.add_argument("destination", help="where to write the slim copy (must not exist)")
    cli = parser.parse_args()
    with errors_in_one_line():
        left_out = slim_checkpoint(cli.source, cli.destination)
        say(f"wrote {cli.destination} ({Path(cli.destination).stat().st_size / 1e6:.1f} MB, from "
            f"{Path(cli.source).stat().st_size / 1e6:.1f} MB); left out: {', '.join(left_out) or 'nothing'}")
