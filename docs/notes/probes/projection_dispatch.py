"""Which of llama3-8b's projections the one-row GEMV form should take in a batch-1
decode step, one projection at a time (device side):

    PYTHONPATH=. python3 docs/notes/probes/projection_dispatch.py [preset]

``gemv_dispatch.py`` moved every projection to the form at once (4.899 ms against 4.811
at ``c247be4``); alone, the normed q/k/v in the form took 17.6 us against 17.4 for the
norm and cuBLAS, and o 11.2 (``gemv_forms.py``). In a step a projection moved to the
form also drops a launch (the RMSNorm's, for q/k/v and gate/up) and reads its weight
before the PDL wait. Policies: today's (``gemv.gemv_rows``), then the form for q/k/v,
gate/up, o, down alone, q/k/v with o, and every projection. A full runner of
``DecodeInputs`` at batch 1 (context 1024) each, PDL on, calls interleaved; today's and
the q/k/v policy also with PDL off (kernel durations without waits); kernels and GPU idle
from the profiler, logits against today's. JSON in $OUT/projection-dispatch.json."""

import json
import os
import sys

import torch
from probe_common import prefilled_decode, timed_batch1

import graphcap
from graphcap.bench.common import environment
from graphcap.bench.decode import profile_steps, step_bytes
from graphcap.bench.decode_attention import PEAK_BYTES_PER_S
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import gemv
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT = 1024
TODAY = gemv.gemv_rows


def shapes(a) -> dict:
    """Each projection's weight shape in the preset's layers."""
    inter = a.intermediate
    return {"qkv": ((a.heads + 2 * a.kv_heads) * a.head_dim, a.hidden),
            "gate_up": (2 * inter, a.hidden), "o": (a.hidden, a.heads * a.head_dim),
            "down": (a.hidden, inter)}


def policy(taken: set):
    def rows(weight: torch.Tensor) -> int:
        return 1 if tuple(weight.shape) in taken else TODAY(weight)
    return rows


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, 1, CONTEXT)
    by = shapes(model.args)
    sets = {"today": set(), "qkv": {"qkv"}, "gate_up": {"gate_up"}, "o": {"o"},
            "down": {"down"}, "qkv+o": {"qkv", "o"}, "all": set(by)}
    runners = {}
    for name, parts in sets.items():
        for pdl in (True, False) if name in ("today", "qkv") else (True,):
            gemv.gemv_rows = policy({by[p] for p in parts})
            try:
                with programmatic_launch(pdl):
                    runners[name, pdl] = graphcap.capture(model, "full", buckets=[1],
                                                          inputs=DecodeInputs(cache))
            finally:
                gemv.gemv_rows = TODAY
    cases, times = timed_batch1(runners, tokens, CONTEXT)
    want = cases["today", True]().float()
    rows = []
    for (name, pdl), call in cases.items():
        prof = profile_steps(call)
        rows.append({"policy": name, "pdl": pdl, "ms": times[name, pdl]["median_ms"],
                     "floor_ms": round(step_bytes(model, 1, CONTEXT + 1)
                                       / PEAK_BYTES_PER_S * 1e3, 4),
                     "max_logit_diff_vs_today": float((call().float() - want).abs().max()),
                     **prof})
        print(f"{preset} {name:>8} pdl={pdl!s:>5}: {rows[-1]['ms']:.4f} ms, "
              f"{prof.get('kernels')} kernels, idle {prof.get('idle_share')}, diff "
              f"{rows[-1]['max_logit_diff_vs_today']:.3g}", flush=True)
        for k in prof.get("top_kernels", [])[:8]:
            print(f"      {k['kernel'][:60]:60} {k['launches']:5.0f} {k['us']:9.1f} us")
    return {"preset": preset, "shapes": {k: list(v) for k, v in by.items()}, "rows": rows}


if __name__ == "__main__":
    out = {"what": "batch-1 decode step: the GEMV form one projection at a time",
           **environment(), "context": CONTEXT,
           "models": [one(p) for p in sys.argv[1:] or ["llama3-8b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "projection-dispatch.json"),
              "w") as f:
        json.dump(out, f, indent=1)
