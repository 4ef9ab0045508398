"""Tests run tiny networks, for which one CPU thread per process is fastest (several threads contend on the
small CI machine); subprocesses started by tests inherit the setting."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

import pytest  # noqa: E402


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
