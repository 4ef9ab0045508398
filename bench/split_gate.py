"""GC-DQN's and GC-IQL's updates with the gates' LayerNorm split over its two halves: the embedding's half computed
once per forward instead of at every depth. Is it faster? Prints one JSON line per path and network, in one run.
(On a CPU, yes; on an H100 no, 0.72x in pretraining and 0.92x in FlexLoop: docs/benchmarks.md.)

    python bench/split_gate.py                                   # on the GPU: GC-DQN's pretraining and FlexLoop updates
    python bench/split_gate.py --script gciql                    # GC-IQL's (TF32; --bf16 for bf16)
    python bench/split_gate.py --device cpu --check-only         # the split network equals the plain one
    python bench/split_gate.py --device cpu --check-only --bf16-check checkpoints/<run>/final.pt   # and in bf16

The IRU step normalises z = concat[x_emb, h] and multiplies it by the gate weights W = [W_x; W_h]. With mu and r
the mean and 1 / std of z over its 2d features, gamma and beta the LayerNorm's affine and b the gates' bias,

    gates = (LayerNorm(z) W + b) = r * (A + h (gamma_h * W_h)) - mu * r * u + v,
    A = (x_emb * gamma_x) W_x,   u = gamma W,   v = beta W + b,

and mu and r need only the sums of x_emb and x_emb^2, which do not change with depth either. So the embedding's
half of the product (A) and of the sums, and the folded weights (gamma_h * W_h, u, v), are computed once, in
`start`, and each depth multiplies h alone: a GEMM with half the inner dimension, and no concatenation copied at
every depth. The parameters are the same, so a checkpoint loads into either network. In exact arithmetic the two
are equal; in bf16 the product is taken before the normalisation instead of after it, which is why a script would
need a learning comparison before adopting it.
"""

import argparse
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import envs  # noqa: E402
import flexloop_gcdqn as gcdqn  # noqa: E402
import flexloop_gciql as gciql  # noqa: E402
import flexloop_run  # noqa: E402
import iql_throughput  # noqa: E402
import train_throughput  # noqa: E402

LAYER_NORM_EPS = 1e-5  # F.layer_norm's default, which EnsembleLayerNorm uses


class SplitGate:
    """Mixed into an IRU whose `start` returns (x_emb, c, h): the state carries the embedding's half of the gates
    instead of the embedding itself, (A, sum x_emb, sum x_emb^2, W_h', u, v, c, h), with A (..., 2d) and the
    folded weights computed once per forward as well (flat, so that GC-IQL's actor can stack states)."""

    def start(self, *inputs, **options):
        x_emb, c, h = super().start(*inputs, **options)
        d = self.hidden_dim
        gamma, beta = self.gate_norm.weight, self.gate_norm.bias  # (members, 1, 2d)
        w, bias = self.gates.weight, self.gates.bias  # (members, 2d, 2d), (members, 1, 2d)
        a = torch.bmm(x_emb.flatten(1, -2) * gamma[..., :d], w[:, :d]).view(*x_emb.shape[:-1], -1)
        w_h = gamma[:, 0, d:, None] * w[:, d:]  # the carried half of the weights, its LayerNorm scale folded in
        u = torch.bmm(gamma, w)  # what the mean subtracts, (members, 1, 2d)
        v = torch.bmm(beta, w) + bias
        return a, x_emb.sum(-1, keepdim=True), x_emb.square().sum(-1, keepdim=True), w_h, u, v, c, h

    def advance(self, state):
        a, x_sum, x_square_sum, w_h, u, v, c, h = state
        d = self.hidden_dim
        carried = h if self.variant == "residual" else torch.tanh(c)
        # the LayerNorm's statistics over concat[x_emb, carried], from the two halves' sums
        mean = (x_sum + carried.sum(-1, keepdim=True)) / (2 * d)
        variance = (x_square_sum + carried.square().sum(-1, keepdim=True)) / (2 * d) - mean.square()
        inverse_std = torch.rsqrt(variance + LAYER_NORM_EPS)
        product = torch.bmm(carried.flatten(1, -2), w_h).view_as(a)
        extra = (1,) * (a.dim() - 3)  # broadcast u and v over the rows' dimensions (GC-DQN: batch and actions)
        gates = inverse_std * (a + product) - mean * inverse_std * u.view(u.shape[0], *extra, 1, -1) \
            + v.view(v.shape[0], *extra, 1, -1)
        forget_logits, input_logits = gates.chunk(2, -1)
        forget, candidate = torch.sigmoid(forget_logits), torch.tanh(input_logits)
        c = forget * c + (1 - forget) * candidate
        h = h + torch.tanh(c)
        return a, x_sum, x_square_sum, w_h, u, v, c, h

    def readout(self, state):
        *_, c, h = state
        return h if self.variant == "residual" else c


class SplitGateIRU(SplitGate, gcdqn.IRUNetwork):
    """GC-DQN's IRU network, split."""


class SplitGateIQL(SplitGate, gciql.IRU):
    """GC-IQL's IRU (value, critic and actor), split."""


@contextlib.contextmanager
def split_gate_networks(module=gcdqn):
    """The script's networks are built split inside this block (GC-DQN's IRUNetwork, GC-IQL's IRU)."""
    name, split = ("IRUNetwork", SplitGateIRU) if module is gcdqn else ("IRU", SplitGateIQL)
    plain = getattr(module, name)
    setattr(module, name, split)
    try:
        yield
    finally:
        setattr(module, name, plain)


def perturb(network):
    """Move every parameter (the LayerNorm's and the biases too) off its initial value, so every term counts."""
    with torch.no_grad():
        for p in network.parameters():
            p.add_(0.1 * torch.randn_like(p))


def largest_relative_grad_difference(plain, split):
    """max over parameters of |grad_plain - grad_split| / max |grad_plain|."""
    return max((a.grad - b.grad).abs().max().item() / (a.grad.abs().max().item() + 1e-12)
               for a, b in zip(plain.parameters(), split.parameters()) if a.grad is not None)


def check(device, variant="residual", with_action=False, batch=64, seed=0):
    """The largest differences between the plain and the split network (same weights, float32): Q at every depth
    (for all actions, or at one action per row) and the gradient of a loss on them. Returns a dict."""
    torch.manual_seed(seed)
    plain = gcdqn.IRUNetwork(variant=variant).to(device)
    perturb(plain)
    split = SplitGateIRU(variant=variant).to(device)
    split.load_state_dict(plain.state_dict())
    obs = torch.randint(0, gcdqn.NUM_CODES, (batch, gcdqn.NUM_CELLS), device=device)
    goal = torch.randint(0, gcdqn.NUM_CODES, (batch, gcdqn.NUM_CELLS), device=device)
    action = torch.randint(0, gcdqn.NUM_ACTIONS, (batch,), device=device) if with_action else None
    q_plain, q_split = plain.all_depths(obs, goal, action), split.all_depths(obs, goal, action)
    q_plain.square().mean().backward()
    q_split.square().mean().backward()
    return {"q_max_abs_diff": (q_plain - q_split).abs().max().item(), "q_max_abs": q_plain.abs().max().item(),
            "grad_max_rel_diff": largest_relative_grad_difference(plain, split)}


def bf16_errors(checkpoint_path, num_states=512, steps=20, seed=0):
    """How far each network's Q under bf16 autocast (on the CPU) lies from the plain network's float32 Q, on a
    trained IRU checkpoint of GC-DQN and states reached by `steps` random actions from the env's start: the mean and
    largest absolute difference, and the share of states whose greedy action (of the critics' mean) matches
    float32's, per depth. Returns a dict."""
    _, checkpoint = flexloop_run.load_any_checkpoint(checkpoint_path)
    plain, _ = gcdqn.network_from_checkpoint(checkpoint)
    split = SplitGateIRU(depth=plain.depth, hidden_dim=plain.hidden_dim, num_critics=plain.num_critics,
                         variant=plain.variant, policy_temperature=plain.policy_temperature,
                         obs_encoding=plain.obs_encoding)
    split.load_state_dict(plain.state_dict())
    env = envs.make_vec(checkpoint["env_id"], num_states, device="cpu", seed=seed, check_actions=False).unwrapped
    generator = torch.Generator().manual_seed(seed)
    obs, _ = env.reset()
    for _ in range(steps):
        obs, *_ = env.step(torch.randint(0, gcdqn.NUM_ACTIONS, (num_states,), generator=generator))
    observation, goal = obs["observation"], obs["desired_goal"]
    with torch.no_grad():
        reference = plain.all_depths(observation, goal)  # (K, critics, batch, actions)
        greedy = reference.mean(1).argmax(-1)
        result = {"q_max_abs": reference.abs().max().item()}
        for name, network in (("plain", plain), ("split", split)):
            with torch.autocast("cpu", torch.bfloat16):
                q = network.all_depths(observation, goal).float()
            difference = (q - reference).abs()
            result[name] = {"mean_abs_diff": difference.mean().item(), "max_abs_diff": difference.max().item(),
                            "greedy_agreement_per_depth": (q.mean(1).argmax(-1) == greedy).float().mean(-1).tolist()}
    return result


def check_iql(device, variant="residual", rows=64, seed=0):
    """As `check`, for GC-IQL's IRU (two members, a plain input): the output at every depth and its gradients."""
    torch.manual_seed(seed)
    plain = gciql.IRU(in_dim=12, out_dim=3, variant=variant, members=2).to(device)
    perturb(plain)
    split = SplitGateIQL(in_dim=12, out_dim=3, variant=variant, members=2).to(device)
    split.load_state_dict(plain.state_dict())
    x = torch.randn(rows, 12, device=device)
    outputs = []
    for network in (plain, split):
        state, per_depth = network.start(x), []
        for _ in range(network.depth):
            state = network.advance(state)
            per_depth.append(network.output(state))
        out = torch.stack(per_depth)
        out.square().mean().backward()
        outputs.append(out)
    return {"out_max_abs_diff": (outputs[0] - outputs[1]).abs().max().item(),
            "out_max_abs": outputs[0].abs().max().item(),
            "grad_max_rel_diff": largest_relative_grad_difference(plain, split)}


def measure_gcdqn(cli, device):
    args = dataclasses.replace(gcdqn.Args(), num_envs=cli.num_envs, batch_size=cli.batch_size)
    modes = cli.modes or (["compile-graph"] if device.type == "cuda" else ["eager"])
    paths = {"taken": (0.0, False), "flexloop": (1.0, True)}  # pretraining's update, FlexLoop's
    for name in cli.paths:
        lam, all_action_gradients = paths[name]
        for mode in modes:
            for network in ("plain", "split") * cli.repeats:  # taking turns, so drift hits both alike
                with split_gate_networks(gcdqn) if network == "split" else contextlib.nullcontext():
                    result = train_throughput.measure_updates(args, device, mode, lam, cli.updates,
                                                              cli.fill_episodes, all_action_gradients)
                yield {"network": network, "path": name, **result, "bf16": args.bf16 and device.type == "cuda"}


def measure_gciql(cli, device):
    args = gciql.resolve_dataset_defaults(dataclasses.replace(gciql.Args(), env_name=cli.env_name,
                                                              batch_size=cli.batch_size, bf16=cli.bf16))
    dataset = iql_throughput.synthetic_dataset(args.env_name, cli.states, 1001, device)
    modes = cli.modes or (["compile-streams-graph"] if device.type == "cuda" else ["eager"])
    paths = {"taken": 0.0, "flexloop": args.lambda_depth}  # pretraining's update, FlexLoop's
    for name in cli.paths:
        for mode in modes:
            for network in ("plain", "split") * cli.repeats:
                with split_gate_networks(gciql) if network == "split" else contextlib.nullcontext():
                    result = iql_throughput.measure_updates(args, dataset, device, mode, paths[name], cli.updates)
                yield {"network": network, "path": name, **result, "env_name": args.env_name,
                       "bf16": args.bf16 and device.type == "cuda"}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--script", choices=("gcdqn", "gciql"), default="gcdqn")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="+", default=None,
                        help="as bench/train_throughput.py --modes (gcdqn) or bench/iql_throughput.py --modes (gciql)")
    parser.add_argument("--paths", nargs="+", choices=("taken", "flexloop"), default=["taken", "flexloop"],
                        help="taken: the pretraining update (lambda 0; GC-DQN: gradient at the taken action); "
                             "flexloop: the FlexLoop update")
    parser.add_argument("--updates", type=int, default=500)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=1, help="measurements of each network, taking turns")
    parser.add_argument("--fill-episodes", type=int, default=4, help="gcdqn: replay episodes collected first")
    parser.add_argument("--num-envs", type=int, default=1024, help="gcdqn: envs collecting the replay")
    parser.add_argument("--env-name", default="cube-double-play-v0", help="gciql: the dataset whose shapes to use")
    parser.add_argument("--states", type=int, default=1_000_000, help="gciql: states in the synthetic dataset")
    parser.add_argument("--bf16", action="store_true", help="gciql: the updates under bf16 (gcdqn: its default)")
    parser.add_argument("--check-only", action="store_true", help="compare the two networks' outputs and stop")
    parser.add_argument("--bf16-check", metavar="CHECKPOINT",
                        help="also compare both networks' bf16 Q with float32's on this gcdqn checkpoint (CPU)")
    cli = parser.parse_args(argv)
    device = torch.device(cli.device)
    print(json.dumps({"what": "check", "device": str(device), "gcdqn": check(device),
                      "gciql": check_iql(device)}), flush=True)
    if cli.bf16_check:
        print(json.dumps({"what": "bf16", "checkpoint": cli.bf16_check, **bf16_errors(cli.bf16_check)}), flush=True)
    if cli.check_only:
        return
    torch.backends.cuda.matmul.allow_tf32 = True
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    for result in (measure_gcdqn if cli.script == "gcdqn" else measure_gciql)(cli, device):
        print(json.dumps({**result, "device": card}), flush=True)


if __name__ == "__main__":
    main()
