"""``graphcap bench build`` and ``graphcap bench memory``: the default 42-shape prefill
ladder (to 2048 tokens) captured under each strategy.

build: wall seconds to capture every shape, split into compile-and-warm-up seconds (the
eager warm-up forwards: tc_piecewise's of every shape, where it compiles its pieces, the
other strategies' of the first shape only, unless ``-warm-every``) and capture seconds;
``pt2_cache``, the lookups of Inductor's on-disk FX graph cache the arm made: hits with
no miss are code an earlier process (the GPU tests, an earlier suite) compiled, a warm
build, several times faster than a cold one.
Before any arm, one eager forward per shape JIT-compiles the kernels (Triton, FA4's CuTe
DSL) that every arm, eager included, would otherwise build on first use, and one full
capture of the ladder pays the process's first CUDA graph and builds the kernels as the
arms launch them (with their request slots): their seconds are reported
apart (``kernel_warmup_s``), so no arm is charged for them by running first; each arm's
first shape is reported too (``first_shape_s``).
memory: graph pool bytes of the 42 shapes; the transient activation peak (allocated bytes
above what was allocated before the call) of the largest prefill with and without graphs;
the serving peak (reserved bytes: what the process holds from the device, over the
largest prefill once the build is done) against the no-graph baseline's, each from an
emptied cache with no cuBLAS workspace left by an earlier arm, so each counts the
workspaces it makes itself; and the build's own peak (``build_peak_bytes``: over the
capture of every shape and the first call), which the serving peak does not see (the
build empties the allocator's cache when it ends).
"""

from __future__ import annotations

import gc
import time

import torch

import graphcap
from graphcap import compat
from graphcap.bench.arms import default_attention, prompts
from graphcap.bench.common import environment
from graphcap.bench.targets import build_targets, memory_targets
from graphcap.core.buckets import prefill_ladder
from graphcap.errors import GraphcapError
from graphcap.models import PRESETS, build_model

# breakable-warm-every: breakable warming up every shape before its capture, the way it
# built before warm-ups were limited to the first shape (the comparison in one run).
BUILD_ARMS = ("breakable", "breakable-warm-every", "full", "tc_piecewise-eager",
              "tc_piecewise-inductor")
MEMORY_ARMS = ("breakable", "full", "tc_piecewise-eager")


def load(model_name: str):
    """A preset's reference decoder, or with ``hf:`` before the preset's name the stock
    transformers model of its config under graphcap.hf (graphcap kernels; ``hf-stock:``,
    its stock ones), last-token logits, bf16 on CUDA; and its vocabulary size."""
    kind, _, preset = model_name.rpartition(":")
    if kind not in ("", "hf", "hf-stock"):
        raise GraphcapError(f"model {model_name!r}: give a preset, hf:<preset> or "
                            "hf-stock:<preset>")
    if not kind:
        return build_model(preset, device="cuda", dtype=torch.bfloat16, logits="last"), \
            PRESETS[preset].vocab_size
    from graphcap.bench.hf import stock_model
    from graphcap.hf import PrefillLM

    hf = stock_model(preset, "cuda", torch.bfloat16)
    lm = PrefillLM(hf, logits="last", kernels="graphcap" if kind == "hf" else "stock")
    return lm, PRESETS[preset].vocab_size


def _cache_counts() -> dict:
    """Lookups of Inductor's FX graph cache so far: ``hit`` (code served from the disk,
    compiled by an earlier process or piece) and ``miss`` (compiled here)."""
    from torch._dynamo.utils import counters

    return {kind: counters["inductor"][f"fxgraph_cache_{kind}"] for kind in ("hit", "miss")}


def _capture(model, arm: str, max_tokens: int, attention: str, cache: dict | None = None):
    """The runner of ``arm`` and its build seconds; ``cache``: gets the FX graph cache
    lookups the build made (:func:`_cache_counts`)."""
    strategy, _, variant = arm.partition("-")
    kwargs = ({"warmup": "every"} if variant == "warm-every"
              else {"compiler": variant} if variant else {})
    torch.cuda.synchronize()
    before = _cache_counts()
    start = time.perf_counter()
    runner = graphcap.capture(model, strategy, max_tokens=max_tokens, attention=attention,
                              **kwargs)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    if cache is not None:
        cache.update({k: n - before[k] for k, n in _cache_counts().items()})
    return runner, seconds


def _collect(workspaces: bool = True) -> None:
    """Free what the last arm held (its pool and, with ``workspaces``, cuBLAS's
    per-stream workspaces, which each arm makes again for the streams it uses) before the
    next is measured. Only between arms: no runner's graphs may be alive (they use their
    workspace)."""
    gc.collect()
    torch.cuda.synchronize()
    if workspaces:
        compat.clear_cublas_workspaces()
    torch.cuda.empty_cache()


def warm_kernels(model, vocab: int, ladder, attention: str) -> float:
    """Seconds of one eager forward per shape of ``ladder`` (the kernels' first-use JIT)
    and of one full capture of the ladder with the arms' request slots (the process's
    first CUDA graph, its capture stream and cuBLAS workspace, and the kernels as the arms
    launch them: Triton specialises on the slot count), charged to no arm."""
    eager = graphcap.capture(model, "eager", attention=attention)
    inputs = prompts(ladder, vocab, "cuda")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for n in ladder:
        eager(*inputs[n], seq_lens=[n])
    graphcap.capture(model, "full", buckets=ladder, attention=attention)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    _collect()
    return seconds


def build(model_name: str = "qwen3-0.6b", arms=BUILD_ARMS, max_tokens: int = 2048,
          progress=None, attention: str | None = None) -> dict:
    model, vocab = load(model_name)
    attention = attention or default_attention("cuda", model)
    kernel_warmup = warm_kernels(model, vocab, prefill_ladder(max_tokens), attention)
    out = {}
    for arm in arms:
        cache = {}
        runner, total = _capture(model, arm, max_tokens, attention, cache)
        report = runner.report()
        out[arm] = {"total_s": round(total, 3), "pt2_cache": cache,
                    "shapes": len(report["shapes"]),
                    "compile_and_warmup_s": report["build_s"]["warmup"],
                    "capture_s": report["build_s"]["capture"],
                    "first_shape_s": report["build_s"]["first_shape"],
                    "warmups": report["warmups"], "warmup_retries": report["warmup_retries"],
                    "segments_at_max": report["segments"][max_tokens],
                    "graph_pool_bytes": report["graph_pool_bytes"]}
        del runner
        _collect()
        if progress is not None:
            progress(arm)
    return {"what": f"graphcap bench build: the {len(prefill_ladder(max_tokens))}-shape "
                    f"prefill ladder to {max_tokens} tokens, {model_name}, bf16",
            **environment(), "model": model_name, "attention": attention,
            "ladder": prefill_ladder(max_tokens),
            "kernel_warmup_s": round(kernel_warmup, 3), "arms": out,
            "targets": build_targets(out, model_name)}


def _largest_prefill(call, n: int) -> tuple[int, int]:
    """(transient bytes above what was allocated before, allocated after) of one call."""
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()  # reserved peaks restart from the current level
    out = call(n)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before
    del out
    return transient, torch.cuda.memory_allocated()


def memory(model_name: str = "qwen3-0.6b", arms=MEMORY_ARMS, max_tokens: int = 2048,
           progress=None, attention: str | None = None) -> dict:
    model, vocab = load(model_name)
    attention = attention or default_attention("cuda", model)
    inputs = prompts([max_tokens], vocab, "cuda")
    weights = torch.cuda.memory_allocated()
    eager = graphcap.capture(model, "eager", attention=attention)

    def call_of(runner):
        return lambda n: runner(*inputs[n], seq_lens=[n])

    call_of(eager)(max_tokens)  # first-use allocations (workspaces) out of the transient
    _collect(workspaces=False)
    transient, _ = _largest_prefill(call_of(eager), max_tokens)
    # Peaks are reserved bytes (what the process holds from the device: graph pools
    # included, allocator caching and rounding too), from an emptied cache and no cuBLAS
    # workspace, so each arm's peak counts the workspaces it makes itself.
    _collect()
    idle = torch.cuda.memory_reserved()  # above the weights: what loading left cached
    torch.cuda.reset_peak_memory_stats()
    call_of(eager)(max_tokens)
    torch.cuda.synchronize()
    result = {"eager": {"transient_bytes": transient, "reserved_before_bytes": idle,
                        "peak_bytes": torch.cuda.max_memory_reserved(),
                        "reserved_bytes": torch.cuda.memory_reserved()}}
    out = {}
    for arm in arms:
        _collect()
        torch.cuda.reset_peak_memory_stats()
        runner, _ = _capture(model, arm, max_tokens, attention)
        call_of(runner)(max_tokens)
        torch.cuda.synchronize()
        build_peak = torch.cuda.max_memory_reserved()  # before the statistics restart
        arm_transient, _ = _largest_prefill(call_of(runner), max_tokens)
        pool = runner.report()["graph_pool_bytes"]
        parts = runner.pool.breakdown()
        out[arm] = {"graph_pool_bytes": pool, "transient_bytes": arm_transient,
                    "peak_bytes": torch.cuda.max_memory_reserved(),
                    "build_peak_bytes": build_peak,
                    "reserved_outside_pool_bytes": torch.cuda.memory_reserved() - pool,
                    "pool_live_bytes": parts["live"], "pool_segments": parts["segments"],
                    "pool_largest_segment_bytes": parts["largest_segment"]}
        del runner
        _collect()
        if progress is not None:
            progress(arm)
    result["arms"] = out
    return {"what": f"graphcap bench memory: {model_name}, bf16, the default ladder to "
                    f"{max_tokens} tokens; bytes from torch.cuda's allocator statistics",
            **environment(), "model": model_name, "attention": attention,
            "weights_bytes": weights, **result, "targets": memory_targets(result)}
