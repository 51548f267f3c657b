"""The one-row GEMV form as a decode step runs it, per projection, by tile and by how
its weight loads use L1; then the batch-1 step with the form on every projection:

    PYTHONPATH=. python3 docs/notes/probes/gemv_forms.py [preset...]

``linear_floor.py`` timed a plain GEMV (no RMSNorm, no SwiGLU halves, no residual) at
3.3-3.7 TB/s on llama3-8b's weights, and predicted 106 us a layer; in the step the form
took about 125 (history item 55). In the step q/k/v and gate/up fold the RMSNorm in: each
program of two output columns reads x twice (the row's sum of squares, then the
products) and the norm's weight once, 24 KB of L1/L2 reads beside 16-32 KB of weight at
K = 4096. Whether those re-reads, or the weight stream evicting x from L1, cost the
difference is what part 1 measures.

Part 1, single launches: each projection of each preset as ``gemv_linear`` runs it in a
step (q/k/v normed, gate/up normed with SwiGLU, o and down with the residual), captured
as a CUDA graph of ``LAUNCHES`` launches, each over its own weight copy (more bytes than
L2 holds), PDL on. Arms: the form with each of ``VARIANTS`` (tiles; ``W_CACHE=".cg"``:
weights loaded past L1, so x and the norm weight stay there; ``NORM_LATE``: no pass over
x before the products, the norm's scale applied to the sums); the form without its
prologue and epilogue (``bare``: what linear_floor timed); the unfused ops around cuBLAS
(``composite``, today's dispatch for llama3-8b's weights).

Part 2, the step: the preset's batch-1 decode step (context 1024, ``full``, today's
dispatch) with today's tiles, the tiles before 2026-12-05 (``before``) and each
projection's best variant of part 1 (``best``); PDL on and off, calls interleaved;
with PDL off each projection's kernel time inside the step from the profiler (the form's
launches in order: q/k/v, o, gate/up, down a layer). JSON in $OUT/gemv-forms.json."""

import contextlib
import json
import os
import sys

import torch
import triton
from linear_floor import per_launch_us
from probe_common import prefilled_decode, timed_batch1

import graphcap
from graphcap.bench.common import environment
from graphcap.bench.prefill import kernel_spans
from graphcap.inputs import DecodeInputs
from graphcap.opsdb import linear as linear_ops
from graphcap.opsdb.triton import gemv
from graphcap.opsdb.triton.common import programmatic_launch

CONTEXT = 1024
POOL_BYTES = 512 << 20
PROJECTIONS = {  # preset: {name: (N, K, kind)}; kind as the step calls the form
    "llama3-8b": {"qkv": (6144, 4096, "norm"), "o": (4096, 4096, "residual"),
                  "gate_up": (28672, 4096, "swiglu"), "down": (4096, 14336, "residual")},
    "qwen3-0.6b": {"qkv": (4096, 1024, "norm"), "o": (1024, 2048, "residual"),
                   "gate_up": (6144, 1024, "swiglu"), "down": (1024, 3072, "residual")},
}
ORDER = ("qkv", "o", "gate_up", "down")


def variant(block_n=2, slice_elements=4096, warps=4, w_cache="", late=False):
    def config(k: int, norm: bool = False) -> dict:
        block_k = max(16, min(triton.next_power_of_2(k), slice_elements // block_n))
        return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps,
                "W_CACHE": w_cache, "NORM_LATE": late}
    return config


VARIANTS = {  # the first run (at 76d3d00) also had .cg ones, 8 warps, n8 without late
    "before": variant(),  # the tiles of every projection until 2026-12-05
    "today": gemv.gemv_config,
    "late": variant(late=True),
    "n4": variant(block_n=4),
    "n4-late": variant(block_n=4, late=True),
    "n4-late-cg": variant(block_n=4, late=True, w_cache=".cg"),
    "n8-late": variant(block_n=8, late=True),
    # All of K = 4096 in one load (qwen3's win at K = 1024 was four columns over all of K):
    # 94-119 registers at two columns, 103 (norm) and 202 (SwiGLU) at four with 8 warps,
    # no spills (ptxas for sm_90).
    "wide-late": variant(slice_elements=8192, late=True),
    "n4-wide-late-w8": variant(block_n=4, slice_elements=16384, warps=8, late=True),
}


def kwargs_of(kind: str, g, res) -> dict:
    if kind == "norm":
        return {"norm_weight": g, "eps": 1e-5}
    if kind == "swiglu":
        return {"norm_weight": g, "eps": 1e-5, "swiglu": True}
    return {"residual": res}


def composite(kind: str, x, g, w, res):
    if kind == "norm":
        return linear_ops._rms_norm_linear_composite(x, g, 1e-5, w)
    if kind == "swiglu":
        return linear_ops._rms_norm_swiglu_composite(x, g, 1e-5, w)
    return linear_ops._linear_residual_composite(x, w, res)


def projection_row(label: str, n: int, k: int, kind: str, gen) -> dict:
    nbytes = n * k * 2
    copies = max(4, min(32, POOL_BYTES // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               / k ** 0.5 for _ in range(copies)]
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(1, n // (2 if kind == "swiglu" else 1), device="cuda",
                      dtype=torch.bfloat16, generator=gen)
    kw = kwargs_of(kind, g, res)
    want = composite(kind, x, g, weights[0], res).float()
    row = {"bytes": nbytes, "copies": copies, "kind": kind}

    def put(arm, fn, check=True):
        if check:
            diff = float((fn(0).float() - want).abs().max())
            assert diff < 0.1, f"{label} {arm}: off by {diff}"
        us = per_launch_us(fn, copies)
        row[arm] = {"us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 2)}

    with programmatic_launch(True):
        for arm, config in VARIANTS.items():
            put(arm, lambda i, c=config: gemv.gemv_linear(
                x, weights[i], tiles=c(k, norm=kind != "residual"), **kw))
        put("bare", lambda i: gemv.gemv_linear(x, weights[i]), check=False)
        put("composite", lambda i: composite(kind, x, g, weights[i], res))
    row["best"] = min(VARIANTS, key=lambda a: row[a]["us"])
    print(label, {a: row[a]["us"] for a in (*VARIANTS, "bare", "composite")},
          "best", row["best"], flush=True)
    return row


def launches(preset: str) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {name: projection_row(f"{preset} {name}", *shape, gen)
           for name, shape in PROJECTIONS[preset].items()}
    torch.cuda.empty_cache()
    return out


@contextlib.contextmanager
def dispatch(max_bytes: int, tiles_of=None):
    """The form on every weight up to ``max_bytes``, its tiles ``tiles_of(weight rows, k,
    kind)`` (today's where None)."""
    saved_bytes, saved_linear = gemv.DISPATCH_BYTES, gemv.gemv_linear

    def linear(x, weight, **kw):
        if tiles_of is None or kw.get("tiles"):
            return saved_linear(x, weight, **kw)
        kind = ("swiglu" if kw.get("swiglu") else "norm" if kw.get("norm_weight") is not None
                else "residual")
        return saved_linear(x, weight, tiles=tiles_of(*weight.shape, kind), **kw)

    gemv.DISPATCH_BYTES, gemv.gemv_linear = max_bytes, linear
    try:
        yield
    finally:
        gemv.DISPATCH_BYTES, gemv.gemv_linear = saved_bytes, saved_linear


def projection_us(call, projections: int) -> dict:
    """Mean kernel time of each projection's GEMV launch inside the step (PDL off)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    spans = sorted(s for s in kernel_spans(prof.events()) if "_gemv_kernel" in s[2])
    per_call = len(spans) // 5
    if per_call < projections:  # some projections not in the form
        return {}
    got = {name: [] for name in ORDER}
    for i, (start, end, _) in enumerate(spans):
        if i % per_call < projections:
            got[ORDER[i % per_call % 4]].append(end - start)
    return {name: round(sum(v) / len(v), 2) for name, v in got.items() if v}


def step(preset: str, best: dict) -> dict:
    model, cache, tokens = prefilled_decode(preset, 1, CONTEXT)
    table = {(n, k, kind): VARIANTS[row["best"]]
             for (n, k, kind), row in ((PROJECTIONS[preset][p], best[p]) for p in ORDER)}

    def tiles_best(n, k, kind):
        return table.get((n, k, kind), gemv.gemv_config)(k, norm=kind != "residual")

    def tiles_before(n, k, kind):
        return VARIANTS["before"](k)

    policies = {"today": (gemv.DISPATCH_BYTES, None),
                "before": (gemv.DISPATCH_BYTES, tiles_before),
                "best": (gemv.DISPATCH_BYTES, tiles_best)}
    runners = {}
    for name, (max_bytes, tiles_of) in policies.items():
        for pdl in (True, False):
            with dispatch(max_bytes, tiles_of), programmatic_launch(pdl):
                runners[name, pdl] = graphcap.capture(model, "full", buckets=[1],
                                                      inputs=DecodeInputs(cache))
    cases, times = timed_batch1(runners, tokens, CONTEXT)
    want = cases["today", True]().float()
    rows = []
    layers = model.args.layers
    for (name, pdl), call in cases.items():
        row = {"policy": name, "pdl": pdl, "ms": times[name, pdl]["median_ms"],
               "max_logit_diff_vs_today": float((call().float() - want).abs().max())}
        if not pdl:
            row["projection_us"] = projection_us(call, 4 * layers)
        rows.append(row)
        print(preset, row, flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    presets = sys.argv[1:] or list(PROJECTIONS)
    out = {"what": "the one-row GEMV form as a step runs it: per projection by tile and "
                   "weight cache policy, then the batch-1 step with it on every projection",
           **environment(), "context": CONTEXT, "variants": {
               name: {f"{k}{' norm' * norm}": c(k, norm=norm) for k in (1024, 4096, 14336)
                      for norm in (False, True)} for name, c in VARIANTS.items()},
           "launches": {}, "steps": []}
    for preset in presets:
        out["launches"][preset] = launches(preset)
    for preset in presets:
        out["steps"].append(step(preset, out["launches"][preset]))
    with open(os.path.join(os.environ.get("OUT", "."), "gemv-forms.json"), "w") as f:
        json.dump(out, f, indent=1)
