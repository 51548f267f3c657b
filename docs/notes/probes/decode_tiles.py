"""The few-row linear's tiles at decode batch sizes (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_tiles.py [preset...]
    PROBE_BATCHES=64 PYTHONPATH=. python3 docs/notes/probes/decode_tiles.py [preset...]

``linear.config`` was swept at 16 and 64 rows (prefill); a decode step runs it at 1 and 8
(and, for o and down, at 64). A full runner of ``DecodeInputs`` (context 1024, batches 1
and 8, or ``PROBE_BATCHES``) is captured per variant of ``config``'s answer, with PDL on,
and the calls are timed interleaved; kernels per
step and the step's top kernels come from the profiler (PDL on: a kernel's time includes
its wait). Variants:

- ``default``;
- ``n16`` / ``n64``: 16 / 64 columns a program;
- ``warps2`` / ``warps8``: two / eight warps a program;
- ``split-norm``: K split for the normed projections too (gate/up), as for the others;
- ``split-norm-n16``: both;
- ``stages2``: two pipeline stages;
- ``bk128`` / ``bk512``: BLOCK_K 128 / 512; ``bk128-warps8``: 128 with eight warps (72 KB of
  shared memory a program at 64 rows, where today's take 144 KB);
- ``qkv-fused``: the RMSNorm-prologue kernel for q/k/v (``fused_rows`` plain: 64), split;
- ``pdl-off``: today's tiles without PDL.

JSON in $OUT/decode-tiles.json."""

import json
import os
import sys

import torch
from probe_common import prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps, step_bytes
from graphcap.bench.decode_attention import PEAK_BYTES_PER_S
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton import linear
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT = 1024
# PROBE_BATCHES=64: the step where the few-row linear runs o and down at 64 rows (today's
# tiles hold 144 KB of shared memory a program there: one program an SM).
BATCHES = tuple(int(b) for b in os.environ.get("PROBE_BATCHES", "1,8").split(","))
CONFIG, FUSED = linear.config, linear.fused_rows


def split_too(c, m, n, k, norm, swiglu, sms, element_size):
    """The split count config gives an unnormed projection of this shape."""
    return CONFIG(m, n, k, norm=False, swiglu=swiglu, sms=sms,
                  element_size=element_size)["SPLIT_K"]


VARIANTS = {
    "default": lambda c, *a: c,
    "n16": lambda c, *a: {**c, "BLOCK_N": 16},
    "n64": lambda c, *a: {**c, "BLOCK_N": 64},
    "warps2": lambda c, *a: {**c, "num_warps": 2},
    "warps8": lambda c, *a: {**c, "num_warps": 8},
    "split-norm": lambda c, *a: {**c, "SPLIT_K": split_too(c, *a)},
    "split-norm-n16": lambda c, *a: {**c, "BLOCK_N": 16, "SPLIT_K": split_too(
        {**c, "BLOCK_N": 16}, *a)},
    "stages2": lambda c, *a: {**c, "num_stages": 2},
    "bk128": lambda c, *a: {**c, "BLOCK_K": 128},
    "bk128-warps8": lambda c, *a: {**c, "BLOCK_K": 128, "num_warps": 8},
    "bk512": lambda c, *a: {**c, "BLOCK_K": 512, "num_stages": 2},
    "qkv-fused": "policy",
    "pdl-off": "pdl",
}


def patched(change):
    def config(m, n, k, *, norm, swiglu, sms, element_size=2):
        c = CONFIG(m, n, k, norm=norm, swiglu=swiglu, sms=sms, element_size=element_size)
        return change(c, m, n, k, norm, swiglu, sms, element_size)
    return config


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners, failed = {}, {}
    for name, change in VARIANTS.items():
        try:
            if change == "policy":
                linear.fused_rows = lambda w, kind: 64 if kind == "plain" else FUSED(w, kind)
                linear.config = patched(VARIANTS["split-norm"])
            elif callable(change):
                linear.config = patched(change)
            with programmatic_launch(change != "pdl"):
                runners[name] = graphcap.capture(model, "full", buckets=list(BATCHES),
                                                 inputs=DecodeInputs(cache))
        except Exception as exc:  # noqa: BLE001  (a variant that does not build: recorded)
            failed[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            linear.config, linear.fused_rows = CONFIG, FUSED
    cases = {(b, name): (lambda r=r, b=b: r(tokens[:b], positions=[CONTEXT] * b,
                                            slots=list(range(b))))
             for b in BATCHES for name, r in runners.items()}
    times = time_interleaved(cases, reps=60, rounds=5)
    rows = []
    for b in BATCHES:
        want = cases[b, "default"]().float()
        for name in runners:
            got = cases[b, name]().float()
            prof = profile_steps(cases[b, name])
            rows.append({"batch": b, "variant": name, "ms": times[b, name]["median_ms"],
                         "floor_ms": round(step_bytes(model, b, CONTEXT + 1)
                                           / PEAK_BYTES_PER_S * 1e3, 4),
                         "max_logit_diff_vs_default": float((got - want).abs().max()),
                         "kernels": prof.get("kernels"), "idle_share": prof.get("idle_share"),
                         "top_kernels": prof.get("top_kernels")})
            print(f"{preset} b={b} {name:>15}: {rows[-1]['ms']:.4f} ms, {rows[-1]['kernels']} "
                  f"kernels, diff {rows[-1]['max_logit_diff_vs_default']:.3g}", flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows, "failed": failed}


if __name__ == "__main__":
    presets = sys.argv[1:] or ["qwen3-0.6b"]
    out = {"what": "decode step: few-row linear tiles at batch 1 and 8, full runner, PDL on",
           **environment(), "context": CONTEXT, "models": [one(p) for p in presets]}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-tiles.json"), "w") as f:
        json.dump(out, f, indent=1)
