"""GC-DQN training throughput of flexloop_gcdqn.py: gradient updates per second and collected env steps
per second, for IRU-5 at batch 1024 with the default network, pretraining (lambda = 0) and FlexLoop (lambda = 1).

    python bench/train_throughput.py                     # every mode on the GPU
    python bench/train_throughput.py --modes eager --updates 20 --num-envs 64 --batch-size 64   # CPU check

Modes: eager (plain PyTorch), graph (one update captured in a CUDA graph), compile (torch.compile'd, not
captured: with --profile it also names the ops that launch the largest kernels), compile-graph (torch.compile'd
update, then captured), autotune-graph (compiled with mode="max-autotune-no-cudagraphs", then captured). Each
path is measured in eager mode first, and every mode's rate is also given as a ratio to that eager rate.
Three update paths: lambda = 0 with gradient at the taken action only (what pretraining runs), lambda = 0 with
gradients at all 6 actions (the path before), and lambda = 1 (FlexLoop, all 6 actions). The replay is filled with real episodes collected by the untrained network first.
Collection is measured eager, replayed from a CUDA graph, and replayed with the policy compiled (the script's
default on a GPU). Prints one JSON line per measurement.
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
from profiling import (INDUCTOR_HELP, grads_written_by_backward, matmul_flops, profile_ops,  # noqa: E402
                       seconds_for, set_inductor_options, sync, update_profile)
import flexloop_gcdqn as gcdqn  # noqa: E402
import flexloop_run  # noqa: E402


OPTIMIZER_VARIANT = {"fused_adam": False, "grads_to_none": False}  # set from the command line (--fused-adam ...)


def setup(args, device):
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=0, check_actions=False).unwrapped
    network = gcdqn.build_network(args, device)
    target_network = gcdqn.build_network(args, device)
    target_network.load_state_dict(network.state_dict())
    target_network.requires_grad_(False)
    fused = OPTIMIZER_VARIANT["fused_adam"] and device.type == "cuda"
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, capturable=device.type == "cuda",
                                 fused=fused or None)
    if OPTIMIZER_VARIANT["grads_to_none"]:
        grads_written_by_backward(optimizer)
    replay = gcdqn.TrajectoryReplay(args.num_envs, args.replay_episodes, args.episode_length, device)
    return env, network, target_network, optimizer, replay


def measure_collection(args, device, episodes, mode):
    """One 100-step episode in every env at full depth: eager, replayed from a CUDA graph (graph), or replayed with
    the policy compiled first (compile-graph, what the script does on a GPU)."""
    env, network, _, _, replay = setup(args, device)
    generator = torch.Generator(device).manual_seed(0)
    logits_fn = torch.compile(network.policy_logits) if mode == "compile-graph" else network.policy_logits

    def collect():
        return gcdqn.run_episode(network, env, args.depth, generator, logits_fn)

    if mode in ("graph", "compile-graph"):
        collect = flexloop_run.capture_cuda_graph(collect, [generator, env.generator])  # warms up (and compiles) too
    else:
        collect()  # warm-up
    sync(device)
    start = time.perf_counter()
    for _ in range(episodes):
        replay.add(*collect()[:3])
    sync(device)
    elapsed = time.perf_counter() - start
    return {"what": "collection", "mode": mode,
            "env_steps_per_second": round(episodes * args.num_envs * args.episode_length / elapsed)}


def measure_updates(args, device, mode, lam, num_updates, fill_episodes, all_action_gradients, profile=False):
    env, network, target_network, optimizer, replay = setup(args, device)
    generator = torch.Generator(device).manual_seed(0)
    for _ in range(fill_episodes):
        replay.add(*gcdqn.run_episode(network, env, args.depth, generator)[:3])
    lambda_depth = torch.full((), lam, device=device)
    loss_sums = torch.zeros(len(gcdqn.LOSS_NAMES), device=device)
    update = gcdqn.make_update(args, network, target_network, optimizer, replay, generator, lambda_depth, loss_sums,
                               all_action_gradients=all_action_gradients)
    flops = matmul_flops(update) if profile else None  # one eager update, counted
    if mode in ("compile", "compile-graph", "autotune-graph"):
        update = torch.compile(update, mode="max-autotune-no-cudagraphs" if mode == "autotune-graph" else None)
    if mode in ("graph", "compile-graph", "autotune-graph"):
        update = flexloop_run.capture_cuda_graph(update, [generator])
    else:
        for _ in range(3):
            update()  # warm-up
    elapsed = seconds_for(update, num_updates, device)
    result = {"what": "updates", "mode": mode, "lambda_depth": lam, "all_action_gradients": all_action_gradients,
              "updates_per_second": round(num_updates / elapsed, 1),
              "td_loss_mean": round(loss_sums[0].item() / max(1, num_updates), 5)}
    if flops is not None:
        result["gflop_per_update"] = round(flops / 1e9, 2)
    if profile and device.type == "cuda" and mode != "eager":
        result.update(update_profile(update, device, result["updates_per_second"], flops))
        if mode == "compile":  # not captured, so the profiler still sees which op launched each kernel
            result["largest_ops"] = profile_ops(update, device)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="eager, graph, compile, compile-graph, autotune-graph (eager always runs first: the ratios' "
                             "base; compile is uncaptured, and with --profile names the ops behind the kernels)")
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--num-envs", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--fill-episodes", type=int, default=4)
    parser.add_argument("--collect-episodes", type=int, default=5)
    parser.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=gcdqn.Args().bf16,
                        help="the updates' network passes under bf16 autocast (the script's default; before --bf16 "
                             "existed the default was TF32, and commands from then measured TF32)")
    parser.add_argument("--profile", action="store_true",
                        help="also count an update's matmul GFLOP (any device), and on a GPU profile its kernels by "
                             "kind, the 8 largest, and the TFLOP/s they make (compile mode: the ops behind them)")
    parser.add_argument("--skip-collection", action="store_true")
    parser.add_argument("--paths", nargs="*", default=["taken", "all-actions", "flexloop"],
                        help="taken (lambda 0, taken action), all-actions (lambda 0, the path before), flexloop "
                             "(lambda 1); none: collection alone")
    parser.add_argument("--fused-adam", action="store_true", help="torch.optim.Adam(fused=True) instead of foreach")
    parser.add_argument("--grads-to-none", action="store_true",
                        help="zero_grad(set_to_none=True) in the update: backward writes the gradients, no zeroing")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE", help=INDUCTOR_HELP)
    cli = parser.parse_args()
    inductor_options = set_inductor_options(cli.inductor)
    OPTIMIZER_VARIANT.update(fused_adam=cli.fused_adam, grads_to_none=cli.grads_to_none)
    device = torch.device(cli.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    args = dataclasses.replace(gcdqn.Args(), num_envs=cli.num_envs, batch_size=cli.batch_size, bf16=cli.bf16)
    modes = cli.modes or (["graph", "compile-graph"] if device.type == "cuda" else [])
    modes = ["eager"] + [m for m in modes if m != "eager"]
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    common = {"device": card, "torch": torch.__version__, "depth": args.depth, "hidden_dim": args.hidden_dim,
              "batch_size": args.batch_size, "num_envs": args.num_envs,
              "bf16": cli.bf16 and device.type == "cuda",  # a CPU update stays float32
              "inductor": inductor_options, **OPTIMIZER_VARIANT}
    if not cli.skip_collection:
        for mode in ["eager", "graph", "compile-graph"] if device.type == "cuda" else ["eager"]:
            print(json.dumps({**measure_collection(args, device, cli.collect_episodes, mode), **common}), flush=True)
    # The update paths the script runs: lambda = 0 with gradient at the taken action only (pretraining, Self-TD
    # Only), lambda = 1 with all 6 actions (FlexLoop); and lambda = 0 with all 6 actions, the path before.
    paths = {"taken": (0.0, False), "all-actions": (0.0, True), "flexloop": (1.0, True)}
    for lam, all_action_gradients in [paths[name] for name in cli.paths]:
        eager_rate = None
        for mode in modes:
            try:
                result = measure_updates(args, device, mode, lam, cli.updates, cli.fill_episodes,
                                         all_action_gradients, cli.profile)
                eager_rate = eager_rate or result["updates_per_second"]
                result["ratio_vs_eager"] = round(result["updates_per_second"] / eager_rate, 2)
            except Exception as error:  # report and go on to the next mode
                result = {"what": "updates", "mode": mode, "lambda_depth": lam, "error": repr(error)[:400]}
            print(json.dumps({**result, **common}), flush=True)
