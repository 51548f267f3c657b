"""Decode attention with each block's pages read with the block before (``PAGES_FIRST``)
in the batch-1 and batch-8 decode steps of both presets (device side):

    PYTHONPATH=. python3 docs/notes/probes/pages_first.py

At batch 1 the kernel takes 7.3-7.7 us alone for a 4 MB read at context 1024 whatever its
tiles and splits (the launch line: 3.35 us), set by its chain of dependent reads
(``docs/notes/2026-12-04-decode-launch-floor.md``): the row's length, then the block
table's pages for its first block (the loop's bounds wait for the length), then keys and
values, then the split merge. ``PAGES_FIRST`` reads the first block's pages beside the
length (a row's split starts at a host-known offset where no window binds), and each later
block's with the one before. Prediction: one dependent read (0.5-1 us) off each launch at
batch 1 and 8, nothing at 64. Full runners at context 1024, PDL on, default tiles against
the same with ``PAGES_FIRST``, calls interleaved; logits against the default's. JSON in
$OUT/pages-first.json."""

import json
import os

import torch
from probe_common import prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import decode

CONTEXT = 1024
TILES_FOR = decode.tiles_for


def with_pages_first(*args, **kwargs):
    cfg, splits = TILES_FOR(*args, **kwargs)
    return {**cfg, "PAGES_FIRST": True}, splits


def one(preset: str, batches=(1, 8)) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(batches), CONTEXT)
    runners = {}
    for name in ("default", "pages-first"):
        decode.tiles_for = with_pages_first if name == "pages-first" else TILES_FOR
        try:
            runners[name] = graphcap.capture(model, "full", buckets=list(batches),
                                             inputs=DecodeInputs(cache))
        finally:
            decode.tiles_for = TILES_FOR
    rows = []
    for b in batches:
        cases = {name: (lambda r=r, b=b: r(tokens[:b], positions=[CONTEXT] * b,
                                           slots=list(range(b))))
                 for name, r in runners.items()}
        times = time_interleaved(cases, reps=50, rounds=5)
        want = cases["default"]().float()
        diff = float((cases["pages-first"]().float() - want).abs().max())
        rows.append({"batch": b, "ms": {k: v["median_ms"] for k, v in times.items()},
                     "max_logit_diff": diff})
        print(preset, rows[-1], flush=True)
    del runners, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    out = {"what": "decode steps with PAGES_FIRST decode attention", **environment(),
           "context": CONTEXT, "models": [one(p) for p in ("qwen3-0.6b", "llama3-8b")]}
    with open(os.path.join(os.environ.get("OUT", "."), "pages-first.json"), "w") as f:
        json.dump(out, f, indent=1)
