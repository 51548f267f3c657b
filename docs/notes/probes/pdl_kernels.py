"""Which kernels PDL helps in a decode step (device side):

    PYTHONPATH=. python3 docs/notes/probes/pdl_kernels.py [preset...]

A full runner of ``DecodeInputs`` (context 1024, batches 1, 8 and 64) captured with PDL
on for every kernel, off for every kernel, and on for all but one kernel of a decode step
(``programmatic_launch(without=(name,))``); calls timed interleaved, each variant's ms
against all-on, and its logits against all-on's (PDL changes no bits). JSON in
$OUT/pdl-kernels.json."""

import json
import os
import sys

import torch
from probe_common import decode_cases, prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT, BATCHES = 1024, (1, 8, 64)
STEP_KERNELS = ("cache_places", "decode_attention", "gemv", "qkv_norm_rope", "rms_norm",
                "skinny_linear")
VARIANTS = {"on": (True, ()), "off": (False, ()),
            **{f"without {k}": (True, (k,)) for k in STEP_KERNELS}}


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners = {}
    for name, (enabled, without) in VARIANTS.items():
        with programmatic_launch(enabled, without=without):
            runners[name] = graphcap.capture(model, "full", buckets=list(BATCHES),
                                             inputs=DecodeInputs(cache))
    cases = decode_cases(runners, tokens, BATCHES, CONTEXT)
    times = time_interleaved(cases, reps=60, rounds=6)
    rows = []
    for b in BATCHES:
        want = cases[b, "on"]().float()
        base = times[b, "on"]["median_ms"]
        for name in VARIANTS:
            ms = times[b, name]["median_ms"]
            rows.append({"batch": b, "variant": name, "ms": ms,
                         "vs_on": round(ms / base, 4),
                         "max_logit_diff_vs_on": float((cases[b, name]().float() - want)
                                                       .abs().max())})
            print(f"{preset} b={b} {name:>26}: {ms:.4f} ms ({rows[-1]['vs_on']:.3f}x on), "
                  f"diff {rows[-1]['max_logit_diff_vs_on']:.3g}", flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    out = {"what": "decode step: PDL on, off, and on for all kernels but one",
           **environment(), "context": CONTEXT,
           "models": [one(p) for p in sys.argv[1:] or ["qwen3-0.6b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "pdl-kernels.json"), "w") as f:
        json.dump(out, f, indent=1)
