"""Kernel-path variants of a preset's full-triton runner, in one process (device side):

    PYTHONPATH=. python3 tools/gpu/variants_probe.py [preset] [lengths...]

JSON in $OUT/variants-probe-<preset>.json. Each variant is a runner captured under one
setting of the linear kernels' module switches:

- ``default``: the code as it stands;
- ``no-ahead``: the RMSNorm kernel before a cuBLAS matmul does not ask L2 for that
  matmul's weight while it waits (the behaviour before the prefetch-ahead);

(At 44bf2d9 the variants were the split-K counters persistent or zeroed by a kernel
before each launch, and the q/k/v matmul in the plain Triton kernel after the norm:
docs/results/2026-12-01-variants-probe-44bf2d9-h200.json.)

Also timed, on the host: the runner's copy of the inputs as one ``_foreach_copy_`` or
one ``copy_`` per input.

Calls and bare replays are timed interleaved, logits compared with ``default``'s, and
each replay profiled at the shortest length (the bench's idle_share)."""

import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from probe_common import calls_and_replays, diffs_vs

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import environment
from graphcap.bench.prefill import host_us, idle_share
from graphcap.models import build_model
from graphcap.opsdb.triton import counters, norm

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
LENGTHS = [int(n) for n in sys.argv[2:]] or [16, 32, 64]
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
result = {**environment(), "preset": PRESET, "lengths": LENGTHS}

prefetches = norm.prefetches
VARIANTS = ("default", "no-ahead")


def variant(name: str):
    """Set the module switches for ``name``; returns a function that restores them."""
    if name == "no-ahead":
        norm.prefetches = lambda t: False

    def restore():
        norm.prefetches = prefetches
    return restore


runners = {}
for name in VARIANTS:
    restore = variant(name)
    try:
        start = time.perf_counter()
        runners[name] = graphcap.capture(model, "full", buckets=LENGTHS, max_requests=1,
                                         attention="triton")
        result[f"build_s_{name}"] = round(time.perf_counter() - start, 3)
    finally:
        restore()

result["max_abs_diff_vs_default"] = diffs_vs(runners, inputs, LENGTHS)
print(json.dumps(result["max_abs_diff_vs_default"]), flush=True)
result["counters_zero_after"] = counters.check_zero() == []

result["timings"] = calls_and_replays(runners, inputs, LENGTHS)

n0 = LENGTHS[0]
result[f"profile_{n0}"] = {name: idle_share(SimpleNamespace(runner=r), n0)
                           for name, r in runners.items()}
for name, p in result[f"profile_{n0}"].items():
    print(name, p["wall_ms"], p["busy_ms"], [(k["kernel"][:30], k["us"])
                                             for k in p["top_kernels"][:6]], flush=True)
ids, pos = inputs[LENGTHS[0]]
bufs = [torch.zeros(4096, dtype=torch.long, device="cuda") for _ in range(2)]
with torch.inference_mode():
    views = [b[:ids.shape[0]] for b in bufs]
    result["host_us_input_copy"] = {
        "foreach_copy": host_us(lambda: torch._foreach_copy_(views, [ids, pos]), 200),
        "two_copies": host_us(lambda: (views[0].copy_(ids), views[1].copy_(pos)), 200),
        "foreach_with_slicing": host_us(lambda: torch._foreach_copy_(
            [b[:ids.shape[0]] for b in bufs], [ids, pos]), 200)}
print(result["host_us_input_copy"], flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"variants-probe-{PRESET}.json"),
          "w") as f:
    json.dump(result, f, indent=1)
