"""``graphcap bench prefill``: one request, prefill only (the last token's logits), prompt
lengths 16 to 2048, every arm of ``graphcap.bench.arms`` on each model preset (and, asked
for, the stock transformers arms of ``graphcap.bench.hf`` on the preset's config),
interleaved in one run. Speed-ups are ratios measured in that run (the machine's eager times drift).

Also measured, on the full arm: the runner's own overhead (padding, metadata, dispatch)
against the bare graph replay, and the GPU's idle share of a replay (the time some
kernel runs, from torch.profiler, against wall time).
"""

from __future__ import annotations

from collections import Counter

import torch

from graphcap.bench.arms import ARMS, build_arms, default_attention
from graphcap.bench.common import cuda_event_ms, environment, host_us, time_interleaved
from graphcap.bench.hf import HF_ARMS, build_hf_arms
from graphcap.bench.targets import prefill_targets, same_kernels_full
from graphcap.core.buckets import pick_bucket
from graphcap.models import build_model

LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048)
# Untimed calls of an arm before its timed calls in each round (time_interleaved): an
# arm's time depended on the arm before it (performance-history item 26).
SETTLE_MS = 20.0
# Rounds of the interleaved timing: every (length, arm) case once a round, lengths and
# arms alike interleaved, so that no length is timed only in one stretch of the run
# (performance-history item 35).
ROUNDS = 5
# Seconds of untimed passes over every case before the timed rounds: a process fresh
# from building its arms runs its host path slower for its first seconds, and a server
# runs in the steady state (performance-history item 35).
WARMUP_S = 5.0
SETTLE_CALLS, WARMUP_CALLS = 3, 20  # the same, by calls: the ranks of a split model
MODELS = ("qwen3-0.6b", "llama3-8b", "qwen3-30b-a3b-4l")


def step_pacing(device: str) -> dict:
    """``time_interleaved``'s pacing of a suite's steps on ``device``: settling and warm-up
    seconds on CUDA, none elsewhere (smoke runs)."""
    return {"settle_ms": SETTLE_MS, "warmup_s": WARMUP_S} if device == "cuda" else {}


def _full_arm(arms, attention: str):
    """The full arm whose replay is profiled: the one with the attention backend the
    other arms share (the same kernels as eager), else the first by name."""
    return same_kernels_full(arms, attention) or min(
        (n for n in arms if n.startswith("full-")), default=None)


def _entry(arm, length: int):
    """The capture an arm's runner replays for ``length`` tokens."""
    config = arm.runner.config
    return arm.runner.entries[pick_bucket(length, config.buckets, config.max_pad_ratio)[0]]


def runner_overhead(arm, length: int, reps: int = 50) -> dict:
    """The full arm's call against replaying its graph alone, at ``length`` tokens, on
    the device (CUDA events) and on the host (until each returns)."""
    entry = _entry(arm, length)
    times = time_interleaved({"call": lambda: arm.call(length), "replay": entry.replay},
                             reps=reps)
    call, replay = times["call"]["median_ms"], times["replay"]["median_ms"]
    return {"tokens": length, "call_ms": call, "replay_ms": replay,
            "overhead_share": round((call - replay) / replay, 4),
            "host_call_us": host_us(lambda: arm.call(length), reps),
            "host_replay_us": host_us(entry.replay, reps)}


def kernel_spans(events) -> list[tuple[float, float, str]]:
    """``(start_us, end_us, name)`` of each kernel (and device copy or memset) in a
    ``torch.profiler`` event list (``prof.events()``): device events only, without async
    ranges or user annotations, which span many kernels."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.time_range.start, e.time_range.end, e.name) for e in events
            if e.device_type == cuda and not getattr(e, "is_async", False)
            and not getattr(e, "is_user_annotation", False)]


def charged_us(spans) -> Counter:
    """Busy microseconds charged to each name: spans taken in start order, each charged
    the time it adds to their union. Where two overlap, the earlier one keeps the
    overlap: a kernel launched with PDL, started early and waiting on its predecessor,
    is charged only from that one's end."""
    charged, reach = Counter(), float("-inf")
    for start, end, name in sorted(spans):
        charged[name] += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return charged


def busy_us(spans) -> float:
    """Microseconds in which at least one of the spans runs."""
    return sum(charged_us(spans).values())


def top_kernels(spans, reps: int, top: int = 12) -> list[dict]:
    """The kernels that take the most device time in ``reps`` replays: name, launches and
    microseconds per replay (charged as :func:`charged_us` does, so a PDL kernel's wait
    counts once, for its predecessor), and share of the busy time."""
    charged = charged_us(spans)
    launches = Counter(name for _, _, name in spans)
    total = sum(charged.values()) or 1.0
    ranked = sorted(charged, key=lambda name: charged[name], reverse=True)[:top]
    return [{"kernel": name[:90], "launches": round(launches[name] / reps, 2),
             "us": round(charged[name] / reps, 2),
             "share": round(charged[name] / total, 4)} for name in ranked]


def idle_share(arm, length: int, reps: int = 20) -> dict:
    """GPU idle share of back-to-back replays: 1 - busy time / wall time, busy time being
    when at least one kernel runs. Wall time is ``reps`` replays between two events with
    one synchronisation, unprofiled; busy time comes from a second, profiled pass
    (tracing slows the launches it watches), which also names the kernels that take the
    most of it. Kernels launched with PDL start before their predecessor ends and wait
    for it: their summed time (``kernel_ms``) then exceeds the wall time, while the
    union (``busy_ms``) counts each moment once."""
    from torch.profiler import ProfilerActivity, profile

    entry = _entry(arm, length)
    for _ in range(3):
        entry.replay()
    torch.cuda.synchronize()
    wall = cuda_event_ms(lambda: [entry.replay() for _ in range(reps)]) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            entry.replay()
        torch.cuda.synchronize()
    spans = kernel_spans(prof.events())
    summed = sum(end - start for start, end, _ in spans) / 1000 / reps
    busy = busy_us(spans) / 1000 / reps
    # Busy time from the profiled pass against the unprofiled wall time: tracing
    # lengthens the gaps between kernels, not the kernels, so the share is clamped at 0.
    return {"tokens": length, "wall_ms": round(wall, 4), "kernel_ms": round(summed, 4),
            "busy_ms": round(busy, 4), "idle_share": round(max(0.0, 1 - busy / wall), 4),
            "top_kernels": top_kernels(spans, reps)}


def bench_model(name: str, arms_wanted, lengths, reps: int, progress=None,
                device: str = "cuda", attention: str | None = None, tp=None,
                counted: bool = False) -> dict:
    """``tp`` (a :class:`graphcap.tp.TPGroup`): the preset split across its ranks
    (every rank runs this with the same arguments: :mod:`graphcap.bench.tp`), paced by
    counts of calls, as ``counted`` paces an unsplit run beside it."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(name, device=device, dtype=dtype, logits="last", tp=tp)
    device = str(next(model.parameters()).device)  # a rank's own GPU under TP
    attention = attention or default_attention(device, model)
    stock = [a for a in arms_wanted if a in HF_ARMS]
    arms, skipped = build_arms(model, [a for a in arms_wanted if a not in HF_ARMS], lengths,
                               max_requests=1, attention=attention, on_arm=progress)
    if stock and tp is not None:
        skipped.update({a: "a stock transformers model is not split across ranks"
                        for a in stock})
        stock = []
    if stock:  # the stock transformers model of the preset's config, interleaved with it
        more, why = build_hf_arms(name, stock, lengths, attention, device, dtype, progress)
        arms.update(more)
        skipped.update(why)
    cases = {(n, a): (lambda arm=arm, n=n: arm.call(n)) for n in lengths
             for a, arm in arms.items()}
    # Split across ranks, every rank makes the same calls: counts, not seconds.
    pacing = {"settle_ms": SETTLE_MS, "warmup_s": WARMUP_S if device.startswith("cuda")
              else 0.0} if tp is None and not counted else {"settle_calls": SETTLE_CALLS,
                                                            "warmup": WARMUP_CALLS}
    times = time_interleaved(
        cases, reps=reps, rounds=ROUNDS, **pacing,
        on_round=None if progress is None else (lambda done: progress(f"{name} {done}")))
    rows = [{"tokens": n, "ms": {a: times[n, a]["median_ms"] for a in arms},
             "spread": {a: [times[n, a]["p10_ms"], times[n, a]["p90_ms"]] for a in arms}}
            for n in lengths]
    first = _full_arm(arms, attention)
    extra = {}
    if first is not None and device.startswith("cuda"):
        small = min(lengths)
        extra["runner_overhead"] = {"arm": first, **runner_overhead(arms[first], small)}
        at_small = next(r["ms"] for r in rows if r["tokens"] == small)
        fastest = min((a for a in arms if a.startswith("full-")), key=at_small.get)
        if fastest != first:
            extra["runner_overhead_fastest"] = {"arm": fastest,
                                                **runner_overhead(arms[fastest], small)}
        extra["idle"] = [{"arm": first, **idle_share(arms[first], n)}
                         for n in (small, max(lengths))]
    params = sum(p.numel() for p in model.parameters())  # a rank's share under TP
    result = {"model": name, "attention": attention,
              ("rank_params_billions" if tp is not None else "params_billions"):
                  round(params / 1e9, 3),
              "rows": rows, "skipped": skipped,
              "build": {a: {"build_s": round(arm.build_s, 3), **arm.detail}
                        for a, arm in arms.items()}, **extra}
    result["targets"] = prefill_targets(result)
    del arms, model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return result


def run(models=MODELS, arms=ARMS, lengths=LENGTHS, reps: int = 30, progress=None,
        attention: str | None = None) -> dict:
    return {"what": "graphcap bench prefill: one request, prefill only (last-token logits), "
                    "bf16, CUDA-event wall time per call, median of repetitions interleaved "
                    f"over every length and arm ({ROUNDS} rounds)",
            **environment(), "lengths": list(lengths), "arms": list(arms),
            "attention": attention or "default (the best for full capture)",
            "models": [bench_model(m, arms, lengths, reps, progress, attention=attention)
                       for m in models]}
