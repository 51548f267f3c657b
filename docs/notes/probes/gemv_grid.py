"""Whether the GEMV linears of a decode step read faster from a grid smaller than their
column blocks (device side):

    PYTHONPATH=. python3 docs/notes/probes/gemv_grid.py [preset]

A full runner of ``DecodeInputs`` (batch 1, context 1024) captured per GEMV grid:
today's (a program per block of columns: the next kernel's programs find no free SM until
the last wave), and ``PER_SM`` programs an SM, each taking every grid-th block, so the
next kernel's programs are resident at once under PDL and read their first weight slice
(and, with ``AHEAD``, ask L2 for their later blocks') while this one streams. Calls timed
interleaved, alone and fed back to back; kernels and busy time from the profiler; logits
against today's. JSON in $OUT/gemv-grid.json."""

import json
import os
import sys

from probe_common import prefilled_decode

import graphcap
from graphcap.bench.common import back_to_back_ms, environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import gemv

CONTEXT = 1024
TODAY = gemv.gemv_config
GRIDS = [(0, 0), (2, 0), (4, 0), (8, 0), (2, 2), (4, 2), (4, 4), (8, 2)]  # (PER_SM, AHEAD)


def main(preset: str) -> None:
    model, cache, tokens = prefilled_decode(preset, 1, CONTEXT)
    runners = {}
    for per_sm, ahead in GRIDS:
        gemv.gemv_config = (lambda k, p=per_sm, a=ahead: {**TODAY(k), "PER_SM": p,
                                                          "AHEAD": a})
        try:
            runners[per_sm, ahead] = graphcap.capture(model, "full", buckets=[1],
                                                      inputs=DecodeInputs(cache))
        finally:
            gemv.gemv_config = TODAY
    cases = {key: (lambda r=r: r(tokens[:1], positions=[CONTEXT], slots=[0]))
             for key, r in runners.items()}
    times = time_interleaved(cases, reps=100, rounds=5)
    want = cases[0, 0]().float()
    rows = []
    for key, fn in cases.items():
        prof = profile_steps(fn)
        top = prof["top_kernels"]
        gemv_us = sum(t["us"] for t in top if t["kernel"].startswith("_gemv"))
        rows.append({"per_sm": key[0], "ahead": key[1], "ms": times[key]["median_ms"],
                     "ms_back_to_back": round(back_to_back_ms(fn), 4),
                     "busy_us": round(top[0]["us"] / top[0]["share"], 1),
                     "gemv_us": gemv_us, "kernels": prof["kernels"],
                     "idle_share": prof["idle_share"],
                     "max_logit_diff": float((fn().float() - want).abs().max()),
                     "top_kernels": top})
        r = rows[-1]
        print(f"PER_SM {key[0]} AHEAD {key[1]}: {r['ms']:.4f} ms a call, "
              f"{r['ms_back_to_back']:.4f} back to back, busy {r['busy_us']} us, GEMV "
              f"{gemv_us:.1f} us, diff {r['max_logit_diff']:.3g}", flush=True)
    out = {"what": "decode step at batch 1 by GEMV grid (PER_SM, AHEAD), full runner",
           **environment(), "preset": preset, "context": CONTEXT, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv-grid.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b")
