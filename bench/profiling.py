"""GPU profiles for the bench scripts: where a step's device time goes by kind of kernel, its largest kernels (and,
uncaptured, the ops that launch them), and torch.compile's inductor options to try (--inductor KEY=VALUE)."""

import ast
import re
import time

import torch

INDUCTOR_HELP = ("torch._inductor.config options for every compile of the run, e.g. combo_kernels=True "
                 "aggressive_fusion=True coordinate_descent_tuning=True (a measurement: the scripts use the defaults)")


def set_inductor_options(pairs):
    """Set torch._inductor.config options from KEY=VALUE strings (VALUE a Python literal); return them as a dict
    for the JSON line. An unknown key or a value of another type is an error, not a silent no-op."""
    import torch._inductor.config as config
    options = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep:
            raise SystemExit(f"error: --inductor takes KEY=VALUE, got {pair!r} (e.g. combo_kernels=True)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise SystemExit(f"error: --inductor {key}: {text!r} is not a Python literal (True, 8, 0.5, 'name')")
        try:
            current = getattr(config, key)
        except AttributeError:
            raise SystemExit(f"error: --inductor {key}: torch._inductor.config has no such option")
        if current is not None and not isinstance(value, type(current)):
            raise SystemExit(f"error: --inductor {key}: expected a {type(current).__name__} like its default "
                             f"{current!r}, got {value!r}")
        setattr(config, key, value)
        options[key] = value
    return options


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def grads_written_by_backward(optimizer):
    """A measurement only: the scripts' zero_grad(set_to_none=False) made set_to_none=True, so backward writes the
    gradients instead of adding them to zeros."""
    zero_grad = optimizer.zero_grad
    optimizer.zero_grad = lambda set_to_none=True: zero_grad(set_to_none=True)


# Matched against a kernel's whole demangled name, whose template arguments name the functor (on a CPU, ATen op names).
KERNEL_KINDS = (
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|splitK|^triton_tem|aten::(bmm|mm|addmm|matmul|linear)\b",
                          re.I)),
    # "_to_copy" in an inductor kernel's name is a dtype cast fused into its elementwise work, not a copy
    ("gather and copy", re.compile(r"index|gather|scatter|CatArray|aten::cat\b|(?<!_to_)copy|scan|cumsum|nonzero|sort",
                                   re.I)),
)
OTHER_KIND = "elementwise and reductions"


def kernel_kind(name):
    """The kind of a kernel, from its name: 'void at::native::index_elementwise_kernel<...>(...)' is a gather, an
    elementwise kernel of 'direct_copy_kernel_cuda' a copy."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), OTHER_KIND)


def profile_kernels(fn, device, calls=20, top=8):
    """Per call of fn(), over `calls` calls: the kernels' summed device time, split by kind of kernel (matmul; gather
    and copy; elementwise and reductions), how many kernels of each kind, and the `top` largest kernels with their
    kind and share. Against a call's wall time, the device time says how busy fn keeps the GPU. On a CPU the
    "kernels" are the ATen ops' own CPU time."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            fn()
        sync(device)
    kind_name = "CUDA" if on_gpu else "CPU"
    self_us = (lambda e: e.self_device_time_total) if on_gpu else (lambda e: e.self_cpu_time_total)
    events = [e for e in prof.key_averages() if e.device_type.name == kind_name and self_us(e) > 0]
    kinds = [name for name, _ in KERNEL_KINDS] + [OTHER_KIND]
    us_by_kind, count_by_kind = dict.fromkeys(kinds, 0.0), dict.fromkeys(kinds, 0.0)
    for event in events:
        us_by_kind[kernel_kind(event.key)] += self_us(event) / calls
        count_by_kind[kernel_kind(event.key)] += event.count / calls
    us_by_kind = {k: round(v, 1) for k, v in us_by_kind.items()}
    total = sum(us_by_kind.values())
    events.sort(key=self_us, reverse=True)
    largest = [{"kernel": e.key[:90], "kind": kernel_kind(e.key), "share": round(self_us(e) / calls / total, 3),
                "us_per_call": round(self_us(e) / calls, 1)} for e in events[:top]]
    return {"device_us_per_call": round(total, 1), "us_per_call_by_kind": us_by_kind,
            "kernels_per_call": round(sum(count_by_kind.values()), 1),
            "kernels_per_call_by_kind": {k: round(v, 1) for k, v in count_by_kind.items()}, "largest": largest}


def seconds_for(fn, calls, device):
    """The wall seconds of `calls` calls of fn(), with the device synchronised before and after."""
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync(device)
    return time.perf_counter() - start


def microseconds_per_call(fn, calls, device, warmup=3):
    """The wall µs of one call of fn(), launches included, over `calls` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return round(seconds_for(fn, calls, device) / calls * 1e6, 1)


def update_profile(update, device, updates_per_second, flops=None):
    """An update's profile_kernels, how busy it keeps the GPU (its device time over its wall time), and with its
    counted `flops` the TFLOP/s it makes (matmul_rates)."""
    profile = profile_kernels(update, device)
    result = {"profile": profile,
              "gpu_busy_share": round(profile["device_us_per_call"] / 1e6 * updates_per_second, 3)}
    if flops is not None:
        result.update(matmul_rates(flops, profile, updates_per_second))
    return result


def matmul_flops(fn):
    """The floating-point operations of one eager call of fn(), as PyTorch's FlopCounterMode counts them: the
    matrix products (and convolutions), forward and backward, the work a GPU's tensor cores do. It runs fn once."""
    from torch.utils.flop_counter import FlopCounterMode
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def matmul_rates(flops, profile, calls_per_second):
    """What the counted FLOPs of a call make of its profile: TFLOP/s over the matmul kernels' time and over the wall
    clock. Far below the card's peak (an H200: about 790 TFLOP/s in bf16 on large products) over the matmuls' own
    time, the products are too small to fill it; far below over the wall clock, the rest of the step bounds it."""
    matmul_seconds = profile["us_per_call_by_kind"]["matmul"] / 1e6
    return {"tflops_in_matmuls": round(flops / matmul_seconds / 1e12, 1) if matmul_seconds else None,
            "tflops_over_wall": round(flops * calls_per_second / 1e12, 1)}


def profile_ops(update, device, updates=20, top=8):
    """The `top` operators by the GPU time of the kernels they launch themselves, with their input shapes: where
    a kernel of `largest_costs` comes from (an ATen kernel between inductor's Triton kernels is a fallback op)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        for _ in range(updates):
            update()
        sync(device)
    ops = [e for e in prof.key_averages(group_by_input_shape=True)
           if e.device_type.name == "CPU" and e.self_device_time_total > 0]
    ops.sort(key=lambda e: e.self_device_time_total, reverse=True)
    return [{"op": e.key[:90], "shapes": str(e.input_shapes)[:160], "calls_per_update": e.count / updates,
             "us_per_update": round(e.self_device_time_total / updates, 1)} for e in ops[:top]]
