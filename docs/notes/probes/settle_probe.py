"""Why the fastest arm reads slower among every arm than beside its own replay (device
side): PYTHONPATH=. python3 tools/gpu/settle_probe.py; JSON in $OUT/settle-probe.json.

qwen3-0.6b full-triton at 16 tokens, timed beside its bare replay, then interleaved with
the eager arm under settle times of 0 to 200 ms, with the SM clock (NVML) read after
each phase."""

import json
import os

import torch

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import time_interleaved
from graphcap.models import build_model

model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
ids, pos = prompts([16], model.args.vocab_size, "cuda")[16]
full = graphcap.capture(model, "full", buckets=[16], max_requests=1, attention="triton")
eager = graphcap.capture(model, "eager", attention="triton")


def clock() -> int | None:
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no NVML
        return None


def call():
    return full(ids, pos, seq_lens=[16])


result = {"pair": time_interleaved({"call": call, "replay": full.entries[16].replay},
                                   reps=50),
          "pair_clock_mhz": clock()}
for settle in (0, 20, 100, 200):
    t = time_interleaved({"eager": lambda: eager(ids, pos, seq_lens=[16]), "full": call},
                         reps=30, settle_ms=settle)
    result[f"with_eager_settle_{settle}"] = {**t, "clock_mhz": clock()}
    print(settle, t["full"], flush=True)
print(json.dumps(result["pair"]), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "settle-probe.json"), "w") as f:
    json.dump(result, f, indent=1)
