"""GPU profiles for the bench scripts: the largest kernels of a step (and, uncaptured, the ops that launch them),
and torch.compile's inductor options to try (--inductor KEY=VALUE)."""

import ast

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


def profile_kernels(update, device, updates=20, top=8):
    """The `top` GPU kernels by total time over `updates` updates, with their share of the GPU time, and how many
    kernels one update launches."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(updates):
            update()
        sync(device)
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"] or list(prof.key_averages())
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    largest = [{"kernel": e.key[:90], "share": round(e.self_device_time_total / total, 3),
                "us_per_update": round(e.self_device_time_total / updates, 1)} for e in events[:top]]
    return largest, round(sum(e.count for e in events) / updates, 1)


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
