"""The few-row linear with the RMSNorm's scale applied to its sums (``NORM_LATE``: no
pass over x before the products), against today's prologue and the unfused ops:

    PYTHONPATH=. python3 docs/notes/probes/skinny_norm_late.py [preset...]

Past one row q/k/v runs as an RMSNorm launch and cuBLAS (the fused prologue measured
slower: qwen3-0.6b at 16 rows 7.9 us against 7.3), gate/up as the few-row kernel with
the prologue up to 16 rows (16 MB weights). The prologue is a pass over x after the PDL
wait, before any product. Part 1, single launches (graphs of ``LAUNCHES`` launches over
weight copies cycled past L2, PDL on) at 2-16 rows: ``composite`` (today's q/k/v: the
norm kernel, cuBLAS; for gate/up the norm, cuBLAS and SiLU-and-mul), ``skinny`` (the
kernel with today's prologue), ``late`` (the kernel with ``NORM_LATE``). Part 2, the
qwen3-0.6b decode step at batches 2, 4, 8 (context 1024, ``full``), calls interleaved:
today; gate/up with ``NORM_LATE``; that and q/k/v on the kernel with ``NORM_LATE`` up to 16
rows (one launch a layer fewer). Part 1 covers the presets named (both by default).
JSON in $OUT/skinny-norm-late.json."""

import contextlib
import json
import os
import sys

import torch
from linear_floor import per_launch_us
from probe_common import decode_cases, prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.inputs import DecodeInputs
from graphcap.opsdb import linear as linear_ops
from graphcap.opsdb.triton import linear
from graphcap.opsdb.triton.common import num_sms, programmatic_launch

CONTEXT = 1024
POOL_BYTES = 512 << 20
PROJECTIONS = {  # name: (weight rows, K, swiglu)
    "qwen3-0.6b qkv": (4096, 1024, False), "qwen3-0.6b gate_up": (6144, 1024, True),
    "llama3-8b qkv": (6144, 4096, False), "llama3-8b gate_up": (28672, 4096, True),
}
ROWS = (2, 4, 8, 16)
BATCHES = (2, 4, 8)


def late_config(m, n, k, **kw):
    return {**TODAY_CONFIG(m, n, k, **kw), "NORM_LATE": kw.get("norm", False)}


TODAY_CONFIG, TODAY_ROWS = linear.config, linear.fused_rows


def projection(name: str, rows: int, gen) -> dict:
    n, k, swiglu = PROJECTIONS[name]
    nbytes = n * k * 2
    copies = max(4, min(32, POOL_BYTES // nbytes))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               / k ** 0.5 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=gen)
    unfused = (linear_ops._rms_norm_swiglu_composite if swiglu
               else linear_ops._rms_norm_linear_composite)
    want = unfused(x, g, 1e-5, weights[0]).float()
    sms = num_sms(x.device)
    cfg = TODAY_CONFIG(rows, n // 2 if swiglu else n, k, norm=True, swiglu=swiglu, sms=sms)
    arms = {"composite": lambda i: unfused(x, g, 1e-5, weights[i]),
            "skinny": lambda i: linear.skinny_linear(x, weights[i], norm_weight=g, eps=1e-5,
                                                     swiglu=swiglu, tiles=cfg),
            "late": lambda i: linear.skinny_linear(x, weights[i], norm_weight=g, eps=1e-5,
                                                   swiglu=swiglu,
                                                   tiles={**cfg, "NORM_LATE": True})}
    row = {"rows": rows, "bytes": nbytes, "tiles": cfg}
    with programmatic_launch(True):
        for arm, fn in arms.items():
            diff = float((fn(0).float() - want).abs().max())
            assert diff < 0.1, f"{name} {rows} {arm}: off by {diff}"
            row[arm] = round(per_launch_us(fn, copies), 2)
    print(name, row, flush=True)
    return row


@contextlib.contextmanager
def policy(name: str):
    """``late``: the kernel's normed launches with NORM_LATE; ``late-qkv``: that, and
    q/k/v on the kernel (not the norm and cuBLAS) up to 16 rows of weights to 16 MB."""
    def rows_of(weight, kind):
        if kind == "plain" and weight.numel() * weight.element_size() <= 16 << 20:
            return max(TODAY_ROWS(weight, kind), 16)
        return TODAY_ROWS(weight, kind)

    if name != "today":
        linear.config = late_config
    if name == "late-qkv":
        linear.fused_rows = rows_of
    try:
        yield
    finally:
        linear.config, linear.fused_rows = TODAY_CONFIG, TODAY_ROWS


def step() -> dict:
    model, cache, tokens = prefilled_decode("qwen3-0.6b", max(BATCHES), CONTEXT)
    runners = {}
    for name in ("today", "late", "late-qkv"):
        with policy(name):
            runners[name] = graphcap.capture(model, "full", buckets=list(BATCHES),
                                             inputs=DecodeInputs(cache))
    cases = decode_cases(runners, tokens, BATCHES, CONTEXT)
    times = time_interleaved(cases, reps=50, rounds=5)
    rows = []
    for (batch, name), call in cases.items():
        want = cases[batch, "today"]().float()
        prof = profile_steps(call)
        rows.append({"batch": batch, "policy": name, "ms": times[batch, name]["median_ms"],
                     "max_logit_diff_vs_today": float((call().float() - want).abs().max()),
                     "kernels": prof.get("kernels"), "idle_share": prof.get("idle_share"),
                     "top_kernels": prof.get("top_kernels", [])[:6]})
        print({k: v for k, v in rows[-1].items() if k != "top_kernels"}, flush=True)
    return {"preset": "qwen3-0.6b", "rows": rows}


if __name__ == "__main__":
    gen = torch.Generator(device="cuda").manual_seed(0)
    out = {"what": "the few-row linear with the norm's scale on its sums (NORM_LATE) "
                   "against today's prologue and the unfused ops; the qwen3-0.6b step with it",
           **environment(), "context": CONTEXT,
           "launches": {name: [projection(name, m, gen) for m in ROWS] for name in PROJECTIONS
                        if not sys.argv[1:] or name.split()[0] in sys.argv[1:]},
           "step": step()}
    with open(os.path.join(os.environ.get("OUT", "."), "skinny-norm-late.json"), "w") as f:
        json.dump(out, f, indent=1)
