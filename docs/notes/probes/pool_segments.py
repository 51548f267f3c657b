"""The graph pool's segments and blocks for a preset (full, triton attention; default
qwen3-0.6b), the largest shape alone and the 42-shape ladder, warm-up of the first shape
and of every shape, the block the first warm-up sized, against eager's transient (device
side): PYTHONPATH=. python3 docs/notes/probes/pool_segments.py [preset]; JSON in
$OUT/mem-diag-<preset>.json."""

import gc
import json
import os
import sys

import torch

import graphcap
from graphcap import compat
from graphcap.bench.arms import prompts
from graphcap.models import build_model

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts([2048], model.args.vocab_size, "cuda")


def clean():
    gc.collect()
    torch.cuda.synchronize()
    compat.clear_cublas_workspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()  # the pool is sized only from a new peak


def segments(runner):
    return [{"size_mb": round(s["total_size"] / 2**20, 2),
             "blocks": [(round(b["size"] / 2**20, 2), b["state"]) for b in s["blocks"]]}
            for s in runner.pool._segments()]


result = {}
for name, buckets in (("largest-only", [2048]), ("ladder", None)):
    for warmup in ("first", "every"):
        clean()
        kwargs = {"buckets": buckets} if buckets else {"max_tokens": 2048}
        runner = graphcap.capture(model, "full", attention="triton", warmup=warmup, **kwargs)
        result[f"{name}-{warmup}"] = {"pool_mb": round(runner.pool.bytes() / 2**20, 2),
                                      "sized_mb": round(runner.pool.sized_bytes / 2**20, 2),
                                      "segments": segments(runner)}
        del runner
clean()
eager = graphcap.capture(model, "eager", attention="triton")
eager(*inputs[2048], seq_lens=[2048])  # first-use allocations out of the figure
clean()
torch.cuda.reset_peak_memory_stats()
allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
eager(*inputs[2048], seq_lens=[2048])
torch.cuda.synchronize()
result["eager"] = {
    "alloc_peak_mb": round((torch.cuda.max_memory_allocated() - allocated) / 2**20, 2),
    "reserved_peak_above_mb": round((torch.cuda.max_memory_reserved() - reserved) / 2**20, 2)}
print(json.dumps(result, indent=0))
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"mem-diag-{PRESET}.json"), "w") as f:
    json.dump(result, f, indent=1)
