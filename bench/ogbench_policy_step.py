"""The cost of one policy step of an OGBench evaluation, by batch size, torch threads and device.

    python bench/ogbench_policy_step.py --checkpoint pm266k.pt                        # a CPU, 1 and 2 threads
    python bench/ogbench_policy_step.py --checkpoint pm266k.pt --device cuda --threads 1

eval_adaptive.py plays an OGBench task's episodes of every policy side by side (the protocol's 5 fixed depths and
11 thresholds), and each step calls the stopping rule (eval_adaptive.DepthChoice) on the rows of every env that is
running an episode: all K recurrent steps, the adjacent divergences, each row's depth. This times that call alone,
the actions copied back to the host as the envs need them, on random observations (the cost does not depend on the
values), and prints one JSON line per setting: milliseconds a call and microseconds a row. A cost that grows with
the rows is compute; one that does not is each call's fixed overhead, which more envs a call (--ogbench-envs)
spreads over more episodes.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import eval_adaptive  # noqa: E402
import flexloop_run  # noqa: E402
from envs.ogbench_data import get_spec  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--checkpoint", required=True, help="a GC-IQL checkpoint (slim or full)")
parser.add_argument("--device", default="cpu")
parser.add_argument("--rows", type=int, nargs="+", default=[50, 200, 800], help="envs running an episode")
parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch threads (0: torch's default)")
parser.add_argument("--seconds", type=float, default=2.0, help="timed per setting, after 5 warm-up calls")
args = parser.parse_args()

device = torch.device(args.device)
module, checkpoint = flexloop_run.load_any_checkpoint(args.checkpoint, None)
if checkpoint["env_id"] not in eval_adaptive.OGBENCH_DATASETS:
    sys.exit(f"{args.checkpoint} is a {checkpoint['env_id']} checkpoint; this times OGBench's GC-IQL policy")
network, _ = module.network_from_checkpoint(checkpoint, device)
network.eval().requires_grad_(False)
spec = get_spec(checkpoint["env_id"])
policies = [{"depth": k} for k in range(1, network.depth + 1)]  # the protocol's fixed depths and thresholds
policies += [{"eps": eps} for eps in eval_adaptive.EPS_GRIDS[f"ogbench-{spec.family}"]]
choice = eval_adaptive.DepthChoice(network, policies)
default_threads = torch.get_num_threads()

generator = torch.Generator().manual_seed(0)
for threads in args.threads:
    torch.set_num_threads(threads or default_threads)
    for rows in args.rows:
        obs = torch.randn(rows, spec.obs_dim, generator=generator).to(device)
        goal = torch.randn(rows, spec.obs_dim, generator=generator).to(device)
        policy_index = torch.randint(len(policies), (rows,), generator=generator).to(device)

        def call():
            decision, _ = choice(obs, goal, policy_index)  # the depths stay on the device, as eval_adaptive keeps them
            return network.act(decision).cpu()  # the envs take numpy actions: one sync a call

        for _ in range(5):
            call()
        calls, start = 0, time.perf_counter()
        while time.perf_counter() - start < args.seconds:
            call()
            calls += 1
        seconds = (time.perf_counter() - start) / calls
        print(json.dumps({"what": "ogbench_policy_step", "env_id": checkpoint["env_id"], "device": str(device),
                          "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                          "threads": torch.get_num_threads(), "rows": rows, "policies": len(policies),
                          "ms_per_call": round(seconds * 1e3, 3), "us_per_row": round(seconds / rows * 1e6, 2),
                          "calls": calls, "torch": torch.__version__}), flush=True)
