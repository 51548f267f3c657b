"""Whether decode attention's K/V prefetch before the PDL wait pays (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_prefetch.py [preset...]

A full runner of ``DecodeInputs`` (context 1024, batches 1 and 8) captured twice: as
committed (each program asks L2 for its split's K/V lines before the wait, where the
rows' whole read fits in ``PREFETCH_BYTES``) and with the prefetch off
(``PREFETCH_BYTES`` 0 in the kernel's module while capturing). Calls timed interleaved;
each variant's ms against the committed one's, and its logits against them (a prefetch
changes no bits). JSON in $OUT/decode-prefetch.json."""

import json
import os
import sys

import torch
from probe_common import decode_cases, prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import decode as decode_kernel

CONTEXT, BATCHES = 1024, (1, 8)


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners, budget = {}, decode_kernel.PREFETCH_BYTES
    for name, nbytes in (("prefetch", budget), ("no prefetch", 0)):
        decode_kernel.PREFETCH_BYTES = nbytes
        try:
            runners[name] = graphcap.capture(model, "full", buckets=list(BATCHES),
                                             inputs=DecodeInputs(cache))
        finally:
            decode_kernel.PREFETCH_BYTES = budget
    cases = decode_cases(runners, tokens, BATCHES, CONTEXT)
    times = time_interleaved(cases, reps=60, rounds=6)
    rows = []
    for b in BATCHES:
        want = cases[b, "prefetch"]().float()
        base = times[b, "prefetch"]["median_ms"]
        for name in runners:
            ms = times[b, name]["median_ms"]
            rows.append({"batch": b, "variant": name, "ms": ms,
                         "vs_prefetch": round(ms / base, 4),
                         "max_logit_diff": float((cases[b, name]().float() - want)
                                                 .abs().max())})
            print(f"{preset} b={b} {name:>12}: {ms:.4f} ms ({rows[-1]['vs_prefetch']:.3f}x), "
                  f"diff {rows[-1]['max_logit_diff']:.3g}", flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    out = {"what": "decode step: decode attention's K/V prefetch before the PDL wait, on "
                   "and off", **environment(), "context": CONTEXT,
           "models": [one(p) for p in sys.argv[1:] or ["qwen3-0.6b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-prefetch.json"), "w") as f:
        json.dump(out, f, indent=1)
