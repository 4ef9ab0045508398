"""Where the stress test's env step spends its time, per inference mode (BoxPick, gcdqn checkpoints).

    python bench/stress_profile.py --checkpoint checkpoints/BoxPick-Exact-4-v0__ref__1__1795763631/final.pt \
        --eps 0.02 --split train --num-envs 32768
    python bench/stress_profile.py --checkpoint ... --eps 0.02 --split train --num-envs 32768 --compile

eval_adaptive.py's stress test reports how much faster adaptive depth makes a step against the ideal K / mean depth.
This says why it falls short. It runs the same steppers (full depth, compact, masked; on a GPU, CUDA graphs and
bucket sizes frozen after the warm-up, as the stress test), times --steps steps of each, then profiles
--profile-steps more. Per mode it prints: wall ms per step; device ms per step (the kernels' summed time; the rest
of the wall clock is the GPU waiting for the host: syncs, launches); kernels per step; device ms per step by kind
of kernel (matmul; gather and copy; elementwise and reductions); and the largest kernels. Adaptive depth shortens
the matmuls and the elementwise work of the depths it skips; the gathers, the decisions at every depth and the
host's sync are what it adds.

It also times the part of a step that adaptive depth cannot shorten, the action and env.step with the decisions
held fixed ("env", replayed from its own CUDA graph as compact mode runs it). With it each adaptive mode also gets
the policy's own speed-up, (full - env) / (mode - env), beside K / mean depth, and the whole step's ideal once the
env's time is counted: full / (env + (full - env) * mean depth / K). It times two parts of the policy over every
row as well ("parts"): the embedding (start), which every row runs whatever its depth, and one recurrent step
(advance), K of which make full depth ("rest_of_full_ms": what of full depth's step neither these nor the env
account for); with the embedding counted as fixed too, the ideal is
full / (env + start + (full - env - start) * mean depth / K) ("ideal_speedup_with_fixed"). Prints one JSON line. On
a CPU the "kernels" are the ATen ops' own CPU time.
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
from profiling import profile_kernels, sync  # noqa: E402


def profile_steps(step, steps, device):
    """Device time per call of step() by kernel kind, kernels per call, and the five largest kernels (in ms)."""
    profiled = profile_kernels(step, device, calls=steps, top=5)
    return {"device_ms_per_step": profiled["device_us_per_call"] / 1000,
            "ms_per_step_by_kind": {k: v / 1000 for k, v in profiled["us_per_call_by_kind"].items()},
            "kernels_per_step": profiled["kernels_per_call"],
            "kernels_per_step_by_kind": profiled["kernels_per_call_by_kind"],
            "largest": [{k: v for k, v in e.items() if k != "us_per_call"} for e in profiled["largest"]]}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="a gcdqn checkpoint (BoxPick)")
    parser.add_argument("--eps", type=float, required=True,
                        help="the stopping threshold, e.g. the run's calibrated eps")
    parser.add_argument("--split", choices=("train", "unseen"), default="train")
    parser.add_argument("--num-envs", type=int, default=32768)
    parser.add_argument("--modes", nargs="+", choices=("compact", "masked"), default=["compact", "masked"],
                        help="adaptive modes profiled beside full depth")
    parser.add_argument("--k-min", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=100, help="as eval_adaptive.py --stress-warmup")
    parser.add_argument("--steps", type=int, default=100, help="timed steps per mode (wall clock)")
    parser.add_argument("--profile-steps", type=int, default=20, help="profiled steps per mode, after the timed ones")
    parser.add_argument("--compile", action="store_true", help="torch.compile advance and decide, as --compile there")
    parser.add_argument("--no-cuda-graph", dest="cuda_graph", action="store_false")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # as eval_adaptive.py runs
    module, checkpoint = flexloop_run.load_any_checkpoint(args.checkpoint)
    if checkpoint["algorithm"] != "gcdqn":
        raise SystemExit(f"error: {args.checkpoint} is a {checkpoint['algorithm']} checkpoint; the stress test "
                         f"drives gcdqn checkpoints on BoxPick")
    network, _ = module.network_from_checkpoint(checkpoint, device)
    network.eval().requires_grad_(False)
    eval_adaptive.check_k_min(args.k_min, network.depth, args.checkpoint)
    if args.compile:
        network.advance, network.decide = torch.compile(network.advance), torch.compile(network.decide)
    use_graph = args.cuda_graph and device.type == "cuda"

    def timed_and_profiled(step):
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync(device)
        wall = (time.perf_counter() - start) / args.steps * 1000
        profiled = profile_steps(step, args.profile_steps, device)
        return {"wall_ms_per_step": wall, "device_busy_fraction": profiled["device_ms_per_step"] / wall, **profiled}

    def new_stepper(mode, bucketed=None):
        return eval_adaptive.StressStepper(network, mode, args.eps, args.k_min, args.num_envs, checkpoint["env_id"],
                                           args.split, args.seed, device, use_graph, bucketed=bucketed)

    modes = {}
    with torch.no_grad():
        for mode in ["full", *dict.fromkeys(args.modes)]:
            stepper = new_stepper(mode)
            for _ in range(args.warmup):
                stepper.step()
            stepper.freeze()  # as the stress test: no capture while timed or profiled
            stepper.depth_counts.zero_()
            row = timed_and_profiled(stepper.step)
            modes[mode] = {"mean_depth": stepper.report()["mean_depth"], **row}
            del stepper
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # bucketed: the action and env.step are captured apart from the policy, as compact mode replays them
        stepper = new_stepper("full", bucketed=use_graph)
        for _ in range(args.warmup):
            stepper.run_env_step()
        env = timed_and_profiled(stepper.run_env_step)
        # the policy's parts, each over every row: the embedding (start), which every row runs whatever its depth,
        # and one recurrent step (advance), which adaptive depth runs only for the rows still going
        obs, goal = stepper.obs, stepper.goal
        state = network.state_after(obs, goal, 1)
        parts = {"start": lambda: network.start(obs, goal), "advance": lambda: network.advance(state)}
        for name, part in parts.items():
            if use_graph:
                part = flexloop_run.capture_cuda_graph(part, [])
            for _ in range(args.warmup):
                part()
            parts[name] = timed_and_profiled(part)
        del stepper, state
    full = modes["full"]
    policy_full_ms = full["wall_ms_per_step"] - env["wall_ms_per_step"]
    fixed_ms = env["wall_ms_per_step"] + parts["start"]["wall_ms_per_step"]  # what no depth saves
    # full depth's step less its parts: the decision at depth K and whatever the K steps do not account for
    rest_of_full_ms = full["wall_ms_per_step"] - fixed_ms - network.depth * parts["advance"]["wall_ms_per_step"]
    for mode in args.modes:
        row = modes[mode]
        row["speedup"] = full["wall_ms_per_step"] / row["wall_ms_per_step"]
        row["ideal_speedup"] = network.depth / row["mean_depth"]
        row["policy_speedup"] = policy_full_ms / (row["wall_ms_per_step"] - env["wall_ms_per_step"])
        row["ideal_speedup_with_env"] = full["wall_ms_per_step"] / (
            env["wall_ms_per_step"] + policy_full_ms * row["mean_depth"] / network.depth)
        row["ideal_speedup_with_fixed"] = full["wall_ms_per_step"] / (
            fixed_ms + (full["wall_ms_per_step"] - fixed_ms) * row["mean_depth"] / network.depth)
        # each kind's device time against full depth's: the depth-bound kinds should fall to mean depth / K
        row["ms_by_kind_over_full"] = {kind: (ms / full["ms_per_step_by_kind"][kind]
                                              if full["ms_per_step_by_kind"][kind] else None)
                                       for kind, ms in row["ms_per_step_by_kind"].items()}
    print(json.dumps({"checkpoint": args.checkpoint, "env_id": checkpoint["env_id"], "split": args.split,
                      "eps": args.eps, "num_envs": args.num_envs, "k_min": args.k_min, "compile": args.compile,
                      "cuda_graph": use_graph, "device": torch.cuda.get_device_name() if device.type == "cuda"
                      else "cpu", "steps": args.steps, "profile_steps": args.profile_steps, "modes": modes,
                      "env": env, "parts": parts, "rest_of_full_ms": rest_of_full_ms}))


if __name__ == "__main__":
    main()
