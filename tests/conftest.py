"""Tests run tiny networks, for which one CPU thread per process is fastest (several threads contend on the
small CI machine); subprocesses started by tests inherit the setting."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
