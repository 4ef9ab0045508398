"""Env steps per second of the torch BoxPick env, measured as the reference's JAX env was (docs/benchmarks.md):
random actions, auto-reset on, 1000 steps, 1,024 and 32,768 envs, Exact-4 and Generalize-4-1.

    python bench/env_throughput.py --device cuda

Prints one JSON line per (variant, num_envs, mode). Mode "eager" steps in Python; "graph"
replays the whole 1000-step loop body captured in a CUDA graph (steps_per_graph steps per replay).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from envs.boxpick import NUM_ACTIONS, BoxPickVecEnv  # noqa: E402


def run_steps(env, actions_buffer, steps):
    for t in range(steps):
        env.step(actions_buffer[t])


def measure(variant, num_envs, device, steps, mode, steps_per_graph):
    env = BoxPickVecEnv(num_envs, variant=variant, device=device, seed=0, check_actions=False)
    env.reset()
    if mode == "compiled-graph":  # fuse the step's small ops, then capture as in "graph"
        torch._dynamo.reset()  # each measurement compiles its own env's step from scratch
        env.step = torch.compile(env.step, fullgraph=False)
    # Random actions drawn on the device ahead of time, like the reference's pre-split PRNG keys.
    actions = torch.randint(NUM_ACTIONS, (steps, num_envs), device=device)
    sync = torch.cuda.synchronize if env.device.type == "cuda" else (lambda: None)
    if mode in ("graph", "compiled-graph"):
        static_actions = actions[:steps_per_graph].clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_steps(env, static_actions, steps_per_graph)  # warm-up allocations outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        graph.register_generator_state(env.generator)
        with torch.cuda.graph(graph):
            run_steps(env, static_actions, steps_per_graph)
        graph.replay()
        sync()
        start = time.perf_counter()
        for _ in range(steps // steps_per_graph):
            graph.replay()
        sync()
        elapsed = time.perf_counter() - start
        steps = steps // steps_per_graph * steps_per_graph
    else:
        run_steps(env, actions, 20)  # warm-up
        sync()
        start = time.perf_counter()
        run_steps(env, actions, steps)
        sync()
        elapsed = time.perf_counter() - start
    return dict(variant=variant, num_envs=num_envs, mode=mode, steps=steps, seconds=round(elapsed, 4),
                env_steps_per_second=round(num_envs * steps / elapsed))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--num-envs", type=int, nargs="+", default=[1024, 32768])
    parser.add_argument("--variants", nargs="+", default=["Exact-4", "Generalize-4-1"])
    parser.add_argument("--modes", nargs="+", default=None, help="eager, graph, compiled-graph (graph modes need CUDA)")
    parser.add_argument("--steps-per-graph", type=int, default=100)
    args = parser.parse_args()
    modes = args.modes or (["eager", "graph"] if args.device.startswith("cuda") else ["eager"])
    card = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    for variant in args.variants:
        for num_envs in args.num_envs:
            for mode in modes:
                try:
                    result = measure(variant, num_envs, args.device, args.steps, mode, args.steps_per_graph)
                except Exception as error:  # one failing mode should not hide the others' numbers
                    result = dict(variant=variant, num_envs=num_envs, mode=mode, error=repr(error)[:300])
                print(json.dumps({**result, "device": card, "torch": torch.__version__}), flush=True)
