"""Decode attention alone: graphcap's Triton split-K/V kernel against FlashInfer's paged
decode, one query token per row over a paged cache of ``context`` tokens a row, bf16.

Each figure is kernel time (calls captured in one CUDA graph, replayed) over as many
cache layers as it takes to exceed the L2 cache, so every call reads its K/V from memory
as a model's layers do. ``bytes`` is the K/V a call reads (every row's ``context``
tokens, keys and values); ``share`` of :func:`peak_bytes_per_s` (the H200's
:data:`PEAK_BYTES_PER_S` there, another GPU's own copy rate). Targets (the decode
issue): Triton at least 80% of bandwidth at batch 64, and within 1.1x of FlashInfer's
time everywhere.
"""

from __future__ import annotations

import functools
import math
import re

import torch

from graphcap.bench.timing import cycled_ms
from graphcap.kv import PagedKVCache

PEAK_BYTES_PER_S = 4.3e12  # the H200's device-to-device copy rate, not its 4.8 TB/s spec
COPY_BYTES = 1 << 30


def is_h200(name: str) -> bool:
    """An H200 by its device name ("NVIDIA H200", "NVIDIA H200 NVL"), not a GH200, whose
    memory is another (its rate is measured as any other GPU's)."""
    return re.search(r"\bH200\b", name) is not None


@functools.cache
def peak_bytes_per_s(device=None) -> float:
    """The bandwidth shares and floors are taken of: :data:`PEAK_BYTES_PER_S` on an H200
    (and where there is no CUDA device: smoke runs), else the device's own rate of
    device-to-device copies (bytes read and written over the median time of a 1 GiB
    copy), so a kernel at another GPU's full bandwidth is not judged against the H200's."""
    if not torch.cuda.is_available():
        return PEAK_BYTES_PER_S
    device = torch.device("cuda" if device is None else device)
    if is_h200(torch.cuda.get_device_name(device)):
        return PEAK_BYTES_PER_S
    from graphcap.bench.timing import median_ms

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), warmup=3, reps=10)
    return 2 * COPY_BYTES / (ms * 1e-3)
HEADS = {"qwen3-0.6b": (16, 8, 128), "llama3-8b": (32, 8, 128)}
BATCHES = (1, 8, 64)
CONTEXTS = (256, 1024, 4096, 8192)
CYCLE_BYTES = 160 << 20


def _cache(batch: int, context: int, hk: int, d: int, dev, dtype=torch.bfloat16):
    per_layer = batch * context * hk * d * 2 * 2
    layers = max(1, min(256, -(-CYCLE_BYTES // per_layer)))  # 160 MB: past L2
    cache = PagedKVCache(layers, hk, d, max_requests=batch, max_len=context, dtype=dtype,
                         device=dev)
    for slot in range(batch):
        cache.admit(slot, context)
    cache.k.normal_()
    cache.v.normal_()
    return cache, per_layer


def _flashinfer(cache, batch: int, context: int, hq: int, scale: float):
    """FlashInfer's decode wrapper planned for the case, or why it cannot run here."""
    from graphcap.opsdb.attention.flashinfer_decode import FlashInferDecode, why_not

    if why := why_not(cache):
        return why
    backend = FlashInferDecode()
    backend.heads = (hq, scale)
    plan = backend.metadata(cache, batch)
    plan.update([context - 1] * batch, list(range(batch)))
    return plan.wrappers[0, 0.0]


def case(batch: int, context: int, heads: tuple[int, int, int], dev,
         triton_tiles: list[dict] | None = None) -> dict:
    """One (batch, context, heads) case: ms, GB/s and share of each arm. ``triton_tiles``:
    extra Triton arms, each a dict of ``num_splits`` and/or ``tiles`` (tuning sweeps)."""
    from graphcap.opsdb.triton.decode import decode_attention

    hq, hk, d = heads
    scale = 1 / math.sqrt(d)
    cache, nbytes = _cache(batch, context, hk, d, dev)
    q = torch.randn(batch, hq, d, device=dev, dtype=cache.k.dtype)
    out = torch.empty_like(q)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    layers = [cache.layer(i) for i in range(cache.layers)]
    arms = {"triton": [functools.partial(decode_attention, q, kc, vc, cache.block_table,
                                         lens, out, scale) for kc, vc in layers]}
    for i, extra in enumerate(triton_tiles or []):
        arms[f"triton#{i}"] = [functools.partial(
            decode_attention, q, kc, vc, cache.block_table, lens, out, scale, **extra)
            for kc, vc in layers]
    wrapper, skipped = _flashinfer(cache, batch, context, hq, scale), {}
    if isinstance(wrapper, str):
        skipped["flashinfer"] = wrapper
    else:
        arms["flashinfer"] = [functools.partial(wrapper.run, q, (kc, vc), out=out)
                              for kc, vc in layers]
    ms = {name: cycled_ms(calls) for name, calls in arms.items()}
    row = {"batch": batch, "context": context, "heads": list(heads), "bytes": nbytes,
           "ms": {k: round(v, 5) for k, v in ms.items()}, "skipped": skipped,
           "share": {k: round(nbytes / (v * 1e-3) / peak_bytes_per_s(dev), 3)
                     for k, v in ms.items()}}
    if triton_tiles:
        row["triton_tiles"] = triton_tiles
    del cache
    return row


def cases(dev, models=tuple(HEADS), batches=BATCHES, contexts=CONTEXTS) -> list[dict]:
    rows = []
    for model in models:
        for b in batches:
            for c in contexts:
                rows.append({"op": "decode attention", "model": model,
                             **case(b, c, HEADS[model], dev)})
    return rows


def verdicts(rows) -> list[dict]:
    out = []
    for row in rows:
        if row.get("op") != "decode attention" or "triton" not in row["ms"]:
            continue
        where = f"{row['model']} b={row['batch']} ctx={row['context']}"
        if "flashinfer" in row["ms"]:
            ratio = row["ms"]["triton"] / row["ms"]["flashinfer"]
            out.append({"op": "decode attention", "case": where, "vs": "flashinfer",
                        "triton_over_peer": round(ratio, 3), "limit": 1.1,
                        "met": ratio <= 1.1})
        if row["batch"] == 64:
            share = row["share"]["triton"]
            out.append({"op": "decode attention", "case": where, "vs": "bandwidth",
                        "share": share, "limit": 0.8, "met": share >= 0.8})
    return out


__all__ = ["BATCHES", "CONTEXTS", "HEADS", "PEAK_BYTES_PER_S", "case", "cases",
           "peak_bytes_per_s", "verdicts"]
