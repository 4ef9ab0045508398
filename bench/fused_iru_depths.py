"""All K steps of an IRU, forward and backward, as Triton kernels, against the compiled PyTorch steps (GC-PPO's update).

    python bench/fused_iru_depths.py       # on a GPU: us of forward + backward a minibatch, and of a rollout's forward
    TRITON_INTERPRET=1 python bench/fused_iru_depths.py --check --device cpu    # values and gradients, on a CPU

GC-PPO's minibatch update (10,240 rows, hidden width 64) is about 140 kernels of 4 us each (docs/benchmarks.md, "What
bounds each script"), and each of the K recurrent steps is several of them forward and more backward. At width 64
the gate weights (128 x 128) are small enough for one program to apply them to its block of rows at every depth,
so here:

- forward: one kernel. Each program takes BLOCK_M rows of x_emb and runs the K steps (the LayerNorm, the GEMM, the
  gates) with c and h in registers, writing h and c of every depth (the readouts, and what the backward needs).
- backward: one kernel and one sum. Each program walks its rows' depths from K down to 1, recomputing each step's
  LayerNorm and gates from the saved h and c, and carries the gradients of h and c down. Its share of the weight
  gradients (gate weights and bias, LayerNorm scale and shift) stays in registers and is written once; one sum
  over programs gives the gradients.

IRUSteps is the torch.autograd.Function: IRUSteps.apply(x_emb, gate_norm weight, gate_norm bias, gates weight
(input x output), gates bias, K) -> h of depths 1..K, (K, rows, D). The residual variant (h carried). The bench
times forward + backward of the compiled PyTorch steps against it, over the wall clock and as the kernels' own
device time (`*_device_us`: what each costs inside a CUDA graph), and --check compares values and gradients. A
block size whose backward needs more shared memory than the card has is reported (`blocks_too_large`) and skipped.
The bench measures; the scripts do not use the kernels.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:
    raise SystemExit("error: bench/fused_iru_depths.py needs Triton, which PyTorch's CUDA wheels bring on Linux; "
                     "for the CPU check (TRITON_INTERPRET=1), pip install triton")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from profiling import profile_kernels, sync  # noqa: E402


@triton.jit
def tanh(x):
    return 2 * tl.sigmoid(2 * x) - 1


@triton.jit
def normalise(x, h, D: tl.constexpr, EPS: tl.constexpr):
    """LayerNorm of concat[x, h] without its affine: the two halves normalised, and 1 / std per row."""
    mean = (tl.sum(x, 1) + tl.sum(h, 1)) / (2 * D)
    x_centred, h_centred = x - mean[:, None], h - mean[:, None]
    variance = (tl.sum(x_centred * x_centred, 1) + tl.sum(h_centred * h_centred, 1)) / (2 * D)
    rstd = 1.0 / tl.sqrt(variance + EPS)
    return x_centred * rstd[:, None], h_centred * rstd[:, None], rstd


@triton.jit
def gates(x_hat, h_hat, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, D: tl.constexpr):
    """The affine LayerNorm output z = (z_x, z_h), then sigmoid(forget) and tanh(candidate): the weight is
    (2D inputs, 2D outputs), its first D outputs the forget gate's."""
    cols = tl.arange(0, D)
    z_x = x_hat * tl.load(ln_w_ptr + cols)[None, :] + tl.load(ln_b_ptr + cols)[None, :]
    z_h = h_hat * tl.load(ln_w_ptr + D + cols)[None, :] + tl.load(ln_b_ptr + D + cols)[None, :]
    w_x = w_ptr + cols[:, None] * (2 * D) + cols[None, :]  # rows of the x half, forget columns
    w_h = w_x + D * (2 * D)  # rows of the h half
    forget = tl.dot(z_x, tl.load(w_x)) + tl.dot(z_h, tl.load(w_h)) + tl.load(b_ptr + cols)[None, :]
    candidate = tl.dot(z_x, tl.load(w_x + D)) + tl.dot(z_h, tl.load(w_h + D)) + tl.load(b_ptr + D + cols)[None, :]
    return z_x, z_h, tl.sigmoid(forget), tanh(candidate)


@triton.jit
def iru_forward_kernel(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, h_out_ptr, c_out_ptr, rows, K: tl.constexpr,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    tile = offs_m[:, None] * D + tl.arange(0, D)[None, :]
    x = tl.load(x_ptr + tile, mask=row_ok[:, None], other=0.0)
    c = tl.zeros((BLOCK_M, D), tl.float32)
    h = tl.zeros((BLOCK_M, D), tl.float32)
    for k in range(K):
        x_hat, h_hat, _ = normalise(x, h, D, EPS)
        _, _, forget, candidate = gates(x_hat, h_hat, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, D)
        c = forget * c + (1 - forget) * candidate
        h = h + tanh(c)
        tl.store(h_out_ptr + k * rows * D + tile, h, mask=row_ok[:, None])
        tl.store(c_out_ptr + k * rows * D + tile, c, mask=row_ok[:, None])


@triton.jit
def iru_backward_kernel(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, h_ptr, c_ptr, dh_ptr, dx_ptr, partial_ptr, rows,
                        K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr):
    """Per program, its rows' gradient of x_emb and its share of the parameter gradients, laid out in its row of
    partial_ptr as [d gate weight (2D x 2D), d gate bias (2D), d LayerNorm scale (2D), d LayerNorm shift (2D)]."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    cols = tl.arange(0, D)
    tile = offs_m[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + tile, mask=row_ok[:, None], other=0.0)
    w_x = w_ptr + cols[:, None] * (2 * D) + cols[None, :]
    w_h = w_x + D * (2 * D)
    # The weight gradient's four D x D blocks: (x or h rows) x (forget or candidate columns).
    dw_xf = tl.zeros((D, D), tl.float32)
    dw_xi = tl.zeros((D, D), tl.float32)
    dw_hf = tl.zeros((D, D), tl.float32)
    dw_hi = tl.zeros((D, D), tl.float32)
    db_f = tl.zeros((D,), tl.float32)
    db_i = tl.zeros((D,), tl.float32)
    dlnw_x = tl.zeros((D,), tl.float32)
    dlnw_h = tl.zeros((D,), tl.float32)
    dlnb_x = tl.zeros((D,), tl.float32)
    dlnb_h = tl.zeros((D,), tl.float32)
    dx = tl.zeros((BLOCK_M, D), tl.float32)
    dh_carry = tl.zeros((BLOCK_M, D), tl.float32)  # d loss / d h_k from the deeper steps
    dc_carry = tl.zeros((BLOCK_M, D), tl.float32)  # d loss / d c_k from the deeper steps
    for step in range(K):
        k = K - 1 - step
        c = tl.load(c_ptr + k * rows * D + tile, mask=row_ok[:, None], other=0.0)
        previous = tl.maximum(k - 1, 0) * rows * D + tile  # depth 0's h and c are zeros
        h_prev = tl.where(k > 0, tl.load(h_ptr + previous, mask=row_ok[:, None], other=0.0), 0.0)
        c_prev = tl.where(k > 0, tl.load(c_ptr + previous, mask=row_ok[:, None], other=0.0), 0.0)
        x_hat, h_hat, rstd = normalise(x, h_prev, D, EPS)
        z_x, z_h, forget, candidate = gates(x_hat, h_hat, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, D)

        # h_k = h_{k-1} + tanh(c_k), c_k = f c_{k-1} + (1 - f) i
        dh = tl.load(dh_ptr + k * rows * D + tile, mask=row_ok[:, None], other=0.0) + dh_carry
        tanh_c = tanh(c)
        dc = dc_carry + dh * (1 - tanh_c * tanh_c)
        d_forget = dc * (c_prev - candidate) * forget * (1 - forget)
        d_candidate = dc * (1 - forget) * (1 - candidate * candidate)
        dc_carry = dc * forget
        dh_carry = dh

        # The GEMM: z W + b.
        dw_xf += tl.dot(tl.trans(z_x), d_forget)
        dw_xi += tl.dot(tl.trans(z_x), d_candidate)
        dw_hf += tl.dot(tl.trans(z_h), d_forget)
        dw_hi += tl.dot(tl.trans(z_h), d_candidate)
        db_f += tl.sum(d_forget, 0)
        db_i += tl.sum(d_candidate, 0)
        dz_x = tl.dot(d_forget, tl.trans(tl.load(w_x))) + tl.dot(d_candidate, tl.trans(tl.load(w_x + D)))
        dz_h = tl.dot(d_forget, tl.trans(tl.load(w_h))) + tl.dot(d_candidate, tl.trans(tl.load(w_h + D)))

        # The LayerNorm over the 2D features of concat[x, h_{k-1}].
        dlnw_x += tl.sum(dz_x * x_hat, 0)
        dlnw_h += tl.sum(dz_h * h_hat, 0)
        dlnb_x += tl.sum(dz_x, 0)
        dlnb_h += tl.sum(dz_h, 0)
        dxh_x = dz_x * tl.load(ln_w_ptr + cols)[None, :]
        dxh_h = dz_h * tl.load(ln_w_ptr + D + cols)[None, :]
        mean_d = (tl.sum(dxh_x, 1) + tl.sum(dxh_h, 1)) / (2 * D)
        mean_dx = (tl.sum(dxh_x * x_hat, 1) + tl.sum(dxh_h * h_hat, 1)) / (2 * D)
        dx += rstd[:, None] * (dxh_x - mean_d[:, None] - x_hat * mean_dx[:, None])
        dh_carry += rstd[:, None] * (dxh_h - mean_d[:, None] - h_hat * mean_dx[:, None])
    tl.store(dx_ptr + tile, dx, mask=row_ok[:, None])

    out = partial_ptr + pid * (4 * D * D + 6 * D)
    w_tile = cols[:, None] * (2 * D) + cols[None, :]
    tl.store(out + w_tile, dw_xf)
    tl.store(out + w_tile + D, dw_xi)
    tl.store(out + D * (2 * D) + w_tile, dw_hf)
    tl.store(out + D * (2 * D) + w_tile + D, dw_hi)
    vectors = out + 4 * D * D
    tl.store(vectors + cols, db_f)
    tl.store(vectors + D + cols, db_i)
    tl.store(vectors + 2 * D + cols, dlnw_x)
    tl.store(vectors + 3 * D + cols, dlnw_h)
    tl.store(vectors + 4 * D + cols, dlnb_x)
    tl.store(vectors + 5 * D + cols, dlnb_h)


class IRUSteps(torch.autograd.Function):
    """h of depths 1..K from x_emb, the K residual IRU steps in one forward and one backward kernel."""

    BLOCK_M, NUM_WARPS, EPS = 64, 4, 1e-5  # the bench sets the block size and warps

    @staticmethod
    def forward(ctx, x_emb, ln_w, ln_b, w, b, depth):
        x_emb = x_emb.contiguous()
        rows, d = x_emb.shape
        h = x_emb.new_empty(depth, rows, d)
        c = x_emb.new_empty(depth, rows, d)
        grid = (triton.cdiv(rows, IRUSteps.BLOCK_M),)
        iru_forward_kernel[grid](x_emb, ln_w, ln_b, w, b, h, c, rows, K=depth, D=d, BLOCK_M=IRUSteps.BLOCK_M,
                                 EPS=IRUSteps.EPS, num_warps=IRUSteps.NUM_WARPS)
        ctx.save_for_backward(x_emb, ln_w, ln_b, w, b, h, c)
        ctx.depth = depth
        return h

    @staticmethod
    def backward(ctx, dh):
        x_emb, ln_w, ln_b, w, b, h, c = ctx.saved_tensors
        rows, d = x_emb.shape
        programs = triton.cdiv(rows, IRUSteps.BLOCK_M)
        dx = torch.empty_like(x_emb)
        partial = x_emb.new_empty(programs, 4 * d * d + 6 * d)
        iru_backward_kernel[(programs,)](x_emb, ln_w, ln_b, w, b, h, c, dh.contiguous(), dx, partial, rows,
                                         K=ctx.depth, D=d, BLOCK_M=IRUSteps.BLOCK_M, EPS=IRUSteps.EPS,
                                         num_warps=IRUSteps.NUM_WARPS)
        total = partial.sum(0)
        db, dln_w, dln_b = total[4 * d * d:].view(3, 2 * d)
        return dx, dln_w, dln_b, total[:4 * d * d].view(2 * d, 2 * d), db, None


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
