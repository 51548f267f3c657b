"""What one forward reads of a paged cache: :class:`CacheBatch`, set in the forward
context (``forward_context(kv=...)``) by whoever runs the model.

Every tensor here is computed on the device from the request slots and positions, with
no host synchronisation, so a graph can recompute it on each replay:

- ``cache_loc`` ``[T]``: each token's place in the cache, where the attention half writes its K/V;
- when every token attends over its request's pages (:meth:`CacheBatch.paged`: a decode
  step, one token per request, or an extend, a chunk of a prompt on its cached prefix),
  ``block_table`` ``[T, max_pages]`` (each token's request's pages) and ``seq_lens``
  ``[T]`` int32 (its position plus one: the tokens it attends to, itself included), what
  decode attention reads. A token whose request slot is out of range (a pad) gets the
  null page everywhere and length 0: it writes only the null page and comes out zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap.errors import UnsupportedModel
from graphcap.kv.paged import PagedKVCache
from graphcap.kv.places import token_rows


@dataclass
class CacheBatch:
    cache: PagedKVCache
    cache_loc: torch.Tensor
    block_table: torch.Tensor | None = None  # paged only
    seq_lens: torch.Tensor | None = None  # paged only
    written: set[int] = field(default_factory=set)  # the layers whose K/V the forward wrote
    # Paged only: the shape's plan of its decode attention backend (a DecodePlan of
    # graphcap.opsdb.attention.paged, updated on the host), or None (the default kernel).
    plan: Any = None
    # A decode step: every token is its request's only new token (no token reads
    # another's new K/V), so attention may write them in its own kernel.
    decode: bool = False

    def check_written(self, model) -> None:
        """After a forward: every layer of the cache wrote its K/V, or a clear error."""
        missing = sorted(set(range(self.cache.layers)) - self.written)
        if missing:
            raise UnsupportedModel(
                f"{type(model).__name__} wrote no K/V to the cache for layers {missing} of "
                f"{self.cache.layers}: its attention halves must go through "
                "graphcap.models.blocks.attention_half (or graphcap::cached_attention) "
                "with their layer index, and the cache must have as many layers as the "
                "model")

    @property
    def reads_pages(self) -> bool:
        """Attention reads the cache's pages (else only the forward's new tokens)."""
        return self.block_table is not None

    @classmethod
    def prefill(cls, cache: PagedKVCache, token_slots: torch.Tensor,
                positions: torch.Tensor) -> CacheBatch:
        """Packed prefill from position 0: token ``i`` is position ``positions[i]`` of the
        request in slot ``token_slots[i]``; its K/V go to that request's pages, and
        attention is among the new tokens."""
        return cls(cache, cache.cache_loc(token_slots, positions))

    @classmethod
    def paged(cls, cache: PagedKVCache, token_slots: torch.Tensor,
              positions: torch.Tensor) -> CacheBatch:
        """Token ``i`` is position ``positions[i]`` of the request in slot
        ``token_slots[i]`` (a slot out of range: a pad) and attends to that request's
        cached tokens up to itself: a decode step, or an extend."""
        table, lens = token_rows(cache.block_table, token_slots, positions)
        return cls(cache, cache.cache_loc(token_slots, positions), table, lens)
