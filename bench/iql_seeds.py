"""Several GC-IQL seeds in one process: what one update of N stacked seeds costs against N separate runs.

    python bench/iql_seeds.py --seeds 1 2 3 4                 # on a GPU: updates/s of each seed and of all together
    python bench/iql_seeds.py --device cpu --check            # that a stacked update is N separate updates

The GC-IQL update is hundreds of small kernels at batch 1,024 (docs/benchmarks.md, "What bounds each script"), and
two processes under CUDA MPS made only 1.28x the updates of one. Stacking N seeds makes each kernel N times wider
instead: every network's weights get a leading seed dimension (torch.func.stack_module_state), the losses of
flexloop_gciql.py run once per seed under torch.func.vmap, and one backward pass and one fused Adam step update all
seeds. Each seed keeps its own weights, optimiser moments and target critic; only the batches come from one
generator (N x batch_size rows, split per seed). Adam and the Polyak average act element by element and nothing
mixes the seeds' losses, so a stacked update is N separate updates: --check compares them on shared batches and
prints the largest difference. The bench measures; flexloop_gciql.py does not train stacked seeds (yet).

Modes: eager, graph (captured in a CUDA graph), compile (the vmapped losses torch.compile'd), compile-graph
(compiled, then captured).
Prints one JSON line per measurement, with the total updates/s (N seeds x updates/s of the stacked update).
"""

import argparse
import copy
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flexloop_gciql as gciql  # noqa: E402
import flexloop_run  # noqa: E402
from envs import ogbench_data  # noqa: E402
from iql_throughput import synthetic_dataset  # noqa: E402
from profiling import seconds_for, update_profile  # noqa: E402


class SeedLosses(nn.Module):
    """One seed's agent and target critic, whose forward is flexloop_gciql's losses: the module vmap runs per seed."""

    def __init__(self, agent, target_critic, args):
        super().__init__()
        self.agent, self.target_critic, self.args = agent, target_critic, args

    def forward(self, batch, lambda_depth):
        loss, terms = gciql.flexloop_losses(self.agent, self.target_critic, batch, self.args, lambda_depth)
        return loss, torch.stack([terms[name] for name in gciql.LOSS_NAMES])


def build_seeds(args, seeds, device):
    """Each seed's agent and target critic, initialised as a run of that seed initialises them."""
    agents, target_critics = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        agent = gciql.build_network(args, device)
        target_critic = copy.deepcopy(agent.critic).requires_grad_(False)
        agents.append(agent)
        target_critics.append(target_critic)
    return agents, target_critics


def make_stacked_update(args, agents, target_critics, dataset, generator, lambda_depth, compile_losses=False):
    """One update of all seeds: returns (update, params, target_params, loss_sums); params are the stacked weights
    (name -> (N, ...)), trained in place. update(batches) takes (N, B, ...) batches, or samples them when None."""
    num_seeds, device = len(agents), lambda_depth.device
    losses_module = SeedLosses(copy.deepcopy(agents[0]), copy.deepcopy(target_critics[0]), args).to("meta")
    agent_params, _ = torch.func.stack_module_state(agents)
    target_params, _ = torch.func.stack_module_state(target_critics)
    params = {name: p.detach().requires_grad_() for name, p in agent_params.items()}
    target_params = {name: p.detach() for name, p in target_params.items()}
    critic_names = [name for name in params if name.startswith("critic.")]
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.Adam(list(params.values()), lr=args.learning_rate, capturable=on_cuda, fused=on_cuda)
    loss_sums = torch.zeros(num_seeds, len(gciql.LOSS_NAMES), device=device)

    def seed_losses(seed_params, seed_target_params, batch, lam):
        weights = {**{f"agent.{k}": v for k, v in seed_params.items()},
                   **{f"target_critic.{k}": v for k, v in seed_target_params.items()}}
        return torch.func.functional_call(losses_module, weights, (batch, lam))

    all_losses = torch.func.vmap(seed_losses, in_dims=(0, 0, 0, None))
    if compile_losses:
        all_losses = torch.compile(all_losses)

    def update(batches=None):
        if batches is None:
            flat = dataset.sample(num_seeds * args.batch_size, generator)
            batches = {k: v.view(num_seeds, args.batch_size, *v.shape[1:]) for k, v in flat.items()}
        with gciql.bf16_autocast(args, device):
            losses, terms = all_losses(params, target_params, batches, lambda_depth)
        optimizer.zero_grad(set_to_none=False)
        losses.sum().backward()  # no term mixes two seeds: each seed's weights get its own loss's gradient
        with torch.no_grad():  # the target before Adam's step, as flexloop_gciql.make_update
            torch._foreach_lerp_([target_params[name.removeprefix("critic.")] for name in critic_names],
                                 [params[name].detach() for name in critic_names], args.tau)
        optimizer.step()
        with torch.no_grad():
            loss_sums.add_(terms.detach())

    return update, params, target_params, loss_sums


class GivenBatch:
    """A dataset whose sample() returns the batch set on it: a separate run's update on one seed's stacked batch."""

    def __init__(self, device):
        self.device, self.batch = device, None

    def sample(self, batch_size, generator=None):
        return self.batch


def check_against_separate(args, seeds, device, updates=3):
    """The largest difference between the stacked seeds' weights and N separate runs' after `updates` updates on
    the same batches, and the largest weight change (so that a zero difference means something)."""
    agents, target_critics = build_seeds(args, seeds, device)
    start = {name: p.detach().clone() for name, p in torch.func.stack_module_state(agents)[0].items()}
    separate = [(copy.deepcopy(a), copy.deepcopy(t)) for a, t in zip(agents, target_critics)]
    dataset = synthetic_dataset(args.env_name, 20_000, 101, device)
    generator = torch.Generator(device).manual_seed(0)
    lambda_depth = torch.full((), args.lambda_depth, device=device)
    update, params, target_params, _ = make_stacked_update(args, agents, target_critics, dataset, generator,
                                                           lambda_depth)
    singles = []
    for agent, target_critic in separate:
        optimizer = torch.optim.Adam(agent.parameters(), lr=args.learning_rate)
        single_sums = torch.zeros(len(gciql.LOSS_NAMES), device=device)
        given = GivenBatch(device)
        singles.append((gciql.make_update(args, agent, target_critic, optimizer, given, None, lambda_depth,
                                          single_sums), given))
    for _ in range(updates):
        flat = dataset.sample(len(seeds) * args.batch_size, generator)
        batches = {k: v.view(len(seeds), args.batch_size, *v.shape[1:]) for k, v in flat.items()}
        update(batches)
        for i, (single_update, given) in enumerate(singles):
            given.batch = {k: v[i] for k, v in batches.items()}
            single_update()
    difference = change = 0.0
    for i, (agent, target_critic) in enumerate(separate):
        for name, p in agent.named_parameters():
            difference = max(difference, (params[name][i] - p).abs().max().item())
            change = max(change, (params[name][i] - start[name][i]).abs().max().item())
        for name, p in target_critic.named_parameters():
            difference = max(difference, (target_params[name][i] - p).abs().max().item())
    return {"what": "check", "seeds": len(seeds), "updates": updates, "max_difference": difference,
            "max_weight_change": change}


def measure(args, seeds, device, mode, num_updates, profile):
    agents, target_critics = build_seeds(args, seeds, device)
    dataset = synthetic_dataset(args.env_name, 1_000_000, 1001, device)
    generator = torch.Generator(device).manual_seed(0)
    lambda_depth = torch.full((), args.lambda_depth, device=device)
    update, _, _, loss_sums = make_stacked_update(args, agents, target_critics, dataset, generator, lambda_depth,
                                                  compile_losses=mode.startswith("compile"))
    if mode.endswith("graph"):
        update = flexloop_run.capture_cuda_graph(update, [generator])
    else:
        for _ in range(3):
            update()
    loss_sums.zero_()
    elapsed = seconds_for(update, num_updates, device)
    result = {"what": "stacked updates", "mode": mode, "seeds": len(seeds),
              "updates_per_second": round(num_updates / elapsed, 1),
              "seed_updates_per_second": round(len(seeds) * num_updates / elapsed, 1),
              "critic_loss_per_seed": [round(x, 5) for x in (loss_sums[:, 1] / num_updates).tolist()]}
    if profile and device.type == "cuda":
        result.update(update_profile(update, device, result["updates_per_second"]))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env-name", default="cube-double-play-v0", choices=list(ogbench_data.DATASETS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--counts", type=int, nargs="+", default=None,
                        help="stack the first N of --seeds for each N given (default: 1 and all of them)")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="eager, graph, compile, compile-graph (default: compile-graph on a GPU, eager on a CPU)")
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--hidden-dim", type=int, default=256)
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--check", action="store_true", help="compare stacked and separate updates, then stop")
    cli = parser.parse_args()
    device = torch.device(cli.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    args = gciql.resolve_dataset_defaults(dataclasses.replace(
        gciql.Args(), env_name=cli.env_name, batch_size=cli.batch_size, hidden_dim=cli.hidden_dim, bf16=cli.bf16))
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    common = {"device": card, "torch": torch.__version__, "env_name": args.env_name, "batch_size": args.batch_size,
              "hidden_dim": args.hidden_dim, "bf16": args.bf16 and device.type == "cuda",  # a CPU update stays float32
              "lambda_depth": args.lambda_depth}
    if cli.check:
        print(json.dumps({**check_against_separate(args, cli.seeds, device), **common}), flush=True)
        sys.exit(0)
    modes = cli.modes or (["compile-graph"] if device.type == "cuda" else ["eager"])
    for count in cli.counts or sorted({1, len(cli.seeds)}):
        for mode in modes:
            try:
                result = measure(args, cli.seeds[:count], device, mode, cli.updates, cli.profile)
            except Exception as error:  # report and go on
                result = {"what": "stacked updates", "mode": mode, "seeds": count, "error": repr(error)[:400]}
            print(json.dumps({**result, **common}), flush=True)
