"""CUDA-event timing: warm-up, then the median of many repetitions."""

from __future__ import annotations

import statistics

import torch


def median_ms(fn, *, warmup: int = 10, reps: int = 50) -> float:
    """Median wall time of ``fn()`` on the GPU, in milliseconds."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
