"""The K residual IRU steps of a looped policy as Triton kernels: one forward, one backward (flexloop_gcppo.py's
--fused-iru, and bench/fused_iru_depths.py, which times them against the compiled PyTorch steps).

The IRU step (docs/reference.md): z = LayerNorm(concat[x_emb, h]), f, i = sigmoid, tanh of (z W + b) halves,
c = f c + (1 - f) i, h = h + tanh(c). At GC-PPO's width (64) the gate weights (128 x 128) are small enough for one
program to apply them to its block of rows at every depth, so:

- forward: one kernel. Each program takes BLOCK_M rows of x_emb and runs the K steps (the LayerNorm, the GEMM, the
  gates) with c and h in registers, writing h and c of every depth (the readouts, and what the backward needs).
- backward: one kernel and one sum. Each program walks its rows' depths from K down to 1, recomputing each step's
  LayerNorm and gates from the saved h and c, and carries the gradients of h and c down. Its share of the weight
  gradients (gate weights and bias, LayerNorm scale and shift) stays in registers and is written once; one sum
  over programs gives the gradients. Or, to free the registers that the gate weights' gradient (2D x 2D) holds,
  the kernel writes each depth's z and the gradient of z W + b, and one matmul after it gives that gradient.

They replace PyTorch's several kernels a step forward and more backward (GC-PPO's minibatch update was about 140
kernels of 4 us each on an H200, docs/benchmarks.md). They stage the weights in shared memory: at width 64, 16 rows a
program and Triton's default 3 pipeline stages the backward needs 184,320 bytes (compiled for sm_90 by Triton 3.9),
which Hopper GPUs (H100, H200) have; at 32 rows it needs 237,568, more than an H200's 232,448. Fewer stages need
less: the forward at 1 stage 24,576-53,248 bytes against 137,216-219,136 at 3, and the backward that leaves the
gate weights' gradient to a matmul 24,576-49,152 at 1 stage (16-64 rows) against 151,552-212,992 with it in the
kernel. The bench decides which is faster.

    h = iru_steps(x_emb, gate_norm, gates, K)    # h of depths 1..K, (K, rows, D), differentiable
"""

import torch
try:
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources
except ImportError:
    raise SystemExit("error: the fused IRU kernels need Triton, which PyTorch's CUDA wheels bring on Linux; "
                     "for a CPU check (TRITON_INTERPRET=1), pip install triton")


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
def iru_backward_kernel(x_ptr, ln_w_ptr, ln_b_ptr, w_ptr, b_ptr, h_ptr, c_ptr, dh_ptr, dx_ptr, partial_ptr, z_ptr,
                        dpre_ptr, rows, K: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, EPS: tl.constexpr,
                        WEIGHT_GRAD_IN_KERNEL: tl.constexpr):
    """Per program, its rows' gradient of x_emb and its share of the parameter gradients, laid out in its row of
    partial_ptr as [d gate weight (2D x 2D), d gate bias (2D), d LayerNorm scale (2D), d LayerNorm shift (2D)].
    Without WEIGHT_GRAD_IN_KERNEL the row has no gate weight part: each depth's z and the gradient of z W + b are
    written to z_ptr and dpre_ptr, (K, rows, 2D) each, for one GEMM after the kernel."""
    pid = tl.program_id(0)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < rows
    cols = tl.arange(0, D)
    tile = offs_m[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + tile, mask=row_ok[:, None], other=0.0)
    w_x = w_ptr + cols[:, None] * (2 * D) + cols[None, :]
    w_h = w_x + D * (2 * D)
    if WEIGHT_GRAD_IN_KERNEL:  # the weight gradient's four D x D blocks: (x or h rows) x (forget or candidate)
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
        if WEIGHT_GRAD_IN_KERNEL:
            dw_xf += tl.dot(tl.trans(z_x), d_forget)
            dw_xi += tl.dot(tl.trans(z_x), d_candidate)
            dw_hf += tl.dot(tl.trans(z_h), d_forget)
            dw_hi += tl.dot(tl.trans(z_h), d_candidate)
        else:
            wide = k * rows * (2 * D) + offs_m[:, None] * (2 * D) + cols[None, :]  # (K, rows, 2D) layout
            tl.store(z_ptr + wide, z_x, mask=row_ok[:, None])
            tl.store(z_ptr + wide + D, z_h, mask=row_ok[:, None])
            tl.store(dpre_ptr + wide, d_forget, mask=row_ok[:, None])
            tl.store(dpre_ptr + wide + D, d_candidate, mask=row_ok[:, None])
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

    if WEIGHT_GRAD_IN_KERNEL:
        out = partial_ptr + pid * (4 * D * D + 6 * D)
        w_tile = cols[:, None] * (2 * D) + cols[None, :]
        tl.store(out + w_tile, dw_xf)
        tl.store(out + w_tile + D, dw_xi)
        tl.store(out + D * (2 * D) + w_tile, dw_hf)
        tl.store(out + D * (2 * D) + w_tile + D, dw_hi)
        vectors = out + 4 * D * D
    else:
        vectors = partial_ptr + pid * (6 * D)
    tl.store(vectors + cols, db_f)
    tl.store(vectors + D + cols, db_i)
    tl.store(vectors + 2 * D + cols, dlnw_x)
    tl.store(vectors + 3 * D + cols, dlnw_h)
    tl.store(vectors + 4 * D + cols, dlnb_x)
    tl.store(vectors + 5 * D + cols, dlnb_h)


class SharedMemoryError(RuntimeError):
    """A kernel's block needs more shared memory than the GPU has."""


def launch(kernel, grid, *args, **options):
    """kernel[grid](*args, **options), with a too-large block reported as SharedMemoryError, naming the fix."""
    try:
        kernel[grid](*args, **options)
    except OutOfResources as error:
        raise SharedMemoryError(f"--fused-iru's kernels do not fit this GPU's shared memory ({error}); they need a "
                                "Hopper GPU (H100, H200). Drop --fused-iru") from None


class IRUSteps(torch.autograd.Function):
    """h of depths 1..K from x_emb, the K residual IRU steps in one forward and one backward kernel."""

    # (rows a program, warps, pipeline stages) of each kernel, and where the backward sums the gate weights'
    # gradient: "in kernel" (each program's share in registers) or "gemm" (one matmul after it). On an H200 with
    # PyTorch 2.11's Triton (2026-12-04), at Triton's default 3 stages, the forward was fastest over the wall clock
    # at 32 rows, and the backward, in kernel, fitted the shared memory at 16 rows only.
    # bench/fused_iru_depths.py times every choice.
    FORWARD, BACKWARD, EPS = (32, 4, 3), (16, 4, 3, "in kernel"), 1e-5

    @staticmethod
    def forward(ctx, x_emb, ln_w, ln_b, w, b, depth):
        x_emb = x_emb.contiguous()
        rows, d = x_emb.shape
        h = x_emb.new_empty(depth, rows, d)
        c = x_emb.new_empty(depth, rows, d)
        block_m, num_warps, num_stages = IRUSteps.FORWARD
        launch(iru_forward_kernel, (triton.cdiv(rows, block_m),), x_emb, ln_w, ln_b, w, b, h, c, rows, K=depth, D=d,
               BLOCK_M=block_m, EPS=IRUSteps.EPS, num_warps=num_warps, num_stages=num_stages)
        ctx.save_for_backward(x_emb, ln_w, ln_b, w, b, h, c)
        ctx.depth = depth
        return h

    @staticmethod
    def backward(ctx, dh):
        x_emb, ln_w, ln_b, w, b, h, c = ctx.saved_tensors
        rows, d = x_emb.shape
        block_m, num_warps, num_stages, weight_grad = IRUSteps.BACKWARD
        programs = triton.cdiv(rows, block_m)
        in_kernel = weight_grad == "in kernel"
        dx = torch.empty_like(x_emb)
        partial = x_emb.new_empty(programs, (4 * d * d if in_kernel else 0) + 6 * d)
        if in_kernel:
            z = dpre = x_emb  # not read
        else:  # every depth's z and gradient of z W + b, for the one matmul below
            z, dpre = x_emb.new_empty(ctx.depth, rows, 2 * d), x_emb.new_empty(ctx.depth, rows, 2 * d)
        launch(iru_backward_kernel, (programs,), x_emb, ln_w, ln_b, w, b, h, c, dh.contiguous(), dx, partial, z, dpre,
               rows, K=ctx.depth, D=d, BLOCK_M=block_m, EPS=IRUSteps.EPS, WEIGHT_GRAD_IN_KERNEL=in_kernel,
               num_warps=num_warps, num_stages=num_stages)
        total = partial.sum(0)
        dw = total[:4 * d * d].view(2 * d, 2 * d) if in_kernel else z.flatten(0, 1).t() @ dpre.flatten(0, 1)
        db, dln_w, dln_b = total[-6 * d:].view(3, 2 * d)
        return dx, dln_w, dln_b, dw, db, None


@torch.compiler.disable  # a Triton launch inside an autograd.Function: torch.compile runs it as it is
def iru_steps(x_emb, gate_norm, gates, depth):
    """h of depths 1..K from x_emb (rows, D), (K, rows, D), through the IRU's gate_norm (LayerNorm over 2D) and gates
    (Linear 2D -> 2D, forget half first). Gradients flow to x_emb and to both layers' parameters."""
    return IRUSteps.apply(x_emb, gate_norm.weight, gate_norm.bias, gates.weight.t().contiguous(), gates.bias, depth)
