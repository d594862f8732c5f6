"""How one forward + backward of the job scales with its micro-batch and its threads,
measured here next to the bench run.

A step's forward/backward is not proportional to its samples: every op pays a fixed
cost (dispatch, autograd bookkeeping, a kernel launch) that a small model on a small
batch spends most of its time in, and small ops do not spread over more threads the
way a large matmul does. Linear scaling predicted the quickstart 40 % off for 2x the
batch. So the bench times the job's own model on its own samples at the measured
micro-batch and at half of it (fixed time + time per sample, from the two points), and
at the measured thread count and one other (the thread speed-up this job gets). The
planner reads the curves instead of assuming them.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["probe_forward_backward"]

_WARMUP = 2
_REPEATS = 7


def probe_forward_backward(config: Any, micro_batch_size: int, threads: int, other_threads: int | None) -> dict:
    """``{"micro_batch_sizes": [m/2, m], "seconds": [...], "threads": t, "fixed_s": ...,
    "per_sample_s": ..., "thread_seconds": {t: s, t': s'}}``, medians of 7 timed passes.

    Raises:
        ValueError: the job's model or samples cannot be built here.
    """
    import torch

    from skylift.data.loaders import build_loaders
    from skylift.recipes import build_recipe
    from skylift.train.micro_batch import slice_batch
    from skylift.train.runtime import Runtime

    resolved = config.with_micro_batch(micro_batch_size, 1)
    runtime = Runtime(precision=config.precision, device=config.device, channels_last=config.channels_last,
                      activation_checkpointing=(config.activation_checkpointing.module_types
                                                if config.activation_checkpointing.enabled else None))  # fmt: skip
    recipe = build_recipe(resolved)
    loaders = build_loaders(resolved, recipe, runtime.dist, pin_memory=False)
    loaders.order.set_epoch(0)
    batch = next(iter(loaders.train))
    model = runtime.place_model(recipe.build_model(loaders.data).train())
    half = max(1, micro_batch_size // 2)
    sizes = [half, micro_batch_size] if half < micro_batch_size else [micro_batch_size]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        seconds = [_time(model, slice_batch(batch, size, recipe.batch_size), recipe, runtime) for size in sizes]
        thread_seconds = {threads: seconds[-1]}
        if other_threads:
            torch.set_num_threads(other_threads)
            thread_seconds[other_threads] = _time(model, batch, recipe, runtime)
    finally:
        torch.set_num_threads(previous)
    if len(sizes) == 2:
        per_sample = max(0.0, (seconds[1] - seconds[0]) / (sizes[1] - sizes[0]))
        fixed = max(0.0, seconds[1] - per_sample * sizes[1])
    else:
        per_sample, fixed = seconds[0] / sizes[0], 0.0
    return {"micro_batch_sizes": sizes, "seconds": seconds, "threads": threads, "fixed_s": fixed,
            "per_sample_s": per_sample, "thread_seconds": {str(k): v for k, v in thread_seconds.items()}}


def _time(model: Any, batch: Any, recipe: Any, runtime: Any) -> float:
    import torch

    moved = runtime.to_device(batch)
    timings = []
    for index in range(_WARMUP + _REPEATS):
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        started = time.perf_counter()
        with runtime.precision.autocast(runtime.device.type):
            loss = recipe.training_loss(model, moved)
        loss.backward()
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        if index >= _WARMUP:
            timings.append(time.perf_counter() - started)
        model.zero_grad(set_to_none=True)
    return statistics.median(timings)
