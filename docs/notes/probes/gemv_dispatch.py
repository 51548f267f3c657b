"""Which weights the one-row GEMV form should take in a decode step, and its tiles there:

    PYTHONPATH=. python3 docs/notes/probes/gemv_dispatch.py [preset...]

A full runner of ``DecodeInputs`` at batch 1 (context 1024) captured under each policy:
today's (``graphcap.opsdb.triton.gemv.DISPATCH_BYTES``, 16 MB: llama3-8b's projections on
cuBLAS and the few-row kernel), the GEMV form for every weight up to 256 MiB (every
projection, not the LM heads), and that with other tiles (warps, slice length). PDL on,
and off for today's and the 256 MiB policy (kernel durations without waits). Calls timed
interleaved, kernels and GPU idle from the profiler, logits against today's. JSON in
$OUT/gemv-dispatch.json."""

import contextlib
import json
import os
import sys

import torch
import triton
from probe_common import policy_rows, prefilled_decode, timed_batch1

import graphcap
from graphcap.bench.common import environment
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import gemv
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT = 1024
TODAY_BYTES, TODAY_CONFIG = gemv.DISPATCH_BYTES, gemv.gemv_config


def tiles(warps: int, slice_elements: int):
    def config(k: int, norm: bool = False) -> dict:
        block_k = max(16, min(triton.next_power_of_2(k), slice_elements // 2))
        return {"BLOCK_N": 2, "BLOCK_K": block_k, "num_warps": warps}
    return config


POLICIES = {  # name: (dispatch bytes, config)
    "today": (TODAY_BYTES, TODAY_CONFIG),
    "gemv-256M": (256 << 20, TODAY_CONFIG),
    "gemv-256M-w8": (256 << 20, tiles(8, 4096)),
    "gemv-256M-w8-s8192": (256 << 20, tiles(8, 8192)),
    "gemv-256M-w4-s2048": (256 << 20, tiles(4, 2048)),
}
PDL_OFF = ("today", "gemv-256M")


@contextlib.contextmanager
def policy(name: str):
    gemv.DISPATCH_BYTES, gemv.gemv_config = POLICIES[name]
    try:
        yield
    finally:
        gemv.DISPATCH_BYTES, gemv.gemv_config = TODAY_BYTES, TODAY_CONFIG


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, 1, CONTEXT)
    runners = {}
    for name in POLICIES:
        for pdl in (True, False) if name in PDL_OFF else (True,):
            with policy(name), programmatic_launch(pdl):
                runners[name, pdl] = graphcap.capture(model, "full", buckets=[1],
                                                      inputs=DecodeInputs(cache))
    cases, times = timed_batch1(runners, tokens, CONTEXT)
    rows = policy_rows(preset, model, cases, times, CONTEXT, top=5)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    out = {"what": "decode step at batch 1: which weights the GEMV form takes, its tiles",
           **environment(), "context": CONTEXT,
           "policies": {k: {"dispatch_bytes": v[0], "config_k4096": v[1](4096),
                            "config_k14336": v[1](14336)} for k, v in POLICIES.items()},
           "models": [one(p) for p in sys.argv[1:] or ["llama3-8b"]]}
    with open(os.path.join(os.environ.get("OUT", "."), "gemv-dispatch.json"), "w") as f:
        json.dump(out, f, indent=1)
