"""Which few-row linear policy and PDL setting make a decode step fastest (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_ab.py [preset...]

A full runner of ``DecodeInputs`` (context 1024, batches 1, 8, 64) captured under each
policy of ``graphcap.opsdb.triton.linear.fused_rows`` (today's; the RMSNorm-prologue
kernel for q/k/v and the LM head up to 64 rows; every fused op up to 64 rows at any
weight size), with PDL on and off; calls timed interleaved, kernels per step and GPU idle
from the profiler, logits compared with today's policy. JSON in $OUT/decode-ab.json."""

import json
import os
import sys

import torch
from probe_common import captured_under, prefilled_decode

from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps, step_bytes
from graphcap.bench.decode_attention import PEAK_BYTES_PER_S
from graphcap.opsdb.triton import linear

CONTEXT, BATCHES = 1024, (1, 8, 64)
TODAY = linear.fused_rows
POLICIES = {
    "today": TODAY,
    "norm-linear-64": lambda w, kind: 64 if kind == "plain" else TODAY(w, kind),
    "all-64": lambda w, kind: 64,
}


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners = captured_under(model, cache, BATCHES, linear, "fused_rows", POLICIES)
    cases = {}
    for b in BATCHES:
        for key, r in runners.items():
            cases[(b, *key)] = (lambda r=r, b=b: r(tokens[:b], positions=[CONTEXT] * b,
                                                   slots=list(range(b))))
    times = time_interleaved(cases, reps=50, rounds=5)
    rows = []
    for b in BATCHES:
        want = cases[b, "today", False]().float()
        for (name, pdl), _ in runners.items():
            got = cases[b, name, pdl]().float()
            prof = profile_steps(cases[b, name, pdl])
            rows.append({"batch": b, "policy": name, "pdl": pdl,
                         "ms": times[b, name, pdl]["median_ms"],
                         "floor_ms": round(step_bytes(model, b, CONTEXT + 1)
                                           / PEAK_BYTES_PER_S * 1e3, 4),
                         "max_logit_diff_vs_today_pdl_off": float((got - want).abs().max()),
                         "kernels": prof.get("kernels"), "idle_share": prof.get("idle_share"),
                         "top_kernels": prof.get("top_kernels")})
            print(f"{preset} b={b} {name:>15} pdl={pdl!s:>5}: {rows[-1]['ms']:.4f} ms "
                  f"(floor {rows[-1]['floor_ms']}), {rows[-1]['kernels']} kernels, idle "
                  f"{rows[-1]['idle_share']}, diff "
                  f"{rows[-1]['max_logit_diff_vs_today_pdl_off']:.3g}", flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    presets = sys.argv[1:] or ["qwen3-0.6b"]
    out = {"what": "decode step: few-row linear policy x PDL, full runner", **environment(),
           "context": CONTEXT, "models": [one(p) for p in presets]}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-ab.json"), "w") as f:
        json.dump(out, f, indent=1)
