"""Tile choices of the few-row linear kernel inside a whole replay (device side):

    PYTHONPATH=. python3 tools/gpu/tiles_probe.py [preset] [lengths...]

JSON in $OUT/tiles-probe-<preset>.json. ``bench ops`` times a kernel alone; under PDL a
kernel's cost also depends on its neighbours (whether its programs fit beside the
previous kernel's to prefetch, how long its tail holds the next one). Each variant here
is a full-triton runner captured with one change to ``linear.config``'s answer, and
their bare replays are timed interleaved:

- ``default``;
- ``warps8``: eight warps a program;
- ``stages2``: two pipeline stages (half the shared memory, so that a program fits on an
  SM beside the previous kernel's);
- ``swiglu-n16``: 16 columns a program for the SwiGLU (gate/up) projection;
- ``split2`` / ``split8``: the residual projections' K split at most 2 / 8 ways;
- ``bk128``: BLOCK_K 128;
- ``no-prefetch``: no L2 prefetch before the PDL wait.
"""

import json
import os
import sys

import torch
from probe_common import diffs_vs

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.prefill import SETTLE_MS
from graphcap.models import build_model
from graphcap.opsdb.triton import linear as kernel

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
LENGTHS = [int(n) for n in sys.argv[2:]] or [16, 64]
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
result = {**environment(), "preset": PRESET, "lengths": LENGTHS}
config, prefetches = kernel.config, kernel._prefetches


def tiles(change):
    def patched(m, n, k, *, norm, swiglu, sms, element_size=2):
        return change(config(m, n, k, norm=norm, swiglu=swiglu, sms=sms,
                             element_size=element_size), norm, swiglu)
    return patched


VARIANTS = {
    "default": lambda c, norm, swiglu: c,
    "warps8": lambda c, norm, swiglu: {**c, "num_warps": 8},
    "stages2": lambda c, norm, swiglu: {**c, "num_stages": 2},
    "swiglu-n16": lambda c, norm, swiglu: {**c, "BLOCK_N": 16} if swiglu else c,
    "split2": lambda c, norm, swiglu: {**c, "SPLIT_K": min(c["SPLIT_K"], 2)},
    "split8": lambda c, norm, swiglu: {**c, "SPLIT_K": 8} if c["SPLIT_K"] > 1 else c,
    "bk128": lambda c, norm, swiglu: {**c, "BLOCK_K": 128},
    "no-prefetch": None,
}

runners = {}
for name, change in VARIANTS.items():
    if change is None:
        kernel._prefetches = lambda weight: False
    else:
        kernel.config = tiles(change)
    try:
        runners[name] = graphcap.capture(model, "full", buckets=LENGTHS, max_requests=1,
                                         attention="triton")
    except Exception as exc:  # a variant that does not build is recorded, not fatal
        result[f"failed_{name}"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    finally:
        kernel.config, kernel._prefetches = config, prefetches

result["max_abs_diff_vs_default"] = diffs_vs(runners, inputs, LENGTHS)
result["timings"] = {}
for n in LENGTHS:
    arms = {name: r.entries[n].replay for name, r in runners.items()}
    result["timings"][n] = time_interleaved(arms, reps=60, settle_ms=SETTLE_MS)
    print(n, {k: v["median_ms"] for k, v in result["timings"][n].items()}, flush=True)
print(json.dumps(result["max_abs_diff_vs_default"]), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"tiles-probe-{PRESET}.json"),
          "w") as f:
    json.dump(result, f, indent=1)
