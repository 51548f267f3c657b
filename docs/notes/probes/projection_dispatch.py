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
from probe_common import policy_rows, prefilled_decode, timed_batch1

import graphcap
from graphcap.bench.common import environment
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
    rows = policy_rows(preset, model, cases, times, CONTEXT, top=8)
    return {"preset": preset, "shapes": {k: list(v) for k, v in by.items()}, "rows": rows}


if __name__ == "__main__":
    out = {"what": "batch-1 decode step: the GEMV form one projection at a time",
           **environment(), "context": CONTEXT,
           "models": [one(p) for p in sys.argv[1:] or ["llama3-8b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "projection-dispatch.json"),
              "w") as f:
        json.dump(out, f, indent=1)
