"""GC-PPO's K IRU steps, forward and backward, as flexloop_kernels.py's Triton kernels against the compiled PyTorch
steps.

    python bench/fused_iru_depths.py       # on a GPU: us of forward + backward a minibatch, and of a rollout's forward
    TRITON_INTERPRET=1 python bench/fused_iru_depths.py --check --device cpu    # values and gradients, on a CPU

GC-PPO's minibatch update (10,240 rows, hidden width 64) is about 140 kernels of 4 us each (docs/benchmarks.md, "What
bounds each script"), and each of the K recurrent steps is several of them forward and more backward;
flexloop_kernels.py's docstring says how its two kernels replace them. The bench times forward + backward of the
compiled PyTorch steps against IRUSteps at each block size, over the wall clock and as the kernels' own device time
(`*_device_us`: what each costs inside a CUDA graph), and --check compares values and gradients. A block size whose
backward needs more shared memory than the card has is reported (`blocks_too_large`) and skipped.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flexloop_kernels import IRUSteps, OutOfResources  # noqa: E402  (exits naming Triton when it is missing)
from profiling import profile_kernels, sync  # noqa: E402


BLOCKS = ((16, 4), (32, 4), (32, 8), (64, 4), (64, 8))


def reference_steps(x_emb, ln_w, ln_b, w, b, depth):
    """The same K steps in PyTorch, as the scripts' IRUNetwork.advance computes them: h of depths 1..K."""
    c = h = torch.zeros_like(x_emb)
    d = x_emb.shape[-1]
    hs = []
    for _ in range(depth):
        z = F.layer_norm(torch.cat([x_emb, h], -1), (2 * d,), ln_w, ln_b)
        forget, candidate = (z @ w + b).chunk(2, -1)
        forget, candidate = torch.sigmoid(forget), torch.tanh(candidate)
        c = forget * c + (1 - forget) * candidate
        h = h + torch.tanh(c)
        hs.append(h)
    return torch.stack(hs)


def parameters(d, device, seed=0):
    """LayerNorm scale and shift, gate weights and bias, away from their initial values so the check sees them."""
    generator = torch.Generator(device).manual_seed(seed)

    def uniform(*shape, scale=1.0):
        return (torch.rand(*shape, device=device, generator=generator) * 2 - 1) * scale

    w = uniform(2 * d, 2 * d, scale=(2 * d) ** -0.5)
    b = uniform(2 * d, scale=0.1)
    b[:d] += 1.0  # the forget bias +1, as the scripts initialise it
    ln_w, ln_b = 1 + uniform(2 * d, scale=0.5), uniform(2 * d, scale=0.2)
    return [t.requires_grad_() for t in (ln_w, ln_b, w, b)]


def forward_backward(steps, x_emb, params, depth, upstream):
    """One forward and backward of `steps`, the gradient flowing in from every depth's readout (upstream)."""
    for t in (x_emb, *params):
        t.grad = None
    h = steps(x_emb, *params, depth)
    (h * upstream).sum().backward()
    return h.detach(), [t.grad for t in (x_emb, *params)]


def device_times(call, compiled, fused_us_by_block, device):
    """The kernels' own device time of call(compiled steps) and of call(IRUSteps.apply) at the fastest block size:
    what each costs inside a CUDA graph, as the scripts replay the update, without launches."""
    fastest = min(fused_us_by_block, key=fused_us_by_block.get)
    block_m, num_warps = (int(word) for word in fastest.split()[::2])  # "64 rows, 4 warps"
    IRUSteps.BLOCK_M, IRUSteps.NUM_WARPS = block_m, num_warps
    compiled_us = profile_kernels(lambda: call(compiled), device)["device_us_per_call"]
    fused_us = profile_kernels(lambda: call(IRUSteps.apply), device)["device_us_per_call"]
    return {"compiled_device_us": compiled_us, "fused_device_us": fused_us,
            "device_speedup": round(compiled_us / fused_us, 2)}


def measure(rows, d, depth, device, repeats, check_only):
    generator = torch.Generator(device).manual_seed(1)
    x_emb = torch.randn(rows, d, device=device, generator=generator).requires_grad_()
    params = parameters(d, device)
    upstream = torch.randn(depth, rows, d, device=device, generator=generator)
    h_ref, grads_ref = forward_backward(reference_steps, x_emb, params, depth, upstream)
    names = ("x_emb", "gate_norm.weight", "gate_norm.bias", "gates.weight", "gates.bias")
    result = {"rows": rows, "hidden": d, "depth": depth, "h_max_difference": 0.0,
              "grad_max_relative_difference": dict.fromkeys(names, 0.0)}
    blocks = []  # the block sizes that fit the card's shared memory
    for block_m, num_warps in BLOCKS:  # every block size the timing tries computes the same numbers
        IRUSteps.BLOCK_M, IRUSteps.NUM_WARPS = block_m, num_warps
        try:
            h_fused, grads_fused = forward_backward(IRUSteps.apply, x_emb, params, depth, upstream)
        except OutOfResources as error:
            result.setdefault("blocks_too_large", {})[f"{block_m} rows, {num_warps} warps"] = str(error)
            continue
        blocks.append((block_m, num_warps))
        result["h_max_difference"] = max(result["h_max_difference"], (h_ref - h_fused).abs().max().item())
        for name, r, f in zip(names, grads_ref, grads_fused):
            relative = ((r - f).abs().max() / r.abs().max()).item()
            result["grad_max_relative_difference"][name] = max(result["grad_max_relative_difference"][name], relative)
    if check_only:
        return result
    compiled = torch.compile(reference_steps)

    def timed(steps):
        for _ in range(3):
            forward_backward(steps, x_emb, params, depth, upstream)
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            forward_backward(steps, x_emb, params, depth, upstream)
        sync(device)
        return round((time.perf_counter() - start) / repeats * 1e6, 1)

    result.update(eager_us=timed(reference_steps), compiled_us=timed(compiled), fused_us_by_block={})
    for block_m, num_warps in blocks:  # (BLOCK_M, num_warps): the backward holds many row tiles at once
        IRUSteps.BLOCK_M, IRUSteps.NUM_WARPS = block_m, num_warps
        result["fused_us_by_block"][f"{block_m} rows, {num_warps} warps"] = timed(IRUSteps.apply)
    result["fused_us"] = min(result["fused_us_by_block"].values())
    result["speedup_over_compiled"] = round(result["compiled_us"] / result["fused_us"], 2)
    result.update(device_times(lambda steps: forward_backward(steps, x_emb, params, depth, upstream), compiled,
                               result["fused_us_by_block"], device))
    return result


@torch.no_grad()
def measure_forward(rows, d, depth, device, repeats):
    """The forward alone without gradient, as a rollout step acts (GC-PPO: 2,048 envs)."""
    x_emb = torch.randn(rows, d, device=device, generator=torch.Generator(device).manual_seed(1))
    params = [t.detach() for t in parameters(d, device)]
    compiled = torch.compile(reference_steps)

    def timed(steps):
        for _ in range(3):
            steps(x_emb, *params, depth)
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            steps(x_emb, *params, depth)
        sync(device)
        return round((time.perf_counter() - start) / repeats * 1e6, 1)

    result = {"what": "forward without gradient", "rows": rows, "hidden": d, "depth": depth,
              "compiled_us": timed(compiled), "fused_us_by_block": {}}
    for block_m, num_warps in BLOCKS:  # the forward alone holds fewer tiles: every block size fits
        IRUSteps.BLOCK_M, IRUSteps.NUM_WARPS = block_m, num_warps
        result["fused_us_by_block"][f"{block_m} rows, {num_warps} warps"] = timed(IRUSteps.apply)
    result["fused_us"] = min(result["fused_us_by_block"].values())
    result["speedup_over_compiled"] = round(result["compiled_us"] / result["fused_us"], 2)
    result.update(device_times(lambda steps: steps(x_emb, *params, depth), compiled, result["fused_us_by_block"],
                               device))
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=10240, help="GC-PPO's minibatch: 2,048 envs x 160 steps / 32")
    parser.add_argument("--rollout-rows", type=int, default=2048, help="rows of the forward-only timing: GC-PPO's envs")
    parser.add_argument("--hidden-dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--check", action="store_true", help="compare values and gradients only, at 100 rows (on a "
                        "CPU: with TRITON_INTERPRET=1)")
    cli = parser.parse_args()
    device = torch.device(cli.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the scripts run: the kernels' tl.dot is TF32 too
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    results = [measure(100 if cli.check else cli.rows, cli.hidden_dim, cli.depth, device, cli.repeats, cli.check)]
    if not cli.check:
        results.append(measure_forward(cli.rollout_rows, cli.hidden_dim, cli.depth, device, cli.repeats))
    for result in results:
        print(json.dumps({**result, "device": card, "torch": torch.__version__}), flush=True)
