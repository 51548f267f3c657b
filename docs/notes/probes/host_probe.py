"""Why the fastest arm's call reads slower among every arm (device side):

    PYTHONPATH=. python3 tools/gpu/host_probe.py [gc|arms|stages|path|update|mix] [lengths]

JSON in $OUT/host-probe-<mode>.json. Builds every arm of ``graphcap bench prefill`` for
qwen3-0.6b (as the bench does, over ``lengths``), then times them interleaved at the
shortest length, as the bench does, in phases. ``gc``: with the garbage collector as the
process left it, after ``gc.freeze()``, and disabled. ``arms``: every arm, then without
full-flashinfer, without full-flash_attn, and without both. For full-triton each phase
also records the host time of every timed call (from before the first launch to the
call's return) and how many collections of each generation ran during the phase.
``stages``: full-triton built first and alone, then its call's and bare replay's host
time after each further step (eager built and called, breakable built, every case timed
interleaved as the bench does), with the process state that could slow Python down
(threads, torch function/dispatch modes, trace and profile hooks). ``path``: a
full-triton runner's call against its replay preceded by each part of the call's host
path alone (the inputs' copy, the offsets' host-to-device copy, both), timed interleaved
with CUDA events: what each part costs the call while the GPU waits for it.
``update``: the host microseconds of each step of the attention metadata's update (the
offsets' write and host-to-device copy) alone, and of alternatives to the copy.
``mix``: full-triton's call and bare replay timed interleaved (as the bench does) beside
nothing, beside eager, beside 25 ms of sleep (the GPU idle, the host idle) and beside 25
ms of pure Python (the GPU idle, the host busy): whether what slows the call among heavy
arms is on the host or on the device."""

import gc
import json
import os
import statistics
import sys
import time

import torch

from graphcap.bench.arms import ARMS, build_arms
from graphcap.bench.common import cuda_event_ms, environment, time_interleaved
from graphcap.bench.prefill import SETTLE_MS, host_us
from graphcap.models import build_model

MODE = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].isdigit() else "gc"
LENGTHS = [int(n) for n in sys.argv[1:] if n.isdigit()] or [16, 512]
n0 = LENGTHS[0]
model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")


def state() -> dict:
    """What in the process could make every Python-level torch call slower."""
    import threading

    return {"threads": sorted(t.name for t in threading.enumerate()),
            "torch_function_modes": torch._C._len_torch_function_stack(),
            "torch_dispatch_modes": torch._C._len_torch_dispatch_stack(),
            "trace": repr(sys.gettrace()), "profile": repr(sys.getprofile()),
            "gc_objects": len(gc.get_objects())}


if MODE == "mix":
    arms, _ = build_arms(model, ["eager", "full-triton"], LENGTHS, max_requests=1,
                         attention="triton")
    fast = arms["full-triton"]
    entry = fast.runner.entries[n0]

    def burn():
        end = time.perf_counter() + 0.025
        while time.perf_counter() < end:
            pass

    base = {"call": lambda: fast.call(n0), "replay": entry.replay}
    phases = {"alone": {}, "eager": {"eager": lambda: arms["eager"].call(n0)},
              "sleep": {"sleep": lambda: time.sleep(0.025)}, "burn": {"burn": burn},
              "alone_again": {}}
    out = {}
    for name, extra in phases.items():
        times = time_interleaved({**extra, **base}, reps=60, settle_ms=SETTLE_MS)
        out[name] = {k: [v["median_ms"], v["p10_ms"], v["p90_ms"]] for k, v in times.items()}
        print(name, out[name], flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host-probe-mix.json"),
              "w") as f:
        json.dump({**environment(), "lengths": LENGTHS,
                   "ms_median_p10_p90": out}, f, indent=1)
    sys.exit(0)
if MODE == "update":
    import numpy as np

    from graphcap.opsdb.attention import get_backend
    from graphcap.opsdb.attention.base import validate_seq_lens

    meta = get_backend("triton", "cuda").metadata(n0, 1, torch.device("cuda"))
    host, dev, off = meta.cu_seqlens_host, meta.cu_seqlens, meta._host.arrays[0]
    event = torch.cuda.Event()
    plain = torch.zeros(2, dtype=torch.int32)  # pageable

    def numpy_writes():
        off[1:2] = [n0]
        off[2:] = 0
        np.cumsum(off, out=off)

    steps = {
        "update": lambda: meta.update([n0], derive=False),
        "validate": lambda: validate_seq_lens([n0], n0, 1),
        "event_sync": event.synchronize, "event_record": event.record,
        "is_compiling": torch.compiler.is_compiling, "numpy_writes": numpy_writes,
        "copy_pinned_non_blocking": lambda: dev.copy_(host, non_blocking=True),
        "copy_pageable": lambda: dev.copy_(plain),
        "fill_scalar": lambda: dev[1:].fill_(n0),
        "torch_tensor_to_device": lambda: torch.tensor([0, n0], dtype=torch.int32).to(
            "cuda", non_blocking=True),
        "plan": lambda: meta.backend.plan(meta),
    }
    with torch.inference_mode():
        out = {k: host_us(fn, 500) for k, fn in steps.items()}
    print(out, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host-probe-update.json"),
              "w") as f:
        json.dump({**environment(), "lengths": LENGTHS, "host_us": out}, f, indent=1)
    sys.exit(0)
if MODE == "path":
    import graphcap
    from graphcap.bench.arms import prompts

    runner = graphcap.capture(model, "full", buckets=LENGTHS, max_requests=1,
                              attention="triton")
    inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
    ids, pos = inputs[n0]
    entry, meta = runner.entries[n0], runner.metadata[n0]
    rows, _ = runner._input_rows(n0, n0)

    def copy_inputs():
        with torch.inference_mode():
            torch._foreach_copy_(rows, [ids, pos])

    def copy_offsets():
        with torch.inference_mode():
            meta.update([n0], derive=False)

    parts = {"call": lambda: runner(ids, pos, seq_lens=[n0]), "replay": entry.replay,
             "inputs+replay": lambda: (copy_inputs(), entry.replay()),
             "offsets+replay": lambda: (copy_offsets(), entry.replay()),
             "both+replay": lambda: (copy_inputs(), copy_offsets(), entry.replay())}
    times = time_interleaved(parts, reps=100, settle_ms=SETTLE_MS)
    out = {"ms": {k: v["median_ms"] for k, v in times.items()},
           "host_us": {k: host_us(fn, 200) for k, fn in parts.items()},
           "host_us_parts": {"copy_inputs": host_us(copy_inputs, 200),
                             "copy_offsets": host_us(copy_offsets, 200)}}
    print(out, flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host-probe-path.json"),
              "w") as f:
        json.dump({**environment(), "lengths": LENGTHS, **out}, f, indent=1)
    sys.exit(0)
if MODE == "stages":
    from graphcap.bench.prefill import _entry

    built: dict = {}
    stages: dict = {}

    def stage(name: str) -> None:
        fast = built["full-triton"]
        stages[name] = {"host_call_us": host_us(lambda: fast.call(n0), 200),
                        "host_replay_us": host_us(_entry(fast, n0).replay, 200),
                        "call_ms": round(statistics.median(
                            cuda_event_ms(lambda: fast.call(n0)) for _ in range(50)), 4),
                        **state()}
        print(name, stages[name], flush=True)

    for names, label in ((["full-triton"], "full_triton_alone"),
                         (["eager"], "eager_built"), (["breakable"], "breakable_built")):
        arms, _ = build_arms(model, names, LENGTHS, max_requests=1, attention="triton")
        built.update(arms)
        if "eager" in arms:
            for n in LENGTHS:
                arms["eager"].call(n)
        torch.cuda.synchronize()
        stage(label)
    cases = {(n, a): (lambda arm=arm, n=n: arm.call(n)) for n in LENGTHS
             for a, arm in built.items()}
    time_interleaved(cases, reps=30, settle_ms=SETTLE_MS)
    stage("after_interleaved_timing")
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "host-probe-stages.json"),
              "w") as f:
        json.dump({**environment(), "lengths": LENGTHS, "stages": stages}, f, indent=1)
    sys.exit(0)
arms, skipped = build_arms(model, ARMS, LENGTHS, max_requests=1)
result = {**environment(), "lengths": LENGTHS, "arms": list(arms), "skipped": skipped,
          "gc_objects_after_build": len(gc.get_objects()),
          "gc_thresholds": gc.get_threshold()}
print("built", list(arms), result["gc_objects_after_build"], flush=True)
host: list[float] = []


def timer(fn):
    """CUDA-event milliseconds of ``fn`` (the bench's timer), and its host time."""
    start = time.perf_counter()

    def timed():
        fn()
        host.append((time.perf_counter() - start) * 1e6)
    return cuda_event_ms(timed)


def phase(name: str, without=()) -> None:
    fast = "full-triton"
    calls = {a: (lambda arm=arm: arm.call(n0)) for a, arm in arms.items() if a not in without}
    before = [s["collections"] for s in gc.get_stats()]
    host.clear()
    own: dict[str, list[float]] = {}

    def arm_timer(fn):
        ms = timer(fn)
        own.setdefault(id(fn), []).append(host[-1])
        return ms

    times = time_interleaved(calls, reps=30, settle_ms=SETTLE_MS, timer=arm_timer)
    after = [s["collections"] for s in gc.get_stats()]
    fast_host = own.get(id(calls[fast]), [])
    result[name] = {
        "ms": {a: t["median_ms"] for a, t in times.items()},
        "full_triton_host_us_median": round(statistics.median(fast_host), 1),
        "full_triton_host_us_p90": round(sorted(fast_host)[int(0.9 * len(fast_host))], 1),
        "collections_by_generation": [a - b for a, b in zip(after, before, strict=True)],
        "full_triton_host_us_idle": host_us(calls[fast], 100),
    }
    print(name, result[name], flush=True)


if MODE == "gc":
    phase("gc_as_left")
    gc.collect()
    gc.freeze()
    phase("gc_frozen")
    gc.disable()
    phase("gc_disabled")
    gc.enable()
else:
    phase("every_arm")
    phase("without_full_flashinfer", ("full-flashinfer",))
    phase("without_full_flash_attn", ("full-flash_attn",))
    phase("without_both", ("full-flashinfer", "full-flash_attn"))
    phase("every_arm_again")
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"host-probe-{MODE}.json"), "w") as f:
    json.dump(result, f, indent=1)
