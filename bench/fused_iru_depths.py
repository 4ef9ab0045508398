"""GC-PPO's K IRU steps, forward and backward, as flexloop_kernels.py's Triton kernels against the compiled PyTorch
steps.

    python bench/fused_iru_depths.py       # on a GPU: us of forward + backward a minibatch, and of a rollout's forward
    TRITON_INTERPRET=1 python bench/fused_iru_depths.py --check --device cpu    # values and gradients, on a CPU

GC-PPO's minibatch update (10,240 rows, hidden width 64) is about 140 kernels of 4 us each (docs/benchmarks.md, "What
bounds each script"), and each of the K recurrent steps is several of them forward and more backward;
flexloop_kernels.py's docstring says how its two kernels replace them. The bench times forward + backward of the
compiled PyTorch steps against IRUSteps, and the forward alone, at each choice of rows a program, warps and pipeline
stages of the kernel (CONFIGS), as the kernels' own device time (`*_device_us`: what each costs inside a CUDA graph,
as the scripts replay it); at the fastest choice, over the wall clock too. A choice that needs more shared memory
than the card has is reported (`too_large`) and skipped. --check compares values and gradients at every choice.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flexloop_kernels import IRUSteps, SharedMemoryError  # noqa: E402  (exits naming Triton when it is missing)
from profiling import microseconds_per_call, profile_kernels  # noqa: E402


# (rows a program, warps, pipeline stages): the choices tried for each kernel; for the backward also where it sums the
# gate weights' gradient (flexloop_kernels.IRUSteps)
FORWARD_CONFIGS = tuple((rows, warps, stages) for rows in (16, 32, 64) for warps in (4, 8) for stages in (1, 2, 3))
BACKWARD_CONFIGS = tuple((*config, weight_grad) for config in FORWARD_CONFIGS for weight_grad in ("in kernel", "gemm"))
CONFIGS = {"FORWARD": FORWARD_CONFIGS, "BACKWARD": BACKWARD_CONFIGS}


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


def config_name(config):
    return ", ".join(["{} rows", "{} warps", "{} stages", "weight gradient {}"][:len(config)]).format(*config)


def device_us(call, device):
    """The kernels' own device time of call(): what it costs inside a CUDA graph, as the scripts replay it."""
    return profile_kernels(call, device)["device_us_per_call"]


def try_configs(kernel, run, result):
    """run() with IRUSteps.<kernel> set to each of its CONFIGS in turn; the configs whose kernel fits the card's
    shared memory (the others go to result["too_large"]), and each one's run() output. IRUSteps keeps its own config
    after."""
    default, fitting = getattr(IRUSteps, kernel), {}
    for config in CONFIGS[kernel]:
        setattr(IRUSteps, kernel, config)
        try:
            fitting[config] = run()
        except SharedMemoryError as error:
            result.setdefault("too_large", {})[f"{kernel.lower()} {config_name(config)}"] = str(error)
    setattr(IRUSteps, kernel, default)
    return fitting


def timings(kernel, fused, compiled, device, repeats, result):
    """result with the device time of fused() at each config of IRUSteps.<kernel> and of compiled(), and at the
    fastest config the wall clock of both."""
    compiled()  # compiles, outside the timings
    times = try_configs(kernel, lambda: device_us(fused, device), result)
    best = min(times, key=times.get)
    default = getattr(IRUSteps, kernel)
    setattr(IRUSteps, kernel, best)
    result.update(compiled_device_us=device_us(compiled, device), fused_device_us=times[best],
                  fused_device_us_by_config={config_name(c): t for c, t in times.items()}, best=config_name(best),
                  compiled_us=microseconds_per_call(compiled, repeats, device),
                  fused_us=microseconds_per_call(fused, repeats, device))
    setattr(IRUSteps, kernel, default)
    result["device_speedup"] = round(result["compiled_device_us"] / result["fused_device_us"], 2)
    return result


@torch.no_grad()
def measure_forward(rows, d, depth, device, repeats, check_only):
    """The forward alone without gradient, as a rollout step acts (GC-PPO: 2,048 envs), at each forward config."""
    x_emb = torch.randn(rows, d, device=device, generator=torch.Generator(device).manual_seed(1))
    params = [t.detach() for t in parameters(d, device)]
    expected = reference_steps(x_emb, *params, depth)
    result = {"what": "forward without gradient", "rows": rows, "hidden": d, "depth": depth}
    fused = lambda: IRUSteps.apply(x_emb, *params, depth)  # noqa: E731
    check = lambda: (expected - fused()).abs().max().item()  # noqa: E731
    result["h_max_difference"] = max(try_configs("FORWARD", check, result).values())
    if check_only:
        return result
    compiled = torch.compile(reference_steps)
    return timings("FORWARD", fused, lambda: compiled(x_emb, *params, depth), device, repeats, result)


def measure(rows, d, depth, device, repeats, check_only):
    """Forward and backward of one minibatch (GC-PPO: 10,240 rows), at each backward config, the forward at its
    default."""
    generator = torch.Generator(device).manual_seed(1)
    x_emb = torch.randn(rows, d, device=device, generator=generator).requires_grad_()
    params = parameters(d, device)
    upstream = torch.randn(depth, rows, d, device=device, generator=generator)
    h_ref, grads_ref = forward_backward(reference_steps, x_emb, params, depth, upstream)
    names = ("x_emb", "gate_norm.weight", "gate_norm.bias", "gates.weight", "gates.bias")
    result = {"what": "forward and backward", "rows": rows, "hidden": d, "depth": depth,
              "forward": config_name(IRUSteps.FORWARD)}
    fused = lambda: forward_backward(IRUSteps.apply, x_emb, params, depth, upstream)  # noqa: E731

    def check():
        h_fused, grads_fused = fused()
        return [(h_ref - h_fused).abs().max().item()] + [((r - f).abs().max() / r.abs().max()).item()
                                                          for r, f in zip(grads_ref, grads_fused)]
    differences = list(try_configs("BACKWARD", check, result).values())
    result["h_max_difference"] = max(difference[0] for difference in differences)
    result["grad_max_relative_difference"] = {name: max(difference[i + 1] for difference in differences)
                                              for i, name in enumerate(names)}
    if check_only:
        return result
    compiled = torch.compile(reference_steps)
    compiled_call = lambda: forward_backward(compiled, x_emb, params, depth, upstream)  # noqa: E731
    return timings("BACKWARD", fused, compiled_call, device, repeats, result)


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
    rows = (100, 100) if cli.check else (cli.rows, cli.rollout_rows)
    # Each line as soon as it is measured, the quicker forward first: Triton compiles every config of each kernel,
    # which takes minutes, and a bench stopped part way still reports what it finished.
    for measure_one, rows_measured in ((measure_forward, rows[1]), (measure, rows[0])):
        result = measure_one(rows_measured, cli.hidden_dim, cli.depth, device, cli.repeats, cli.check)
        print(json.dumps({**result, "device": card, "torch": torch.__version__}), flush=True)
