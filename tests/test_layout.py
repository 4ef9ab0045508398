"""One layout for the three scripts and the first hour of a user: the run plumbing lives in flexloop_run.py and no
module imports an entry point for its helpers, a copied and changed script runs end to end and eval_adaptive.py
evaluates it with the copy's own network, a checkpoint never chooses which code runs, Ctrl-C saves and resumes, and
errors end in one line without a traceback."""

import ast
import dataclasses
import inspect
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import eval_adaptive as ea
import flexloop_run
from conftest import PYTHONPATH, TINY_DQN, flags
import flexloop_gcdqn as gcdqn
import flexloop_gciql as gciql
import flexloop_gcppo as gcppo
import iru_pretrain

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {"gcdqn": gcdqn, "gcppo": gcppo, "gciql": gciql}
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": PYTHONPATH, "COLUMNS": "400"}
ENV.pop("FLEXLOOP_DEBUG", None)


def run(command, cwd=ROOT, timeout=180, env=ENV):
    return subprocess.run([sys.executable, *map(str, command)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dqn_run(tmp_path_factory):
    """A tiny GC-DQN run: pretrained.pt, latest.pt and final.pt."""
    return gcdqn.train(gcdqn.Args(**TINY_DQN, run_dir=str(tmp_path_factory.mktemp("runs"))))


# ---------------------------------------------------------------------------------------------------------
# The layout
# ---------------------------------------------------------------------------------------------------------
ENTRY_POINTS = {"flexloop_gcdqn", "flexloop_gcppo", "flexloop_gciql", "eval_adaptive", "iru_pretrain"}


def imported_modules(path):
    """The top-level modules a Python file imports, read from its syntax tree."""
    names = set()
    for node in ast.walk(ast.parse(Path(path).read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("name", [*SCRIPTS, "eval_adaptive", "iru_pretrain"])
def test_the_scripts_and_the_tools_take_their_run_plumbing_from_flexloop_run(name):
    module = SCRIPTS.get(name) or {"eval_adaptive": ea, "iru_pretrain": iru_pretrain}[name]
    assert "flexloop_run" in imported_modules(module.__file__)
    if name in SCRIPTS:
        assert "flexloop_run.Run(sys.modules[__name__], args)" in inspect.getsource(module.train)
        assert not hasattr(module, "save_checkpoint") and not hasattr(module, "Run")  # one home for the plumbing


def test_no_module_imports_an_entry_point_except_the_benchmarks():
    """Entry points (the scripts, the evaluator, iru_pretrain.py) are run, not imported for their helpers: the
    shared code sits in flexloop_run.py and envs/. bench/ may import a script to time its functions, and tests may
    import anything."""
    sources = [*ROOT.glob("*.py"), *ROOT.glob("envs/*.py")]
    importers = {path.relative_to(ROOT).as_posix(): sorted(imported_modules(path) & ENTRY_POINTS) for path in sources}
    assert {path: names for path, names in importers.items() if names} == {}
    assert "flexloop_run" in imported_modules(ROOT / "iru_pretrain.py")


@pytest.mark.skipif(subprocess.run(["which", "diff"], capture_output=True).returncode != 0, reason="needs GNU diff")
def test_a_diff_of_gcdqn_and_gcppo_shows_at_most_48_hunks():
    """The two scripts differ by their algorithms, not by their bookkeeping (110 hunks on 2026-11-20, before the
    scripts shared one order and vocabulary; 44 on 2026-12-01, then GC-PPO's captured evaluation added one, and
    GC-PPO's --fused-iru one more on 2026-12-04, and its rollout step, a function of its own for
    --compile-env-step, one more: diff aligns a few of its lines with GC-DQN's episode loop)."""
    diff = subprocess.run(["diff", "flexloop_gcdqn.py", "flexloop_gcppo.py"], cwd=ROOT, capture_output=True,
                          text=True).stdout
    hunks = [line for line in diff.splitlines() if line[:1].isdigit()]
    assert len(hunks) <= 48, f"{len(hunks)} hunks: keep the shared parts of the two scripts in one order and wording"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_sections_come_in_design_md_order_and_train_is_short(name):
    source = Path(SCRIPTS[name].__file__).read_text()
    marks = ["\nclass ExperimentArgs:", "\nclass Args(", "\ndef check_args(", "\n# ALGO LOGIC: network\n",
             "\ndef build_network(", "\ndef network_from_checkpoint(", "\n# ALGO LOGIC: losses\n", "\nLOSS_NAMES = (",
             "\ndef flexloop_losses(", "\n# ALGO LOGIC: data\n", "\n# Collection and per-depth evaluation",
             "\ndef evaluate(", "\ndef train(",
             '\nif __name__ == "__main__":']
    positions = [source.find(mark) for mark in marks]
    assert all(p >= 0 for p in positions), [m for m, p in zip(marks, positions) if p < 0]
    assert positions == sorted(positions), "sections out of DESIGN.md's order"
    assert len(inspect.getsource(SCRIPTS[name].train).splitlines()) <= 80


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_loss_terms_are_keyed_by_loss_names(name):
    module = SCRIPTS[name]
    assert len(set(module.LOSS_NAMES)) == len(module.LOSS_NAMES) and "losses/depth_kl" in module.LOSS_NAMES
    if name == "gciql":  # its losses come in three branches, joined by sum_branches
        assert 'return loss, {name: terms[name] for name in LOSS_NAMES}' in inspect.getsource(module.sum_branches)
    else:
        assert 'return loss, dict(zip(LOSS_NAMES,' in inspect.getsource(module.flexloop_losses)


def test_help_shows_the_groups_and_the_flags_stay_flat():
    out = run(["flexloop_gcppo.py", "--help"])
    assert out.returncode == 0, out.stderr
    for group in ["experiment", "environment", "network", "algorithm", "flexloop", "evaluation", "performance"]:
        assert f"{group} options" in out.stdout
    args = flexloop_run.parse_args(gcdqn.Args, ["--lambda-depth", "0.3", "--num_envs", "16", "--no-cuda", "--wandb-tags", "a", "b"])
    assert isinstance(args, gcdqn.Args) and (args.lambda_depth, args.num_envs, args.cuda) == (0.3, 16, False)
    assert args.wandb_tags == ("a", "b") and args.exp_name == "flexloop_gcdqn"


# ---------------------------------------------------------------------------------------------------------
# Copy and modify: the copy's checkpoints are rebuilt by the copy, and a checkpoint never chooses the code
# ---------------------------------------------------------------------------------------------------------
COPY_CHANGE = '''
# The copy's change: its Q-values read a zeroed feature, so every state gets the same Q-values, the head's bias.
_readout = IRUNetwork.readout


def zeroed_readout(self, state):
    return 0.0 * _readout(self, state)


IRUNetwork.readout = zeroed_readout
'''


def test_a_copied_and_changed_script_runs_end_to_end_and_is_evaluated_with_its_own_network(tmp_path):
    source = (ROOT / "flexloop_gcdqn.py").read_text()
    main = '\nif __name__ == "__main__":'
    assert source.count(main) == 1 and source.count('\nALGORITHM = "gcdqn"\n') == 1
    source = source.replace('\nALGORITHM = "gcdqn"\n', '\nALGORITHM = "my_gcdqn"\n')  # renamed too: still evaluated
    (tmp_path / "my_gcdqn.py").write_text(source.replace(main, COPY_CHANGE + main))

    trained = run(["my_gcdqn.py", *flags(TINY_DQN), "--run-dir", "runs"], cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.split("__")[1] == "my_gcdqn"  # exp_name defaults to the script's name
    final = torch.load(run_dir / "final.pt", weights_only=True)
    assert final["script"] == "my_gcdqn" and final["algorithm"] == "my_gcdqn"

    module, checkpoint = flexloop_run.load_any_checkpoint(run_dir / "final.pt")  # found next to the run, not on the path
    assert Path(module.__file__).resolve() == (tmp_path / "my_gcdqn.py").resolve()
    network, _ = module.network_from_checkpoint(checkpoint)
    obs = torch.randint(0, 12, (2, 36), generator=torch.Generator().manual_seed(0))
    goal = torch.randint(0, 12, (2, 36), generator=torch.Generator().manual_seed(1))
    copy_logits = network.decide(network.advance(network.start(obs, goal)))
    torch.testing.assert_close(copy_logits[0], copy_logits[1])  # the copy's readout: one answer for every state
    original, _ = gcdqn.network_from_checkpoint({**checkpoint, "args": {**checkpoint["args"],
                                                                       "exp_name": "flexloop_gcdqn"}})
    original_logits = original.decide(original.advance(original.start(obs, goal)))
    assert not torch.allclose(original_logits[0], original_logits[1])  # the original's differ with the state

    evaluated = run(["eval_adaptive.py", "--no-cuda", "--checkpoints", run_dir / "final.pt", "--num-eval-envs", "4",
                     "--eps", "0", "0.01", "--out-dir", tmp_path / "out"], timeout=300)
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert f"network from {(tmp_path / 'my_gcdqn.py').resolve()}" in evaluated.stdout
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert results["checkpoints"][0]["algorithm"] == "my_gcdqn"

    pretrained = iru_pretrain.main(tmp_path / "my_gcdqn.py", module.Args(**{**TINY_DQN, "run_dir": str(tmp_path)}))
    assert torch.load(pretrained / "final.pt", weights_only=True)["script"] == "my_gcdqn"


def test_a_checkpoint_naming_a_module_that_is_not_a_flexloop_script_is_refused_before_it_is_imported(tmp_path,
                                                                                                    dqn_run):
    imported = tmp_path / "imported.txt"
    (tmp_path / "not_flexloop.py").write_text(f"open({str(imported)!r}, 'w').write('this ran')\n"
                                              "def network_from_checkpoint(checkpoint, device='cpu'):\n"
                                              "    raise SystemExit('this ran too')\n")
    run_dir = tmp_path / "runs" / "stranger"
    run_dir.mkdir(parents=True)
    checkpoint = torch.load(dqn_run / "final.pt", weights_only=True)
    for name, message in [("not_flexloop", "is not a FlexLoop script"), ("json", "is not a FlexLoop script"),
                          ("../not_flexloop", "not a Python module name")]:
        torch.save({**checkpoint, "script": name}, run_dir / f"{len(name)}.pt")
        with pytest.raises(ValueError, match=message):
            flexloop_run.load_any_checkpoint(run_dir / f"{len(name)}.pt")
    with pytest.raises(ValueError, match="is not a FlexLoop script"):
        flexloop_run.load_any_checkpoint(dqn_run / "final.pt", script=tmp_path / "not_flexloop.py")  # --script is checked too
    refused = run(["iru_pretrain.py", tmp_path / "not_flexloop.py", "--no-cuda"])
    assert refused.returncode == 1 and "is not a FlexLoop script" in refused.stderr
    assert not imported.exists() and "not_flexloop" not in sys.modules


# ---------------------------------------------------------------------------------------------------------
# Stopping and resuming
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_ctrl_c_saves_latest_prints_the_resume_command_and_the_run_resumes_to_completion(tmp_path):
    """Ctrl-C (SIGINT) mid-iteration: the run stops within an update, writes latest.pt as SIGTERM does, prints how
    to resume and exits 0 without a traceback; the printed command finishes the run with every planned update.
    --save-every-minutes writes latest.pt between updates meanwhile."""
    values = {**TINY_DQN, "updates_per_rollout": 400, "pretrain_epochs": 1, "num_epochs": 0, "eval_every": 100,
              "save_every": 100, "save_every_minutes": 0.002}  # 2 iterations of 400 updates; a timer save every 0.12 s
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        command = [sys.executable, "flexloop_gcdqn.py", *flags(values), "--run-dir", str(tmp_path / "runs")]
        process = subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while not list((tmp_path / "runs").glob("*/latest.pt")):  # the timer's first save, within iteration 1
            assert process.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.05)
        timer_save = torch.load(next((tmp_path / "runs").glob("*/latest.pt")), weights_only=True)
        assert timer_save["iteration"] == 0 and timer_save["iteration_updates"] > 0
        process.send_signal(signal.SIGINT)
        start = time.time()
        assert process.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        assert time.time() - start < 10  # within an update or so, not at the end of the iteration
    output = log_path.read_text()
    assert "Traceback" not in output and "KeyboardInterrupt" not in output
    assert "running on the CPU" in output and "Ctrl-C: saved" in output
    (run_dir,) = (tmp_path / "runs").iterdir()
    stopped = flexloop_run.load_checkpoint(run_dir / "latest.pt")
    assert stopped["iteration"] < 2 and not (run_dir / "final.pt").exists()
    command = re.search(r"resume with\n\s+python (.+)", output).group(1)
    assert command.endswith(f"--resume {run_dir / 'latest.pt'}")

    resumed = run(shlex.split(command), timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = flexloop_run.load_checkpoint(run_dir / "final.pt")
    assert (final["iteration"], final["updates"]) == (2, 800)  # every planned update, none twice


def test_the_device_is_named_and_gpu_sized_flags_on_a_cpu_point_to_the_readme(capsys):
    assert flexloop_run.pick_device(gcdqn, gcdqn.Args(cuda=False)).type == "cpu"
    out = capsys.readouterr().out
    assert "running on the CPU" in out and "--num-envs 1024" in out and 'README.md, "On a CPU"' in out
    assert "## On a CPU" in (ROOT / "README.md").read_text()
    flexloop_run.pick_device(gcdqn, gcdqn.Args(**TINY_DQN))
    assert "warning" not in capsys.readouterr().out


def test_the_projected_time_is_printed_after_the_first_measured_iterations(tmp_path, capsys):
    gcdqn.train(gcdqn.Args(**TINY_DQN, run_dir=str(tmp_path)))
    assert re.search(r"projected: .+ for the whole run, .+ left \(.+ updates/s on cpu\)", capsys.readouterr().out)


# ---------------------------------------------------------------------------------------------------------
# Errors and help: one line, no traceback, unless --debug
# ---------------------------------------------------------------------------------------------------------
class CallsPrint:
    def __reduce__(self):
        return print, ("this ran",)


def test_errors_raised_on_purpose_are_one_line_and_debug_shows_the_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("FLEXLOOP_DEBUG", raising=False)
    (tmp_path / "notes.txt").write_text("not a checkpoint\n")
    torch.save({"format": flexloop_run.CHECKPOINT_FORMAT, "model": {"w": CallsPrint()}}, tmp_path / "hostile.pt")
    cases = [(gcdqn, ["--env-id", "Nope-v0"], "--env-id 'Nope-v0' is not an env of gcdqn"),
             (gcppo, ["--depth", "1"], "--depth must be at least 2"),
             (gcdqn, ["--resume", tmp_path / "notes.txt"], "is a text file, not a FlexLoop checkpoint"),
             (gcdqn, ["--init-checkpoint", tmp_path / "hostile.pt", "--no-cuda"], "because it can run code when loaded"),
             (ea, ["--checkpoints", tmp_path / "missing.pt", "--no-cuda"], "does not exist")]
    for module, argv, message in cases:  # in this process, as each script's __main__ runs them
        main = module.main if module is ea else module.train
        with pytest.raises(SystemExit) as exit, flexloop_run.errors_in_one_line():
            main(flexloop_run.parse_args(module.Args, [*map(str, argv), "--run-dir" if module is not ea else
                                                       "--out-dir", str(tmp_path / "out")]))
        out = capsys.readouterr()
        assert exit.value.code == 1 and message in out.err and len(out.err.strip().splitlines()) == 1, out.err
        assert "this ran" not in out.out and "Traceback" not in out.err and "weights_only" not in out.err
    monkeypatch.setenv("FLEXLOOP_DEBUG", "1")
    with pytest.raises(ValueError, match="is not an env of gcdqn"), flexloop_run.errors_in_one_line():
        gcdqn.train(gcdqn.Args(env_id="Nope-v0"))
    # and as a user sees them: one line, exit status 1; --debug shows the traceback
    out = run(["flexloop_gcdqn.py", "--env-id", "Nope-v0"])
    assert out.returncode == 1 and out.stderr.strip().splitlines() == [
        "flexloop_gcdqn.py: error: --env-id 'Nope-v0' is not an env of gcdqn; choose one of "
        f"{list(gcdqn.ENV_IDS)}  (--debug shows the traceback)"], out.stderr
    debug = run(["flexloop_gcdqn.py", "--env-id", "Nope-v0", "--debug"])
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_iru_pretrain_help_exits_0_and_shows_the_values_it_really_uses(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    for argv in (["--help"], ["gcdqn", "--help"]):
        with pytest.raises(SystemExit) as exit:
            iru_pretrain.cli(argv)
        assert exit.value.code == 0
    out = capsys.readouterr().out
    assert "gcdqn" in out and "PATH.py" in out
    assert re.search(r"--lambda-depth FLOAT\s+weight of the adjacent-depth KL.*\(default: 0\.0\)", out)
    assert re.search(r"--num-epochs INT\s+FlexLoop post-training epochs \(default: 0\)", out)
    assert "(default: iru_pretrain_gcdqn)" in out
    refused = run(["iru_pretrain.py", "gcdqn", "--num-epochs", "3"])
    assert refused.returncode == 1 and "iru_pretrain.py fixes --num-epochs" in refused.stderr
    assert iru_pretrain.pretrain_default(gciql).lambda_depth == 0.0
    assert dataclasses.asdict(iru_pretrain.pretrain_args(gcppo.Args()))["total_timesteps"] == 0


@pytest.mark.parametrize("path", sorted(ROOT.glob("checkpoints/*/latest.pt")) or [None])
def test_every_long_run_checkpoint_in_checkpoints_resumes(path):
    """A run in progress continues from checkpoints/<run_name>/latest.pt: each one must load into its own script's
    network and optimiser."""
    if path is None:
        pytest.skip("no latest.pt in checkpoints/")
    module = {"gcdqn": gcdqn, "gcppo": gcppo, "gciql": gciql}[flexloop_run.read_checkpoint_file(path)["algorithm"]]
    checkpoint = flexloop_run.load_checkpoint(path)
    args = flexloop_run.resumed_args(module, checkpoint, module.Args(resume=str(path)))
    network = module.build_network(args, "cpu")
    network.load_state_dict(checkpoint["model"])
    torch.optim.Adam(network.parameters()).load_state_dict(checkpoint["optimizer"])
    assert checkpoint["iteration"] > 0 and checkpoint["script"] == flexloop_run.script_name(module)


def test_no_module_of_ours_shadows_the_standard_library():
    """A script's folder is the first entry of sys.path when it runs, so bench/concurrent.py would break every
    bench that imports torch (which imports concurrent.futures)."""
    ours = [path for folder in (ROOT, ROOT / "bench", ROOT / "envs", ROOT / "tests") for path in folder.glob("*.py")]
    assert ours
    shadowing = sorted(str(path.relative_to(ROOT)) for path in ours if path.stem in sys.stdlib_module_names)
    assert not shadowing, f"rename {shadowing}: each hides the standard-library module of its name"
