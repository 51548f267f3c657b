"""Which kernel makes PDL slower past 64 rows (device side):

    PYTHONPATH=. python3 tools/gpu/pdl_long.py [tokens]

qwen3-0.6b full-triton at ``tokens`` (default 256), captured with PDL off, then with it
on for one kernel family at a time (the norms, qkv_norm_rope, attention) and for all
three, the row limit lifted; bare replays timed interleaved. JSON in
$OUT/pdl-long-<tokens>.json."""

import json
import os
import sys

import torch

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import environment, time_interleaved
from graphcap.models import build_model
from graphcap.opsdb.triton import attention, common, norm, qkv

TOKENS = int(sys.argv[1]) if len(sys.argv) > 1 else 256
model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
ids, pos = prompts([TOKENS], model.args.vocab_size, "cuda")[TOKENS]
MODULES = {"norm": norm, "qkv": qkv, "attention": attention}


def unlimited(device, rows):
    return {"PDL": True, "launch_pdl": True} if common.pdl(device) else {"PDL": False}


def off(device, rows):
    return {"PDL": False}


runners, reference = {}, None
for variant in ("off", "norm", "qkv", "attention", "all"):
    for name, module in MODULES.items():
        module.pdl_args = unlimited if variant in (name, "all") else off
    runners[variant] = graphcap.capture(model, "full", buckets=[TOKENS], max_requests=1,
                                        attention="triton")
    out = runners[variant](ids, pos, seq_lens=[TOKENS])
    reference = out if reference is None else reference
    assert torch.equal(out, reference), variant
for module in MODULES.values():
    module.pdl_args = common.pdl_args

times = time_interleaved({v: r.entries[TOKENS].replay for v, r in runners.items()},
                         reps=100, settle_ms=20)
result = {**environment(), "tokens": TOKENS, "replay": times}
print({v: t["median_ms"] for v, t in times.items()}, flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"pdl-long-{TOKENS}.json"), "w") as f:
    json.dump(result, f, indent=1)
