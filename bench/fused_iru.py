"""One IRU step as one Triton kernel, against the scripts' `advance` (eager and torch.compile'd), without gradient.

    python bench/fused_iru.py                          # on a GPU: microseconds per step at each script's shapes
    python bench/fused_iru.py --bf16                   # the GEMM in bf16, against the step under bf16 autocast
    TRITON_INTERPRET=1 python bench/fused_iru.py --check --device cpu   # the kernel's numbers, on a CPU

(Triton 3.9's interpreter computes bf16 dots wrongly, so --bf16 is checked on a GPU only.)

The IRU step (docs/reference.md) is a LayerNorm, one GEMM and a few elementwise ops:

    z = LayerNorm(concat[x_emb, h]),  f, i = sigmoid, tanh of (z W + b) halves,  c = f c + (1 - f) i,  h = h + tanh(c)

Compiled with inductor's defaults, the GEMM is a cuBLAS call and the LayerNorm and the gates are kernels of their
own before and after it, each a pass over every row in memory. Without gradient (acting, evaluation, adaptive
inference, target networks) nothing between them needs to be kept, so the kernel here does the whole step per block
of rows: the row's LayerNorm statistics, then the GEMM with the normalisation applied as the operand is loaded,
then the gates and the new c and h in the GEMM's epilogue. It writes nothing but the new c and h (each column block
re-reads its rows' x_emb and h, mostly from L2). Members (GC-DQN's critics, GC-IQL's critic ensemble) are a grid
axis, as the scripts' batched matmuls have them. The residual variant only (h carried).

Adaptive inference gathers the rows still going after each depth (network.gather) before the next step: a copy of
x_emb, c and h. With a row index the kernel reads those rows where they are and writes the step's state compacted,
so the compaction costs no pass of its own; the bench times that too (--keep: the share of rows kept).

Prints one JSON line per shape: the compiled step's and the fused kernel's microseconds (each block size tried, the
fastest), on every row and on the gathered rows, and the largest difference of the state between them. Each is
timed twice: over the wall clock, launches included (`*_us`), and as the kernels' own device time from the profiler
(`*_device_us`), which is what a step costs inside the CUDA graphs the scripts replay. The bench
measures; the scripts do not use the kernel.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
try:
    import triton
    import triton.language as tl
except ImportError:
    raise SystemExit("error: bench/fused_iru.py needs Triton, which PyTorch's CUDA wheels bring on Linux; "
                     "for the CPU check (TRITON_INTERPRET=1), pip install triton")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import flexloop_gciql as gciql  # noqa: E402
from profiling import microseconds_per_call, profile_kernels  # noqa: E402

# (script, members, rows per member, hidden width): where the step runs without gradient in each script.
SHAPES = (
    ("gcdqn adaptive inference, 32,768 envs x 6 actions", 2, 32768 * 6, 256),
    ("gcdqn target network, batch 1,024 x 6 actions", 2, 1024 * 6, 256),
    ("gciql target critics, batch 1,024", 2, 1024, 256),
    ("gcppo rollout, 2,048 envs", 1, 2048, 64),
)


@triton.jit
def gate_products(part, source, row_ok, offs_n, mean, rstd, ln_w, ln_b, weights, first_feature, forget, candidate,
                  D: tl.constexpr, BLOCK_K: tl.constexpr, BF16: tl.constexpr):
    """Add one half of z (x_emb's D features, or h's) times its rows of the gate weights to the two accumulators,
    z normalised as it is loaded (and rounded to bf16 with BF16, the weights then bf16 too)."""
    for k in range(0, D, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        feature = first_feature + offs_k
        z = tl.load(part + source[:, None] * D + offs_k[None, :], mask=row_ok[:, None], other=0.0)
        z = (z - mean[:, None]) * rstd[:, None] * tl.load(ln_w + feature)[None, :] + tl.load(ln_b + feature)[None, :]
        if BF16:
            z = z.to(tl.bfloat16)
        w_rows = weights + feature[:, None] * (2 * D)
        forget += tl.dot(z, tl.load(w_rows + offs_n[None, :]))
        candidate += tl.dot(z, tl.load(w_rows + D + offs_n[None, :]))
    return forget, candidate


@triton.jit
def iru_step_kernel(x_emb_ptr, c_ptr, h_ptr, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, source_ptr, x_emb_out_ptr, c_out_ptr,
                    h_out_ptr, in_rows, rows, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, EPS: tl.constexpr, GATHER: tl.constexpr,
                    BF16: tl.constexpr):
    """Output rows [pid_m * BLOCK_M, +BLOCK_M) and hidden columns [pid_n * BLOCK_N, +BLOCK_N) of one member (program
    axis 2). State tensors are (members, in_rows, D) in and (members, rows, D) out, contiguous; the gates' weight is
    (members, 2D, 2D), input by output, its first D outputs the forget gate's. GATHER: output row r advances input
    row source[member, r], and x_emb is copied out too (adaptive inference's compaction, in the same pass);
    otherwise row r advances row r and x_emb stays where it is."""
    pid_m, pid_n, member = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = offs_m < rows
    if GATHER:
        source = tl.load(source_ptr + member * rows + offs_m, mask=row_ok, other=0)
    else:
        source = offs_m
    x_emb, h_in, c_in = (x_emb_ptr + member * in_rows * D, h_ptr + member * in_rows * D,
                         c_ptr + member * in_rows * D)

    # LayerNorm statistics of z = concat[x_emb, h] (2D features), per row, in float32.
    total = tl.zeros((BLOCK_M,), tl.float32)
    total_sq = tl.zeros((BLOCK_M,), tl.float32)
    for k in range(0, D, BLOCK_K):
        offs_k = k + tl.arange(0, BLOCK_K)
        z_x = tl.load(x_emb + source[:, None] * D + offs_k[None, :], mask=row_ok[:, None], other=0.0)
        z_h = tl.load(h_in + source[:, None] * D + offs_k[None, :], mask=row_ok[:, None], other=0.0)
        total += tl.sum(z_x, 1) + tl.sum(z_h, 1)
        total_sq += tl.sum(z_x * z_x, 1) + tl.sum(z_h * z_h, 1)
        if GATHER:
            if pid_n == 0:  # one column block copies the compacted x_emb
                out = x_emb_out_ptr + member * rows * D + offs_m[:, None] * D + offs_k[None, :]
                tl.store(out, z_x, mask=row_ok[:, None])
    mean = total / (2 * D)
    rstd = 1.0 / tl.sqrt(total_sq / (2 * D) - mean * mean + EPS)

    # z W for the forget and the input columns of this block.
    forget = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    candidate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    ln_w, ln_b = ln_w_ptr + member * 2 * D, ln_b_ptr + member * 2 * D
    weights = w_ptr + member * (2 * D) * (2 * D)
    forget, candidate = gate_products(x_emb, source, row_ok, offs_n, mean, rstd, ln_w, ln_b, weights, 0, forget,
                                      candidate, D, BLOCK_K, BF16)
    forget, candidate = gate_products(h_in, source, row_ok, offs_n, mean, rstd, ln_w, ln_b, weights, D, forget,
                                      candidate, D, BLOCK_K, BF16)

    # The gates and the new state, in the GEMM's epilogue (tanh(x) = 2 sigmoid(2x) - 1).
    forget = tl.sigmoid(forget + tl.load(b_ptr + member * 2 * D + offs_n)[None, :])
    candidate = 2 * tl.sigmoid(2 * (candidate + tl.load(b_ptr + member * 2 * D + D + offs_n)[None, :])) - 1
    tile_in = source[:, None] * D + offs_n[None, :]
    c = tl.load(c_in + tile_in, mask=row_ok[:, None], other=0.0)
    h = tl.load(h_in + tile_in, mask=row_ok[:, None], other=0.0)
    c = forget * c + (1 - forget) * candidate
    h = h + 2 * tl.sigmoid(2 * c) - 1
    tile_out = member * rows * D + offs_m[:, None] * D + offs_n[None, :]
    tl.store(c_out_ptr + tile_out, c, mask=row_ok[:, None])
    tl.store(h_out_ptr + tile_out, h, mask=row_ok[:, None])


# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) tried per shape; the bench reports each and the fastest.
CONFIGS = ((64, 64, 32, 4), (64, 128, 32, 8), (128, 64, 32, 8), (32, 64, 64, 4), (128, 128, 32, 8), (64, 64, 64, 4))


def fused_advance(iru, state, config=(64, 64, 32, 4), source=None, bf16=False):
    """iru.advance(state) without gradient, in one kernel; with `source` (members, rows) long, the step of the rows
    source[m] of each member m alone, compacted: iru.advance(gather(state, source)). iru: an IRU of flexloop_gciql
    (members, EnsembleLinear gates); state: (x_emb, c, h), each (members, in_rows, D) float32; config: (BLOCK_M,
    BLOCK_N, BLOCK_K, num_warps), BLOCK_N and BLOCK_K at most D. bf16: the GEMM's operands in bf16 (accumulated in
    float32), as the scripts' --bf16 autocast runs it; the state stays float32."""
    x_emb, c, h = (t.contiguous() for t in state)
    members, in_rows, d = x_emb.shape
    rows = in_rows if source is None else source.shape[1]
    block_m, block_n, block_k, num_warps = config
    x_emb_out = x_emb if source is None else x_emb.new_empty(members, rows, d)
    c_out, h_out = c.new_empty(members, rows, d), h.new_empty(members, rows, d)
    grid = (triton.cdiv(rows, block_m), d // block_n, members)
    weight = iru.gates.weight.to(torch.bfloat16) if bf16 else iru.gates.weight
    iru_step_kernel[grid](x_emb, c, h, iru.gate_norm.weight, iru.gate_norm.bias, weight, iru.gates.bias,
                          c if source is None else source.contiguous(), x_emb_out, c_out, h_out, in_rows, rows,
                          D=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EPS=1e-5,
                          GATHER=source is not None, BF16=bf16, num_warps=num_warps)
    return x_emb_out, c_out, h_out


def gathered_advance(iru, state, source):
    """What fused_advance(..., source=source) computes, in PyTorch: gather the rows (as adaptive inference's
    network.gather does), then the step."""
    index = source[:, :, None].expand(-1, -1, state[0].shape[-1])
    return iru.advance(tuple(t.gather(1, index) for t in state))


def random_state(members, rows, d, device, generator):
    """A state as a few steps leave it: x_emb normalised, c in (-1, 1), h of a few tanh's."""
    x_emb = torch.randn(members, rows, d, device=device, generator=generator)
    c = torch.rand(members, rows, d, device=device, generator=generator) * 2 - 1
    h = torch.randn(members, rows, d, device=device, generator=generator) * 2
    return x_emb, c, h


@torch.no_grad()
def measure(name, members, rows, d, device, repeats, check_only, keep, bf16):
    """The step on every row, then on a random `keep` of the rows, gathered: adaptive inference's step after a
    compaction. bf16: the reference runs under bf16 autocast (as the scripts' --bf16), the kernel's GEMM in bf16."""
    torch.manual_seed(0)
    iru = gciql.IRU(in_dim=8, out_dim=1, hidden_dim=d, members=members).to(device)
    iru.gate_norm.weight.uniform_(0.5, 1.5)  # LayerNorm's affine away from its initial 1 and 0, so the check sees it
    iru.gate_norm.bias.uniform_(-0.2, 0.2)
    generator = torch.Generator(device).manual_seed(0)
    state = random_state(members, rows, d, device, generator)
    kept = max(1, int(rows * keep))
    source = torch.stack([torch.randperm(rows, device=device, generator=generator)[:kept].sort().values
                          for _ in range(members)])
    configs = [config for config in CONFIGS if config[1] <= d and config[2] <= d and d % config[1] == 0]
    autocast = lambda: torch.autocast(device.type, torch.bfloat16, enabled=bf16)  # noqa: E731
    references = {"all": lambda s: iru.advance(s), "gathered": lambda s: gathered_advance(iru, s, source)}
    fused_steps = {"all": lambda s, config: fused_advance(iru, s, config, bf16=bf16),
                   "gathered": lambda s, config: fused_advance(iru, s, config, source, bf16)}
    result = {"shape": name, "members": members, "rows": rows, "hidden": d, "kept_rows": kept, "bf16": bf16,
              "max_difference": 0.0}
    for which, reference in references.items():
        with autocast():
            expected = reference(state)
        for config in configs:
            fused = fused_steps[which](state, config)
            differences = [(e.float() - f).abs().max().item() for e, f in zip(expected, fused)]
            result["max_difference"] = max([result["max_difference"]] + differences)
    if check_only:
        return result
    for which, reference in references.items():
        compiled = torch.compile(reference)
        with autocast():
            compiled_us = microseconds_per_call(lambda: compiled(state), repeats, device)
            eager_us = microseconds_per_call(lambda: reference(state), repeats, device)
        fused = {str(config): microseconds_per_call(lambda: fused_steps[which](state, config), repeats, device)
                 for config in configs}
        best = next(config for config in configs if fused[str(config)] == min(fused.values()))
        # The kernels' own time, without launches: what the step costs inside a CUDA graph, as the scripts run it.
        with autocast():
            compiled_device_us = profile_kernels(lambda: compiled(state), device)["device_us_per_call"]
        fused_device_us = profile_kernels(lambda: fused_steps[which](state, best), device)["device_us_per_call"]
        result[which] = {"eager_us": eager_us, "compiled_us": compiled_us,
                         "fused_us": min(fused.values()), "fused_us_by_config": fused,
                         "speedup_over_compiled": round(compiled_us / min(fused.values()), 2),
                         "compiled_device_us": compiled_device_us, "fused_device_us": fused_device_us,
                         "device_speedup": round(compiled_device_us / fused_device_us, 2)}
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--keep", type=float, default=0.6, help="the share of rows the gathered step advances")
    parser.add_argument("--bf16", action="store_true", help="the GEMM in bf16, against the step under bf16 autocast")
    parser.add_argument("--check", action="store_true", help="compare the numbers only, at small shapes (on a CPU: "
                        "with TRITON_INTERPRET=1)")
    cli = parser.parse_args()
    device = torch.device(cli.device)
    torch.backends.cuda.matmul.allow_tf32 = True  # as the scripts run: the kernel's tl.dot is TF32 too
    card = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    shapes = [(name, members, 100 if cli.check else rows, d) for name, members, rows, d in SHAPES]
    for name, members, rows, d in shapes:
        result = measure(name, members, rows, d, device, cli.repeats, cli.check, cli.keep, cli.bf16)
        print(json.dumps({**result, "device": card, "torch": torch.__version__}), flush=True)
