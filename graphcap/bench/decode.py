"""``graphcap bench decode``: one decode step (a token per request over the paged cache at
a context of ``context`` tokens), per batch size and arm, bf16 on CUDA:

- ``eager``: graphcap's reference decoder, eager steps (``graphcap.engine.eager``);
- ``breakable``, ``full``, ``tc_piecewise``: the same steps replayed from a runner's graphs
  (``DecodeInputs``, logits out; sampling is left out of every arm);
- ``hf-static-compile`` (CUDA only): the stock transformers model of the preset's config
  with transformers' ``generate(cache_implementation="static")``, which compiles its
  forward itself (what a user runs for fast decode in transformers): its step time is
  the time of generating ``1 + steps`` tokens less that of one, over ``steps``.

Every graphcap arm steps the same requests at the same positions, so each call does the
same work (the step's K/V overwrite the same slots); the cache is filled to ``context``
tokens by one prefill first.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.bench.common import environment, time_interleaved
from graphcap.engine.eager import decode_step, prefill
from graphcap.inputs import DecodeInputs
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, build_model

ARMS = ("eager", *GRAPHED, "hf-static-compile")
BATCHES = (1, 8)
CONTEXT = 128
HF_STEPS = 32


def _hf_step_ms(preset: str, batch: int, context: int, device, dtype) -> dict:
    from graphcap.bench.hf import stock_model

    hf = stock_model(preset, device, dtype)
    ids = torch.randint(1, PRESETS[preset].vocab_size, (batch, context),
                        generator=torch.Generator().manual_seed(1)).to(device)

    def run(new: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                    min_new_tokens=new, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
        torch.cuda.synchronize()
        return (time.perf_counter() - start) * 1e3

    start = time.perf_counter()
    for new in (1 + HF_STEPS, 1, 1 + HF_STEPS):  # compiles on first use
        run(new)
    warm_s = time.perf_counter() - start
    long = statistics.median(run(1 + HF_STEPS) for _ in range(3))
    short = statistics.median(run(1) for _ in range(3))
    return {"ms": round((long - short) / HF_STEPS, 4), "compile_and_warmup_s": round(warm_s, 2)}


def bench_model(name: str, arms, batches, context: int, reps: int, device: str,
                window: int = 0) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(name, device=device, dtype=dtype)
    if window:  # every layer windowed: a step reads the last `window` tokens of each row
        model.args = model.local_args = dataclasses.replace(model.args, window=window)
        for block in model.blocks:
            block.attn.window = window
    a = model.args
    slots = max(batches)
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=slots,
                         max_len=context + 1, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    for slot in range(slots):
        cache.admit(slot, context + 1)
    prompt = torch.randint(1, a.vocab_size, (slots * context,), generator=gen).to(device)
    prefill(model, cache, prompt, [context] * slots, list(range(slots)))
    tokens = torch.randint(1, a.vocab_size, (slots,), generator=gen).to(device)
    runners, build, skipped = {}, {}, {}
    for arm in arms:
        if arm in GRAPHED:
            start = time.perf_counter()
            runners[arm] = graphcap.capture(model, arm, buckets=sorted(batches),
                                            inputs=DecodeInputs(cache))
            build[arm] = round(time.perf_counter() - start, 3)
    cases = {}
    for b in batches:
        rows, positions = list(range(b)), [context] * b
        pos = torch.full((b,), context, device=device)
        for arm in arms:
            if arm == "eager":
                cases[b, arm] = (lambda b=b, rows=rows, pos=pos:
                                 decode_step(model, cache, tokens[:b], pos, rows))
            elif arm in runners:
                cases[b, arm] = (lambda r=runners[arm], b=b, rows=rows, positions=positions:
                                 r(tokens[:b], positions=positions, slots=rows))
    times = time_interleaved(cases, reps=reps, rounds=5) if cases else {}
    out_rows = [{"batch": b, "ms": {arm: times[b, arm]["median_ms"] for arm in arms
                                    if (b, arm) in times}} for b in batches]
    if "hf-static-compile" in arms:
        if window:
            skipped["hf-static-compile"] = f"the stock model has no {window}-token window"
        elif device != "cuda":
            skipped["hf-static-compile"] = "compiles CUDA graphs: a CUDA device only"
        else:
            for row in out_rows:
                try:  # the peer failing loses no arm measured before it
                    hf = _hf_step_ms(name, row["batch"], context, device, dtype)
                except Exception as exc:  # noqa: BLE001  (recorded, named)
                    skipped["hf-static-compile"] = f"{type(exc).__name__}: {exc}"[:500]
                    break
                row["ms"]["hf-static-compile"] = hf["ms"]
                build.setdefault("hf-static-compile", {})[row["batch"]] = \
                    hf["compile_and_warmup_s"]
    for arm, runner in runners.items():
        build[arm] = {"build_s": build[arm],
                      "graph_pool_bytes": runner.report()["graph_pool_bytes"]}
    return {"model": name, "context": context, "window": window, "rows": out_rows,
            "skipped": skipped, "build": build}


def run(models=("qwen3-0.6b",), arms=ARMS, batches=BATCHES, context: int = CONTEXT,
        reps: int = 30, device: str | None = None, window: int = 0) -> dict:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return {"what": "graphcap bench decode: one decode step (a token per request, the "
                    f"cache filled to {context} tokens), CUDA-event wall time per call, "
                    "median of repetitions interleaved over batch sizes and arms",
            **environment(), "arms": list(arms), "batches": list(batches),
            "models": [bench_model(m, arms, batches, context, reps, device, window)
                       for m in models]}
