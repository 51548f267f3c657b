"""A decode step's q/k-norm and rotary inside the attention kernel, against the q/k/v
kernel before it (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_rope.py [preset...]

Two full runners of ``DecodeInputs`` (context 1024, batches 1, 8 and 64) on one model and
cache: ``one kernel`` as the library captures it (``graphcap::qkv_cached_attention`` runs
the decode attention kernel on the projection's rows), ``two kernels`` with the default
backend's ``rotates`` off while it captures (``graphcap::qkv_norm_rope``, then the
attention kernel). Calls timed interleaved; kernels a step and the GPU's idle share from
the profiler (PDL on, as shipped); logits of both. JSON in $OUT/decode-rope.json."""

import json
import os
import sys

import torch
from probe_common import decode_cases, prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.attention.paged import DEFAULT

CONTEXT, BATCHES = 1024, (1, 8, 64)


def capture(model, cache, rotates: bool):
    DEFAULT.rotates = rotates
    try:
        return graphcap.capture(model, "full", buckets=list(BATCHES),
                                inputs=DecodeInputs(cache))
    finally:
        DEFAULT.rotates = True


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners = {"one kernel": capture(model, cache, True),
               "two kernels": capture(model, cache, False)}
    cases = decode_cases(runners, tokens, BATCHES, CONTEXT)
    times = time_interleaved(cases, reps=60, rounds=6)
    rows = []
    for b in BATCHES:
        want = cases[b, "two kernels"]().float()
        base = times[b, "two kernels"]["median_ms"]
        for name in runners:
            ms = times[b, name]["median_ms"]
            profile = profile_steps(cases[b, name])
            rows.append({"batch": b, "variant": name, "ms": ms,
                         "vs_two_kernels": round(ms / base, 4),
                         "kernels": profile["kernels"],
                         "idle_share": profile.get("idle_share"),
                         "max_logit_diff": float((cases[b, name]().float() - want)
                                                 .abs().max())})
            print(f"{preset} b={b} {name:>12}: {ms:.4f} ms ({rows[-1]['vs_two_kernels']:.3f}x"
                  f"), {profile['kernels']} kernels, diff {rows[-1]['max_logit_diff']:.3g}",
                  flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    out = {"what": "decode step: rotary in the attention kernel against the q/k/v kernel",
           **environment(), "context": CONTEXT,
           "models": [one(p) for p in sys.argv[1:] or ["qwen3-0.6b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-rope.json"), "w") as f:
        json.dump(out, f, indent=1)
