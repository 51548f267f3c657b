"""gpt-oss-120b's expert layer (128 experts, 4 a token, H = I = 2880) on opsdb's MoE
kernel, bf16 weights against MXFP4 ones through ``tl.dot_scaled`` (device side):

    PYTHONPATH=. [PROBE_TOKENS=1,16,128] python3 docs/notes/probes/moe_mxfp4.py

Per token count: device ms of one call captured in a CUDA graph (graphed_ms), the
weight bytes its routed experts read, and the share of 4.3 TB/s that is; the MXFP4
results' largest difference from the dequantized bf16 weights' call (the same values).
Then at 128 and 512 tokens, the MXFP4 kernels over a sweep of tiles
(``moe.MXFP4_TILES``). JSON in $OUT/moe-mxfp4.json."""

import json
import os

import torch

from graphcap.bench.common import environment
from graphcap.bench.timing import graphed_ms
from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe

E, H, INTER, K = 128, 2880, 2880, 4
PEAK = 4.3e12
torch.manual_seed(0)
dev = "cuda"
w13 = torch.randint(0, 256, (E, 2 * INTER, H // 2), dtype=torch.uint8, device=dev)
w2 = torch.randint(0, 256, (E, H, INTER // 2), dtype=torch.uint8, device=dev)
s13 = torch.randint(119, 122, (E, 2 * INTER, H // 32), dtype=torch.uint8, device=dev)
s2 = torch.randint(119, 122, (E, H, INTER // 32), dtype=torch.uint8, device=dev)
b13 = (torch.randn(E, 2 * INTER, device=dev) * 0.1).bfloat16()
b2 = (torch.randn(E, H, device=dev) * 0.1).bfloat16()
d13 = torch.stack([reference.mxfp4_dequantize(w13[e], s13[e]) for e in range(E)]).bfloat16()
d2 = torch.stack([reference.mxfp4_dequantize(w2[e], s2[e]) for e in range(E)]).bfloat16()
glu = (1.702, 7.0, True)


def calls_of(x, weights, ids):
    return {"bf16": lambda: moe.moe_experts(x, d13, d2, weights, ids, b13, b2, *glu),
            "mxfp4": lambda: moe.moe_experts(x, w13, w2, weights, ids, b13, b2, *glu, s13,
                                             s2)}


rows = []
TOKENS = os.environ.get("PROBE_TOKENS", "1,16,128,512,2048")
for tokens in [int(t) for t in TOKENS.split(",") if t]:
    x = (torch.randn(tokens, H, device=dev) * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(tokens, E, device=dev), K, True)
    touched = int(ids.unique().numel())
    per_expert = {"bf16": 2 * 3 * H * INTER,
                  "mxfp4": 3 * H * INTER // 2 + 3 * H * INTER // 32}
    row = {"tokens": tokens, "experts_touched": touched}
    calls = calls_of(x, weights, ids)
    want = calls["bf16"]().float()
    for name, call in calls.items():
        try:
            got = call().float()
            ms = graphed_ms(call, calls=4, reps=10)
        except Exception as e:  # noqa: BLE001 - a probe records what failed
            row[name] = {"error": f"{type(e).__name__}: {e}"[:400]}
            continue
        nbytes = touched * per_expert[name]
        row[name] = {"ms": round(ms, 4), "weight_bytes": nbytes,
                     "share_of_bandwidth": round(nbytes / (ms / 1e3) / PEAK, 3),
                     "max_diff_vs_bf16": float((got - want).abs().max()),
                     "max_abs": float(want.abs().max())}
    print(json.dumps(row))
    rows.append(row)
TILES = [dict(n1=n1, n2=n2, k=k, warps=w, stages=st)  # k must divide H and I (2880)
         for n1, n2, k, w, st in ((64, 64, 64, 4, 3), (128, 128, 64, 4, 3), (128, 128, 64, 8, 3),
                                  (64, 64, 32, 4, 4), (32, 32, 64, 4, 3), (64, 64, 64, 4, 4))]
sweep = []
for tokens in (128, 512):
    x = (torch.randn(tokens, H, device=dev) * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(tokens, E, device=dev), K, True)
    call = calls_of(x, weights, ids)["mxfp4"]
    want = call().float()
    for tiles in TILES:
        moe.MXFP4_TILES = tiles
        try:
            diff = float((call().float() - want).abs().max())
            entry = {"tokens": tokens, **tiles, "ms": round(graphed_ms(call, calls=4, reps=10), 4),
                     "max_diff": diff}
        except Exception as e:  # noqa: BLE001 - a probe records what failed
            entry = {"tokens": tokens, **tiles, "error": f"{type(e).__name__}: {e}"[:300]}
        print(json.dumps(entry))
        sweep.append(entry)
    moe.MXFP4_TILES, moe.MXFP4_SWAP = None, False
ok = [e for e in sweep if e["tokens"] == 128 and "ms" in e and e["max_diff"] < 0.05]
if ok:  # the fastest tiles at 128 tokens, for a run that follows (moe.MXFP4_TILES)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "best.json"), "w") as f:
        json.dump(min(ok, key=lambda e: e["ms"]), f)
out = {"what": "gpt-oss-120b's expert layer, bf16 against MXFP4 weights", **environment(),
       "command": "PYTHONPATH=. python3 docs/notes/probes/moe_mxfp4.py", "rows": rows,
       "tile_sweep": sweep}
with open(os.path.join(os.environ.get("OUT", "/tmp"), "moe-mxfp4.json"), "w") as f:
    json.dump(out, f, indent=1)
