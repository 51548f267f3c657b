"""Shared pieces of the runner tests: the tiny decoder, batches, and the eager truth."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.models import PRESETS, Decoder, build_model
from graphcap.opsdb.attention import BACKENDS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BUCKETS = [4, 8, 16, 32, 64]
SLOTS = 4
GPU_ONLY = {"triton", "flashinfer", "flash_attn"}


def combos():
    """(strategy, attention backend) pairs that may run here, as pytest params."""
    out = []
    for strategy in GRAPHED:
        for name, cls in BACKENDS.items():
            if not cls().runs_under(strategy) or cls().unavailable(DEVICE):
                continue
            if DEVICE == "cpu" and name in GPU_ONLY:
                continue  # the Triton interpreter is too slow for whole models
            marks = [pytest.mark.gpu] if DEVICE == "cuda" else []
            out.append(pytest.param(strategy, name, marks=marks, id=f"{strategy}-{name}"))
    return out


@functools.cache
def model():
    if DEVICE == "cpu":
        return build_model("tiny", device=DEVICE, dtype=torch.float32)
    # On CUDA, head dim 64: the smallest that FlashInfer and FlashAttention-4 run.
    torch.manual_seed(0)
    with torch.device(DEVICE):
        decoder = Decoder(dataclasses.replace(PRESETS["tiny"], head_dim=64))
    return decoder.to(torch.bfloat16).eval()


@functools.cache
def runner(strategy: str, attention: str, buckets=tuple(BUCKETS)):
    return graphcap.capture(model(), strategy, buckets=list(buckets), max_requests=SLOTS,
                            attention=attention)


def batch(lens, seed=0, low=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(low, model().args.vocab_size, (sum(lens),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lens]) if lens else torch.zeros(0)
    return ids.to(DEVICE), pos.long().to(DEVICE)


def eager(attention: str, ids, pos, lens):
    return runner("eager", attention)(ids, pos, seq_lens=lens)


def tolerance():
    return (3e-2, 3e-2) if DEVICE == "cuda" else (1e-5, 1e-5)


def stream_counting_freed(llm, prompts, new: int) -> tuple[list[list[int]], int]:
    """``llm``'s tokens for ``prompts``, and the most cache pages its live requests had
    freed behind their window at once (null-page entries among their pages)."""
    from graphcap.kv import NULL_PAGE

    tokens: dict[int, list[int]] = {}
    freed = 0
    for delta in llm.stream(prompts, new):
        tokens.setdefault(delta.index, []).extend(delta.tokens)
        freed = max(freed, sum(p.count(NULL_PAGE) for p in llm.cache.owned().values()))
    return [tokens[i] for i in range(len(prompts))], freed


def prefilled_tiny(prompts: dict[int, list[int]], extra: int, *, logits: str = "all",
                   max_len: int = 32):
    """The tiny decoder on ``DEVICE`` and a paged cache (pages of 4, NaN wherever nothing
    was written: nothing unwritten is ever read) holding ``prompts`` (request slot ->
    tokens), each admitted for ``extra`` tokens more; the prefill's logits."""
    from graphcap.engine.eager import prefill
    from graphcap.kv import PagedKVCache

    torch.manual_seed(0)
    m = Decoder(PRESETS["tiny"], logits=logits).to(DEVICE).eval()
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=max_len,
                         page_size=4, device=DEVICE)
    cache.k.fill_(float("nan"))
    cache.v.fill_(float("nan"))
    slots = sorted(prompts)
    for slot in slots:
        cache.admit(slot, len(prompts[slot]) + extra)
    ids = torch.tensor(sum((prompts[s] for s in slots), []), device=DEVICE)
    out = prefill(m, cache, ids, [len(prompts[s]) for s in slots], slots)
    return m, cache, out


def windowed_extend(slots: int):
    """The tiny decoder windowed to 8 tokens on ``DEVICE``, a paged cache of ``slots``
    request slots (32 tokens each, pages of 4, freed behind the window) and a full runner
    of 16-token chunks that extend its requests."""
    from graphcap.inputs import CachePrefillInputs
    from graphcap.kv import PagedKVCache
    from graphcap.opsdb.attention import get_backend

    torch.manual_seed(0)
    m = Decoder(dataclasses.replace(PRESETS["tiny"], window=8)).to(DEVICE).eval()
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=slots, max_len=32,
                         page_size=4, device=DEVICE, window=8)
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    runner = graphcap.capture(m, "full", buckets=[16], inputs=CachePrefillInputs(
        cache, backend, slots=slots, extend=True))
    return m, cache, runner
