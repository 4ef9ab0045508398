"""Tests run tiny networks, for which one CPU thread per process is fastest (several threads contend on the
small CI machine); subprocesses started by tests inherit the setting."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402

# For subprocesses that import the repo: its root first, then any path the caller set (packages installed with
# pip --target), which a plain "PYTHONPATH": ROOT would drop.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTHONPATH = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))

# A GC-DQN run of a few seconds on a CPU: pretraining, then FlexLoop (test_layout.py, test_run.py)
TINY_DQN = dict(num_envs=8, batch_size=8, updates_per_rollout=2, intervals_per_epoch=2, pretrain_epochs=1,
                num_epochs=1, hidden_dim=16, eval_every=2, num_eval_envs=4, log_every=1, save_every=1,
                episode_length=10, replay_episodes=2, cuda=False)


def flags(values):
    """Args field values as command-line flags: {"num_envs": 8, "cuda": False} -> --num-envs 8 --no-cuda."""
    out = []
    for key, value in values.items():
        name = key.replace("_", "-")
        out += ([f"--{name}" if value else f"--no-{name}"] if isinstance(value, bool) else [f"--{name}", str(value)])
    return out


@pytest.fixture
def no_torch_compile(monkeypatch):
    """Fail the test if anything calls torch.compile: a CPU run must ignore the scripts' --compile default."""
    def no_compile(*_, **__):
        raise AssertionError("torch.compile was called on a CPU run")

    monkeypatch.setattr(torch, "compile", no_compile)


@pytest.fixture
def exact_float32_matmuls():
    """float32 matmuls, no TF32, so that two GPU paths (eager and compiled, eager and graphed) differ only by float
    noise. Not monkeypatch: torch's cuBLAS settings object has no attribute to delete on undo."""
    previous = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = previous
