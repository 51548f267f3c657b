"""The allocator's trace of one capture of a preset's largest shape (an arm as the bench
names it, full by default; the default attention): each large allocation and free on the
capture stream, with its address, size and the graphcap frame that made it, and the
sized block's span; to see where the pool's captures leave holes. Device side:
PYTHONPATH=. python3 docs/notes/probes/pool_trace.py [preset] [tokens] [arm]; JSON in
$OUT/pool-trace-<preset>-<arm>.json."""

import json
import os
import sys

import torch

import graphcap
from graphcap.bench.arms import default_attention
from graphcap.models import build_model

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
TOKENS = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
ARM = sys.argv[3] if len(sys.argv) > 3 else "full"  # as the bench names them
STRATEGY, _, COMPILER = ARM.partition("-")
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
ids = torch.randint(0, model.args.vocab_size, (TOKENS,), device="cuda")
torch.cuda.synchronize()
torch.cuda.empty_cache()
torch.cuda.reset_peak_memory_stats()
torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
runner = graphcap.capture(model, STRATEGY, buckets=[TOKENS],
                          attention=default_attention("cuda", model),
                          **({"compiler": COMPILER} if COMPILER else {}))
snap = torch.cuda.memory._snapshot()
torch.cuda.memory._record_memory_history(enabled=None)


def where(frames):
    own = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames
           if "graphcap" in f["filename"]]
    return own[:3]


stream = runner.pool.stream.cuda_stream
events = []
for e in snap["device_traces"][0]:
    if e["stream"] != stream or e["size"] < (1 << 20):
        continue
    events.append({"action": e["action"], "addr": e["addr"], "mb": round(e["size"] / 2**20, 3),
                   "at": where(e.get("frames", []))})
segs = [{"addr": s["address"], "mb": s["total_size"] / 2**20} for s in runner.pool._segments()]
out = {"preset": PRESET, "tokens": TOKENS, "arm": ARM,
       "sized_mb": runner.pool.sized_bytes / 2**20, "segments": segs, "events": events}
with open(os.path.join(os.environ.get("OUT", "."), f"pool-trace-{PRESET}-{ARM}.json"),
          "w") as f:
    json.dump(out, f, indent=0)
print(len(events), "events;", segs)
