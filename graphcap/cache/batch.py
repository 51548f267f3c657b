"""What one forward reads of a paged cache: :class:`CacheBatch`, set in the forward
context (``forward_context(kv=...)``) by whoever runs the model.

Every tensor here is computed on the device from the request slots and positions, with
no host synchronisation, so a graph can recompute it on each replay:

- ``slots`` ``[T]``: each token's cache slot, where the attention half writes its K/V;
- for a decode step (one token per row), ``block_table`` ``[B, max_pages]`` (each row's
  pages) and ``seq_lens`` ``[B]`` int32 (its cached tokens, the new one included), what
  decode attention reads. A row whose request slot is out of range (a pad) gets the null
  page everywhere and length 0: it writes only the null page and comes out zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from graphcap.cache.paged import NULL_PAGE, PagedKVCache
from graphcap.errors import UnsupportedModel


@dataclass
class CacheBatch:
    cache: PagedKVCache
    slots: torch.Tensor
    block_table: torch.Tensor | None = None  # decode only
    seq_lens: torch.Tensor | None = None  # decode only
    written: set[int] = field(default_factory=set)  # the layers whose K/V the forward wrote

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
    def decode(self) -> bool:
        return self.block_table is not None

    @classmethod
    def prefill(cls, cache: PagedKVCache, rows: torch.Tensor,
                positions: torch.Tensor) -> CacheBatch:
        """Packed prefill: token ``i`` is position ``positions[i]`` of the request in
        slot ``rows[i]``; its K/V go to that request's pages."""
        return cls(cache, cache.slots(rows, positions))

    @classmethod
    def decode_step(cls, cache: PagedKVCache, rows: torch.Tensor,
                    positions: torch.Tensor) -> CacheBatch:
        """One new token per row: row ``b`` is position ``positions[b]`` of the request
        in slot ``rows[b]`` (rows out of range: pads)."""
        rows, positions = rows.long(), positions.long()
        live = (rows >= 0) & (rows < cache.max_requests)
        table = cache.block_table[rows.clamp(0, cache.max_requests - 1)]
        table = torch.where(live[:, None], table, NULL_PAGE)
        lens = torch.where(live, positions + 1, 0).to(torch.int32)
        return cls(cache, cache.slots(rows, positions), table, lens)
