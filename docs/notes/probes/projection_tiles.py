"""llama3-8b's projections in the one-row GEMV form with the tiles that won alone, in
the batch-1 decode step (device side):

    PYTHONPATH=. python3 docs/notes/probes/projection_tiles.py

``gemv_ahead.py`` on an H100 (``docs/results/2026-12-06-gemv-ahead-cfdb0b6-h100.json``)
timed single launches over weights past L2: with ``AHEAD`` and slices of 1024
(``ahead-bk1024``) the normed q/k/v took 19.6 us against 21.9 with today's tiles and 23.1
for the norm and cuBLAS (``composite``, today's dispatch); gate/up with ``AHEAD`` 77.0
against 79.0 and 82.2; down 41.4 in the form against 44.7; o (today in the form) gained
nothing. Item 90 of the history found the form on gate/up 6% slower in the step than its
alone figures predicted, so only the step decides. Policies: today's dispatch; q/k/v in
the form (today's tiles, ``ahead-bk1024``, ``ahead-n4``); gate/up with ``AHEAD``; down
in the form; every winner of part 1 together, and without gate/up; every projection in
the form at today's tiles (item 90's "all four"). A full runner at batch
1, context 1024 each, PDL on (today's and the all-winners policy also off), calls
interleaved; kernels and idle from the profiler, logits against today's. JSON in
$OUT/projection-tiles.json."""

import json
import os

import torch
from probe_common import policy_rows, prefilled_decode, timed_batch1
from projection_dispatch import shapes

import graphcap
from graphcap.bench.common import environment
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import gemv
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT = 1024
TODAY_ROWS, TODAY_LINEAR, TODAY_CONFIG = gemv.gemv_rows, gemv.gemv_linear, gemv.gemv_config


def tiles(name: str, k: int, norm: bool) -> dict:
    c = TODAY_CONFIG(k, norm)
    if name == "ahead":
        return {**c, "AHEAD": True}
    if name == "ahead-bk1024":
        return {**c, "AHEAD": True, "BLOCK_K": min(c["BLOCK_K"], 1024)}
    if name == "ahead-n4":
        return {**c, "AHEAD": True, "BLOCK_N": 4}
    return c


POLICIES = {
    "today": {},
    "qkv": {"qkv": "today"},
    "qkv-ahead-bk1024": {"qkv": "ahead-bk1024"},
    "qkv-ahead-n4": {"qkv": "ahead-n4"},
    "gate_up-ahead": {"gate_up": "ahead"},
    "down": {"down": "today"},
    "winners": {"qkv": "ahead-bk1024", "gate_up": "ahead", "down": "today"},
    "winners-but-gate_up": {"qkv": "ahead-bk1024", "down": "today"},
    "all": {"qkv": "today", "gate_up": "today", "down": "today"},
}


def under(policy: dict, by: dict):
    """``gemv_rows`` and ``gemv_linear`` taking ``policy``'s projections into the form
    at its tiles (by weight shape); the rest as today."""
    named = {by[p]: t for p, t in policy.items()}

    def rows(weight):
        return 1 if tuple(weight.shape) in named else TODAY_ROWS(weight)

    def linear(x, weight, **kw):
        t = named.get(tuple(weight.shape))
        if t is not None and kw.get("tiles") is None:
            kw["tiles"] = tiles(t, weight.shape[1], kw.get("norm_weight") is not None)
        return TODAY_LINEAR(x, weight, **kw)
    return rows, linear


def main() -> dict:
    model, cache, tokens = prefilled_decode("llama3-8b", 1, CONTEXT)
    by = shapes(model.args)
    runners = {}
    for name, policy in POLICIES.items():
        for pdl in (True, False) if name in ("today", "winners", "all") else (True,):
            gemv.gemv_rows, gemv.gemv_linear = under(policy, by)
            try:
                with programmatic_launch(pdl):
                    runners[name, pdl] = graphcap.capture(model, "full", buckets=[1],
                                                          inputs=DecodeInputs(cache))
            finally:
                gemv.gemv_rows, gemv.gemv_linear = TODAY_ROWS, TODAY_LINEAR
    cases, times = timed_batch1(runners, tokens, CONTEXT)
    rows = policy_rows("llama3-8b", model, cases, times, CONTEXT, top=8)
    return {"preset": "llama3-8b", "policies": POLICIES, "rows": rows}


if __name__ == "__main__":
    out = {"what": "llama3-8b batch-1 decode step: projections in the GEMV form at the "
                   "tiles that won alone", **environment(), "context": CONTEXT,
           "models": [main()]}
    torch.cuda.synchronize()
    with open(os.path.join(os.environ.get("OUT", "."), "projection-tiles.json"), "w") as f:
        json.dump(out, f, indent=1)
