"""GC-IQL throughput of flexloop_gciql.py: gradient updates per second (IRU-5 value, critic and actor at batch
1024 on a synthetic dataset of the dataset's shapes, on the device) and evaluation episodes per second (OGBench
MuJoCo envs on the CPU, side by side, acting with an untrained actor at every depth as training evaluates).

    python bench/iql_throughput.py                                  # every mode on the GPU, then evaluation
    python bench/iql_throughput.py --modes eager --updates 20 --batch-size 64 --hidden-dim 32 --states 20000 \\
        --eval-episodes 1 --eval-envs 5 --no-eval-async              # a CPU check

Update modes: eager (plain PyTorch), graph (one update captured in a CUDA graph), compile-graph (the losses
torch.compile'd, then captured: flexloop_gciql.py --no-cuda-streams), compile-update-graph (the whole update
compiled, then captured), streams-graph and compile-streams-graph (the value, critic and actor losses on three
CUDA streams, each branch compiled or not, and the next batch sampled on a fourth unless --no-prefetch, then
captured; the second is what flexloop_gciql.py does on GPU). The
goal is 1M updates in 30 min, about 560 updates/s. Prints one JSON line per measurement. The untrained actor
rarely reaches a goal, so its episodes run to the time limit: the slowest case.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flexloop_gciql as gciql  # noqa: E402
import flexloop_run  # noqa: E402
from envs import ogbench_data  # noqa: E402
from profiling import (INDUCTOR_HELP, matmul_flops, seconds_for, set_inductor_options,  # noqa: E402
                       update_profile)


def synthetic_dataset(env_name, states, trajectory_length, device):
    """Random observations and actions in trajectories of trajectory_length states: the sampler and the networks
    do the same work on it as on the real data."""
    spec = ogbench_data.get_spec(env_name)
    generator = np.random.default_rng(0)
    observations = generator.standard_normal((states, spec.obs_dim)).astype(np.float32)
    actions = generator.uniform(-1, 1, (states, spec.action_dim)).astype(np.float32)
    valids = np.ones(states, np.float32)
    valids[trajectory_length - 1::trajectory_length] = 0.0
    valids[-1] = 0.0
    p_cur, p_traj, p_random = gciql.DATASET_HYPERPARAMETERS[env_name].actor_goals
    return ogbench_data.GCDataset(observations, actions, valids, device=device, actor_p_curgoal=p_cur,
                                  actor_p_trajgoal=p_traj, actor_p_randomgoal=p_random,
                                  actor_geom_sample=spec.actor_geom_sample)


def loss_and_backward(args, agent, target_critic, dataset, lambda_depth):
    """An update's losses and backward pass, uncompiled and without the optimizer's step (which has no matmul), on a
    batch of its own: what matmul_flops counts. The gradients are zeroed after."""
    batch = dataset.sample(args.batch_size, torch.Generator(dataset.device).manual_seed(1))
    with gciql.bf16_autocast(args, dataset.device):
        loss, _ = gciql.flexloop_losses(agent, target_critic, batch, args, lambda_depth)
    loss.backward()
    agent.zero_grad(set_to_none=False)


def measure_updates(args, dataset, device, mode, lam, num_updates, profile=False, prefetch=True, compile_mode=None):
    torch.manual_seed(0)
    agent = gciql.build_network(args, device)
    target_critic = gciql.build_network(args, device).critic
    target_critic.load_state_dict(agent.critic.state_dict())
    target_critic.requires_grad_(False)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate, capturable=on_cuda, fused=on_cuda)
    generator = torch.Generator(device).manual_seed(0)
    lambda_depth = torch.full((), lam, device=device)
    loss_sums = torch.zeros(len(gciql.LOSS_NAMES), device=device)
    streams = mode in ("streams-graph", "compile-streams-graph")  # --cuda-streams: the loss branches side by side
    if streams:
        compiled = partial(torch.compile, mode=compile_mode)
        branches = [compiled(branch) if mode.startswith("compile") else branch for branch in gciql.LOSS_BRANCHES]
        losses = gciql.on_cuda_streams(branches, device)
    else:
        losses = torch.compile(gciql.flexloop_losses, mode=compile_mode) if mode == "compile-graph" else \
            gciql.flexloop_losses
    prefetch = streams and prefetch  # as train() runs it: the next batch sampled on a stream of its own
    update = gciql.make_update(args, agent, target_critic, optimizer, dataset, generator, lambda_depth, loss_sums,
                               losses=losses, prefetch=prefetch)
    flops = matmul_flops(lambda: loss_and_backward(args, agent, target_critic, dataset, lambda_depth)) if profile \
        else None
    if mode == "compile-update-graph":
        update = torch.compile(update, mode=compile_mode)
    if mode.endswith("graph"):
        update = flexloop_run.capture_cuda_graph(update, [generator])
    else:
        for _ in range(3):
            update()  # warm-up
    loss_sums.zero_()
    elapsed = seconds_for(update, num_updates, device)
    means = (loss_sums / num_updates).tolist()
    result = {"what": "updates", "mode": mode, "prefetch": prefetch, "compile_mode": compile_mode,
              "lambda_depth": lam,
              "updates_per_second": round(num_updates / elapsed, 1),
              "minutes_per_1M_updates": round(1e6 * elapsed / num_updates / 60, 1),
              "critic_loss": round(means[1], 5), "depth_kl": round(means[3], 5)}
    if flops is not None:
        result["gflop_per_update"] = round(flops / 1e9, 2)
    if profile and device.type == "cuda" and mode != "eager":
        result.update(update_profile(update, device, result["updates_per_second"], flops))
    return result


def measure_evaluation(args, device, episodes, num_envs, async_envs):
    spec = ogbench_data.get_spec(args.env_name)
    actor = gciql.IRUActor(spec.obs_dim, spec.action_dim, args.depth, args.hidden_dim, args.iru_variant).to(device)
    start = time.perf_counter()
    vector_env = gciql.make_eval_vector_env(args.env_name, num_envs, async_envs)
    made = time.perf_counter()
    policy_fn = gciql.depth_policy_fn(actor, device)
    env_steps = []

    def counting_policy_fn(obs, goal, policy_index):
        env_steps.append(len(obs))
        return policy_fn(obs, goal, policy_index)

    success = gciql.rollout(counting_policy_fn, vector_env, gciql.TASK_IDS, episodes, args.depth, seed=0)
    elapsed = time.perf_counter() - made
    vector_env.close()
    return {"what": "evaluation", "env_name": args.env_name, "eval_envs": num_envs, "async": async_envs,
            "episodes": int(success.size), "episodes_per_second": round(success.size / elapsed, 2),
            "env_steps_per_second": round(sum(env_steps) / elapsed), "vector_steps": len(env_steps),
            "make_envs_seconds": round(made - start, 1), "seconds_per_evaluation": round(elapsed, 1)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-name", default="cube-double-play-v0", choices=list(ogbench_data.DATASETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=None, help="eager, graph, compile-graph, compile-update-graph, "
                        "streams-graph, compile-streams-graph (the last two: --cuda-streams, GPU only)")
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--states", type=int, default=1_000_000, help="states in the synthetic dataset")
    parser.add_argument("--trajectory-length", type=int, default=1001)
    parser.add_argument("--eval-episodes", type=int, default=2, help="per task and depth; 0 skips evaluation")
    parser.add_argument("--eval-envs", type=int, default=50)
    parser.add_argument("--eval-async", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--bf16", action="store_true", help="the updates' network passes under bf16 autocast "
                        "(flexloop_gciql.py's default; without it this bench measures TF32)")
    parser.add_argument("--profile", action="store_true", help="also count an update's matmul GFLOP (any device), "
                        "and on a GPU profile its kernels by kind, the 8 largest, and the TFLOP/s they make")
    parser.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                        help="streams modes: sample the next batch on a stream of its own, as train() does")
    parser.add_argument("--compile-mode", default=None, help="torch.compile's mode in the compile modes, e.g. "
                        "max-autotune-no-cudagraphs (Triton GEMMs with fused epilogues); train() uses the default")
    parser.add_argument("--inductor", nargs="*", default=[], metavar="KEY=VALUE", help=INDUCTOR_HELP)
    cli = parser.parse_args()
    inductor_options = set_inductor_options(cli.inductor)
    device = torch.device(cli.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    args = gciql.resolve_dataset_defaults(dataclasses.replace(
        gciql.Args(), env_name=cli.env_name, batch_size=cli.batch_size, depth=cli.depth, hidden_dim=cli.hidden_dim,
        bf16=cli.bf16))
    gpu_modes = ["eager", "graph", "compile-graph", "compile-update-graph", "compile-streams-graph"]
    modes = cli.modes or (gpu_modes if device.type == "cuda" else ["eager"])
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    common = {"device": card, "torch": torch.__version__, "env_name": args.env_name, "depth": args.depth,
              "hidden_dim": args.hidden_dim, "batch_size": args.batch_size,
              "bf16": args.bf16 and device.type == "cuda",  # a CPU update stays float32
              "inductor": inductor_options}
    dataset = synthetic_dataset(args.env_name, cli.states, cli.trajectory_length, device)
    for mode in modes:
        for lam in (0.0, args.lambda_depth):
            try:
                result = measure_updates(args, dataset, device, mode, lam, cli.updates, cli.profile, cli.prefetch,
                                         cli.compile_mode)
            except Exception as error:  # report and go on to the next mode
                result = {"what": "updates", "mode": mode, "lambda_depth": lam, "error": repr(error)[:400]}
            print(json.dumps({**result, **common}), flush=True)
    if cli.eval_episodes > 0:
        result = measure_evaluation(args, device, cli.eval_episodes, cli.eval_envs, cli.eval_async)
        print(json.dumps({**result, **common, "cpu_count": os.cpu_count()}), flush=True)
