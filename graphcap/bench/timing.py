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


def graphed_ms(fn, *, calls: int = 20, warmup: int = 5, reps: int = 20) -> float:
    """Device time of one ``fn()``: ``calls`` back-to-back calls captured in one CUDA graph,
    replayed; launch overhead and Python stay out of the figure."""
    return cycled_ms([fn] * calls, warmup=warmup, reps=reps)


def cycled_ms(calls, *, warmup: int = 3, reps: int = 20) -> float:
    """Device time of one call among ``calls`` (callables over distinct weights, as many
    as it takes to exceed the L2 cache), captured in one CUDA graph and replayed: each
    call reads its weights from memory, as a model's layers do."""
    from graphcap.core.graphs import new_pool

    pool = new_pool("cuda")
    with pool.warmup():
        for call in dict.fromkeys(calls):  # each distinct callable once
            call()
    graph = pool.graph()
    graph.capture(lambda: [call() for call in calls])
    return median_ms(graph.replay, warmup=warmup, reps=reps) / len(calls)
