"""Kernel-path variants of a preset's full-triton runner, in one process (device side):

    PYTHONPATH=. python3 tools/gpu/variants_probe.py [preset] [lengths...]

JSON in $OUT/variants-probe-<preset>.json. Each variant is a runner captured under one
setting of the linear kernels' module switches:

- ``default``: the code as it stands;
- ``zeroing``: split-K counters of each launch's own, zeroed by a kernel before it (the
  behaviour before persistent, self-resetting counters);

(At 44bf2d9 a third variant, the q/k/v matmul in the plain Triton kernel after the norm,
ran through a switch since removed: 1.017 against 0.940 ms at 16 tokens,
docs/results/2026-12-01-variants-probe-44bf2d9-h200.json.)

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
from graphcap.bench.prefill import idle_share
from graphcap.models import build_model
from graphcap.opsdb.triton import counters

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
LENGTHS = [int(n) for n in sys.argv[2:]] or [16, 32, 64]
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
result = {**environment(), "preset": PRESET, "lengths": LENGTHS}

persistent = counters.persistent


def variant(name: str):
    """Set the module switches for ``name``; returns a function that restores them."""
    if name == "zeroing":
        counters.persistent = lambda device, blocks: None

    def restore():
        counters.persistent = persistent
    return restore


runners = {}
for name in ("default", "zeroing"):
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
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"variants-probe-{PRESET}.json"),
          "w") as f:
    json.dump(result, f, indent=1)
