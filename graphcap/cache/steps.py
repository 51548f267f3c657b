"""The calls an engine makes on a paged cache, eagerly: prefill requests into their slots,
and one decode step of one token per slot. (Decode under graphs, sampling and a
``generate()`` loop build on these.)

The model is one of graphcap's reference decoders or any model whose attention halves
go through :func:`graphcap.models.blocks.attention_half` with their layer index: it
reads the cache from the forward context.
"""

from __future__ import annotations

import torch

from graphcap.cache.batch import CacheBatch
from graphcap.cache.paged import PagedKVCache
from graphcap.core.batch import host_lengths
from graphcap.core.context import forward_context
from graphcap.errors import BadBatch
from graphcap.opsdb.attention.packed import packed


def _slots(cache: PagedKVCache, slots, count: int) -> list[int]:
    slots = [cache._slot(s) for s in slots]
    if len(slots) != count or len(set(slots)) != len(slots):
        raise BadBatch(f"give one distinct request slot per request: {count} requests, "
                       f"slots {slots}")
    free = [s for s in slots if cache.capacity(s) == 0]
    if free:
        raise BadBatch(f"request slots {free} hold no request: cache.admit(slot, tokens) "
                       "each first")
    return slots


def _model_dtype(model) -> torch.dtype:
    return next(p.dtype for p in model.parameters() if p.is_floating_point())


@torch.inference_mode()
def prefill(model, cache: PagedKVCache, input_ids: torch.Tensor, seq_lens, slots,
            attention: str | None = None) -> torch.Tensor:
    """Run the prompts of requests ``slots`` (admitted in ``cache``), packed in
    ``input_ids`` ``[T]`` with lengths ``seq_lens``, writing their K/V to the cache;
    returns each request's last-token logits ``[requests, vocab]``. Each prompt starts at
    position 0 and must fit the request's admitted tokens."""
    lens = host_lengths(seq_lens)
    slots = _slots(cache, slots, len(lens))
    if 0 in lens or sum(lens) != input_ids.shape[0]:
        raise BadBatch(f"seq_lens {lens} must be positive and sum to the {input_ids.shape[0]}"
                       " tokens of input_ids")
    over = [(s, n) for s, n in zip(slots, lens, strict=True) if n > cache.capacity(s)]
    if over:
        raise BadBatch(f"prompts longer than their slots were admitted for: (slot, tokens) "
                       f"{over}; admit them for their prompt plus new tokens")
    device = input_ids.device
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    rows = torch.repeat_interleave(torch.tensor(slots, device=device),
                                   torch.tensor(lens, device=device))
    kv = CacheBatch.prefill(cache, rows, positions)
    with packed(lens, device, attention, _model_dtype(model), kv=kv) as meta:
        last = meta.last_token_rows()
        if getattr(model, "output_rows", "tokens") == "requests":
            out = model(input_ids, positions, last)
        else:
            out = model(input_ids, positions)[last]
    kv.check_written(model)
    for slot, n in zip(slots, lens, strict=True):
        cache.wrote_prompt(slot, n)
    return out


@torch.inference_mode()
def decode_step(model, cache: PagedKVCache, input_ids: torch.Tensor,
                positions: torch.Tensor, slots) -> torch.Tensor:
    """One decode step: row ``b`` is token ``input_ids[b]`` at position ``positions[b]``
    of the request in slot ``slots[b]`` (its previous tokens in the cache). Writes the
    tokens' K/V and returns their logits ``[B, vocab]``."""
    slots = _slots(cache, slots, input_ids.shape[0])
    if positions.shape != input_ids.shape or input_ids.dim() != 1:
        raise BadBatch(f"input_ids {tuple(input_ids.shape)} and positions "
                       f"{tuple(positions.shape)} must be [B], one token per row")
    cache.check_step(slots, positions.tolist())  # an eager step: the host may read them
    rows = torch.tensor(slots, device=input_ids.device)
    kv = CacheBatch.decode_step(cache, rows, positions)
    with forward_context(kv=kv):
        if getattr(model, "output_rows", "tokens") == "requests":
            out = model(input_ids, positions, torch.arange(len(slots),
                                                           device=input_ids.device))
        else:
            out = model(input_ids, positions)
    kv.check_written(model)
    return out
