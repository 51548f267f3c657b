"""The one-row GEMV form with its next weight slice asked for before the products of the
one it holds (``AHEAD``), per projection and in the batch-1 step (device side):

    PYTHONPATH=. python3 docs/notes/probes/gemv_ahead.py [preset...]

In the step at ``c23d5c4`` llama3-8b's o in GEMV form (K 4096: two slices a program) ran
at the launch line (9.28 us a launch against 9.4), while down (K 14336: seven slices)
took 32.4 us in the form and 30.9 on the few-row kernel against a line of 27.7, and a
bare read of the form's shape 32.5 (``gemv_forms.py``). A program of the form loads a
slice, multiplies it and only then asks for the next: between slices it has nothing in
flight. Prediction: with ``AHEAD`` (two slices in flight a program) down reaches 28-29
us alone and the form beats the few-row kernel on it; at one or two slices (qwen3-0.6b,
llama3-8b's o) nothing changes.

Part 1, single launches as ``gemv_forms.py`` times them (a CUDA graph of 32 launches over
weight copies past L2, PDL on): each projection of each preset in the form with today's
tiles, ``AHEAD``, and ``AHEAD`` with slices of 1024 or four columns a program, beside the
launch line fitted on this device (``graphcap.bench.launch_line``) for its bytes.

Part 2, the batch-1 step (context 1024, ``full``, calls interleaved, PDL on): today's;
``AHEAD`` on every launch of the form; for llama3-8b also down in the form, with and
without ``AHEAD``. JSON in $OUT/gemv-ahead.json."""

import json
import os
import sys

import gemv_forms
import torch
from probe_common import prefilled_decode, timed_batch1

import graphcap
from graphcap.bench.common import environment
from graphcap.bench.decode import profile_steps
from graphcap.bench.launch_line import measure
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import gemv

TODAY_CONFIG, TODAY_ROWS = gemv.gemv_config, gemv.gemv_rows


def ahead(block_k=None, block_n=None):
    def config(k: int, norm: bool = False) -> dict:
        c = {**TODAY_CONFIG(k, norm), "AHEAD": True}
        if block_n:
            c["BLOCK_N"] = block_n
        if block_k:
            c["BLOCK_K"] = min(c["BLOCK_K"], block_k)
        return c
    return config


VARIANTS = {"today": TODAY_CONFIG, "ahead": ahead(), "ahead-bk1024": ahead(block_k=1024),
            "ahead-n4": ahead(block_n=4)}


def launches(preset: str, line: dict) -> dict:
    gemv_forms.VARIANTS = VARIANTS  # projection_row times gemv_forms.VARIANTS
    rows = gemv_forms.launches(preset)
    for row in rows.values():
        row["line_us"] = round(line["fixed_us"] + row["bytes"] / line["bytes_per_s"] * 1e6, 2)
    return rows


def step(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, 1, gemv_forms.CONTEXT)
    a = model.args
    down = (a.hidden, a.intermediate)
    policies = {"today": (TODAY_CONFIG, TODAY_ROWS), "ahead": (ahead(), TODAY_ROWS)}
    if preset == "llama3-8b":
        def with_down(weight):
            return 1 if tuple(weight.shape) == down else TODAY_ROWS(weight)
        policies["down"] = (TODAY_CONFIG, with_down)
        policies["down-ahead"] = (ahead(), with_down)
    runners = {}
    for name, (config, rows) in policies.items():
        gemv.gemv_config, gemv.gemv_rows = config, rows
        try:
            runners[name] = graphcap.capture(model, "full", buckets=[1],
                                             inputs=DecodeInputs(cache))
        finally:
            gemv.gemv_config, gemv.gemv_rows = TODAY_CONFIG, TODAY_ROWS
    cases, times = timed_batch1(runners, tokens, gemv_forms.CONTEXT)
    want = cases["today"]().float()
    out = []
    for name, call in cases.items():
        prof = profile_steps(call)
        out.append({"policy": name, "ms": times[name]["median_ms"],
                    "max_logit_diff_vs_today": float((call().float() - want).abs().max()),
                    **prof})
        print(preset, name, out[-1]["ms"], prof.get("kernels"), flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": out}


if __name__ == "__main__":
    presets = sys.argv[1:] or list(gemv_forms.PROJECTIONS)
    line = measure()
    print("launch line", line, flush=True)
    out = {"what": "the GEMV form with two weight slices in flight a program (AHEAD)",
           **environment(), "launch_line": line,
           "variants": {k: v(4096) for k, v in VARIANTS.items()},
           "launches": {p: launches(p, line) for p in presets},
           "steps": [step(p) for p in presets]}
    with open(os.path.join(os.environ.get("OUT", "."), "gemv-ahead.json"), "w") as f:
        json.dump(out, f, indent=1)
