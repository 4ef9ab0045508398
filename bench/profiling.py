"""GPU profiles for the bench scripts: the largest kernels of a step (and, uncaptured, the ops that launch them)."""

import torch


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
