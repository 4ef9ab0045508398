"""Env steps per second of flexloop_gcppo.py's training loop (rollout + update epochs), at the default config.

    python bench/ppo_throughput.py                       # GPU, the script's defaults (compiled, CUDA graph, and
                                                         # on an H100 or H200 the fused IRU kernels)
    python bench/ppo_throughput.py --no-fused-iru --no-compile-env-step --no-combo-kernels   # before 2026-12-05
    python bench/ppo_throughput.py --no-compile --no-cuda-graph --no-fused-iru    # the eager loop
    python bench/ppo_throughput.py --cpu --num-envs 64 --num-steps 32 --num-minibatches 4 --iterations 3

Runs train() for --iterations rollouts in each phase (pretraining, then FlexLoop with its teacher), logging every
iteration, and reads the run's own `charts/SPS`: the median of each phase's logs after its first, which holds the
compilation and the graph captures. That is the number a run shows. Also times one rollout alone (collection + GAE,
replayed from CUDA graphs as train() does with --cuda-graph on a GPU) and one evaluation (every depth, both splits;
each depth's episode replayed from a CUDA graph, as train() does on a GPU); an iteration's update epochs take the
rest. Prints one JSON line, with the projected minutes of a 50M-step pretraining phase. With --profile (GPU) it
adds the kernels of one rollout step and of one minibatch update of each phase (pretraining's at depth K
alone, FlexLoop's at every depth), each as train() replays it, with their GPU time.
"""

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import envs  # noqa: E402
import flexloop_gcppo as gcppo  # noqa: E402
import flexloop_run  # noqa: E402
from profiling import INDUCTOR_HELP, grads_written_by_backward, profile_kernels, set_inductor_options  # noqa: E402


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def steady_rates(args):
    """train(args), then its logged charts/SPS by phase: the median of each phase's logs after its first."""
    run_dir = Path(gcppo.train(args))
    if not (run_dir / "final.pt").exists():  # a stopped run: no number rather than a wrong one
        raise SystemExit("error: the timed run was stopped before it finished (SIGTERM or Ctrl-C); nothing measured")
    rates = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "charts/SPS" in row:
            rates.setdefault(row["phase"], []).append(row["charts/SPS"])
    return {phase: statistics.median(sps[1:]) for phase, sps in rates.items()}


def time_rollout_and_eval(args, device, graphed, profile=False, profile_top=8, compile_mode=None,
                          grads_to_none=False):
    network = gcppo.build_network(args, device)
    env = envs.make_vec(args.env_id, args.num_envs, device=device, seed=0, check_actions=False).unwrapped
    eval_envs = {split: envs.make_vec(args.env_id, args.num_eval_envs, device=device, split=split,
                                      check_actions=False).unwrapped for split in ["train", "unseen"]}
    buffers = gcppo.make_rollout_buffers(args.num_steps, args.num_envs, device)
    generator, episode_sums = torch.Generator(device).manual_seed(0), torch.zeros(4, device=device)
    obs, _ = env.reset()
    compile = torch.compile if args.compile and device.type == "cuda" else lambda fn: fn  # as train() compiles
    step = gcppo.compiled_rollout_step(compile, network, args.compile_env_step)
    rollout = gcppo.make_rollout(network, env, obs, buffers, generator, episode_sums, step)
    targets = partial(gcppo.prepare_targets, network, network, buffers, obs, args)  # with a teacher, as FlexLoop
    if graphed:  # as train() replays them (the captures warm up too)
        rollout = flexloop_run.capture_cuda_graph(rollout, [generator, env.generator], warmup=1)
        targets = flexloop_run.capture_cuda_graph(targets, [])
    evaluate = gcppo.make_evaluate(network, eval_envs, cuda_graph=graphed)  # the first call captures, as in train()
    times = {}
    for name, work in [("rollout", lambda: (rollout(), targets())), ("eval", lambda: evaluate(0))]:
        work()  # warm-up
        sync(device)
        start = time.perf_counter()
        work()
        sync(device)
        times[name] = time.perf_counter() - start
    if profile and device.type == "cuda":
        times["profile"] = profile_rollout_and_update(args, device, network, buffers, rollout, profile_top,
                                                      compile_mode, grads_to_none)
    return times


def profile_rollout_and_update(args, device, network, buffers, rollout, top=8, compile_mode=None,
                               grads_to_none=False):
    """Kernels of the replayed rollout (per env step) and of one minibatch update of each phase, compiled and
    captured as train() runs them, on the rollout's data: pretraining's (depth K alone) and FlexLoop's (lambda > 0:
    the KL at every depth), with the FlexLoop update's `top` kernels. compile_mode: torch.compile's mode for the
    profiled updates (train() uses the default). grads_to_none: zero_grad(set_to_none=True) in place of the
    script's zeroing, so backward writes the gradients instead of adding them to zeros (a measurement only)."""
    profiled = profile_kernels(rollout, device, calls=2, top=5)
    result = {"rollout_kernels_per_step": round(profiled["kernels_per_call"] / args.num_steps, 1),
              "rollout_us_per_step": round(profiled["device_us_per_call"] / args.num_steps, 1),
              "rollout_largest": profiled["largest"]}
    on_cuda = device.type == "cuda"  # as train() builds it
    optimizer = torch.optim.Adam(network.parameters(), lr=args.learning_rate, eps=args.adam_eps, capturable=on_cuda,
                                 fused=on_cuda)
    if grads_to_none:
        grads_written_by_backward(optimizer)
    rows = args.num_envs * args.num_steps
    minibatch_index = torch.randperm(rows, device=device)[:rows // args.num_minibatches]
    loss_sums = torch.zeros(len(gcppo.LOSS_NAMES), device=device)
    for phase, lam in [("pretrain", 0.0), ("flexloop", 1.0)]:
        update = gcppo.make_update(args, network, optimizer, buffers, minibatch_index, torch.tensor(lam, device=device),
                                   loss_sums, every_depth=phase == "flexloop")
        update = flexloop_run.capture_cuda_graph(torch.compile(update, mode=compile_mode) if args.compile else update,
                                                 [])
        profiled = profile_kernels(update, device, calls=20, top=top)
        if phase == "pretrain":
            result.update(pretrain_update_kernels=profiled["kernels_per_call"],
                          pretrain_update_us=profiled["device_us_per_call"])
        else:
            result.update(update_kernels=profiled["kernels_per_call"], update_us=profiled["device_us_per_call"],
                          update_us_by_kind=profiled["us_per_call_by_kind"], update_largest=profiled["largest"])
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when a GPU is present")
    parser.add_argument("--num-envs", type=int, default=gcppo.Args.num_envs)
    parser.add_argument("--num-steps", type=int, default=gcppo.Args.num_steps)
    parser.add_argument("--num-minibatches", type=int, default=gcppo.Args.num_minibatches)
    parser.add_argument("--update-epochs", type=int, default=gcppo.Args.update_epochs)
    parser.add_argument("--iterations", type=int, default=10,
                        help="rollouts per phase (at least 2: the first log of a phase is left out)")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=gcppo.Args.compile)
    parser.add_argument("--cuda-graph", action=argparse.BooleanOptionalAction, default=gcppo.Args.cuda_graph)
    parser.add_argument("--profile", action="store_true", help="also the kernels of a rollout step and of an update")
    parser.add_argument("--profile-top", type=int, default=8, help="how many of the update's largest kernels to list")
    parser.add_argument("--profile-grads-to-none", action="store_true", help="profile the updates with "
                        "zero_grad(set_to_none=True): backward writes the gradients, no zeroing and adding")
    parser.add_argument("--profile-compile-mode", default=None, help="torch.compile mode of the profiled update, "
                        "e.g. max-autotune-no-cudagraphs (Triton GEMMs with fused epilogues); train() uses the default")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE", help=INDUCTOR_HELP)
    parser.add_argument("--fused-iru", action=argparse.BooleanOptionalAction, default=gcppo.Args.fused_iru,
                        help="the script's --fused-iru: the K IRU steps as flexloop_kernels.py's Triton kernels, "
                        "where they run")
    parser.add_argument("--compile-env-step", action=argparse.BooleanOptionalAction,
                        default=gcppo.Args.compile_env_step, help="the script's --compile-env-step: the rollout's "
                        "whole step compiled, not its policy pass alone")
    parser.add_argument("--combo-kernels", action=argparse.BooleanOptionalAction, default=gcppo.Args.combo_kernels,
                        help="the script's --combo-kernels: inductor's combo kernels in what the run compiles")
    cli = parser.parse_args()
    inductor_options = set_inductor_options(cli.inductor)

    device = torch.device("cuda" if torch.cuda.is_available() and not cli.cpu else "cpu")
    on_gpu = device.type == "cuda"  # the script ignores --compile and --cuda-graph on a CPU
    batch = cli.num_envs * cli.num_steps
    if cli.iterations < 2:
        parser.error("--iterations must be at least 2: each phase's first log holds its compilation")
    # train()'s own printing goes to stderr: stdout is the JSON line alone.
    with tempfile.TemporaryDirectory() as run_dir, contextlib.redirect_stdout(sys.stderr):
        def args_for(rollouts):
            return gcppo.Args(cuda=device.type == "cuda", num_envs=cli.num_envs, num_steps=cli.num_steps,
                              num_minibatches=cli.num_minibatches, update_epochs=cli.update_epochs,
                              pretrain_timesteps=rollouts * batch, total_timesteps=rollouts * batch,
                              eval_every=10**9, save_every=10**9, log_every=1, compile=cli.compile,
                              cuda_graph=cli.cuda_graph, fused_iru=cli.fused_iru,
                              compile_env_step=cli.compile_env_step, combo_kernels=cli.combo_kernels,
                              run_dir=run_dir)
        rates = steady_rates(args_for(cli.iterations))
        parts = time_rollout_and_eval(args_for(1), device, graphed=cli.cuda_graph and on_gpu, profile=cli.profile,
                                      profile_top=cli.profile_top, compile_mode=cli.profile_compile_mode,
                                      grads_to_none=cli.profile_grads_to_none)
    seconds_per_iteration = {phase: round(batch / sps, 3) for phase, sps in rates.items()}
    print(json.dumps({
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
        "inductor": inductor_options, "compile_env_step": cli.compile_env_step, "combo_kernels": cli.combo_kernels,
        "fused_iru": cli.fused_iru and gcppo.fused_iru_off_because(args_for(1), device) is None,  # what ran
        "num_envs": cli.num_envs, "num_steps": cli.num_steps, "num_minibatches": cli.num_minibatches,
        "update_epochs": cli.update_epochs, "compile": cli.compile and on_gpu, "cuda_graph": cli.cuda_graph and on_gpu,
        "iterations_per_phase": cli.iterations, "env_steps_per_second": rates,
        "seconds_per_iteration": seconds_per_iteration,
        "rollout_seconds": round(parts["rollout"], 3),
        "update_seconds_per_iteration": {phase: round(seconds - parts["rollout"], 3)
                                         for phase, seconds in seconds_per_iteration.items()},
        "eval_seconds": round(parts["eval"], 3),
        "projected_minutes_per_50M_steps": round(50e6 / rates["pretrain"] / 60, 1),
        **({"profile": {**parts["profile"], "compile_mode": cli.profile_compile_mode,
                        "grads_to_none": cli.profile_grads_to_none}} if "profile" in parts else {}),
    }), flush=True)
