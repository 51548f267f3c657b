"""Each token's place in a paged cache, its request's pages and length (contract:
:mod:`graphcap.opsdb.places`): one program per token reads its slot and position, writes
its place, and copies its request's block-table row (the null page for a pad) in blocks.
Grid from host shapes only, ``T == 0`` launches nothing: safe inside a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.kv.paged import NULL_PAGE
from graphcap.opsdb.triton.common import pdl_args, pdl_start


@triton.jit
def _places_kernel(slots_ptr, pos_ptr, table_ptr, loc_ptr, rows_ptr, lens_ptr,
                   requests, width, page_size, null_page,
                   BLOCK_W: tl.constexpr, ROWS: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    rest = pos % page_size  # floor modulo, as torch's: a negative position stays in range
    rest = tl.where(rest < 0, rest + page_size, rest)
    index = (pos - rest) // page_size
    live = (slot >= 0) & (slot < requests)
    inside = live & (pos >= 0) & (index < width)
    row = tl.minimum(tl.maximum(slot, 0), requests - 1) * width
    page = tl.load(table_ptr + row + tl.minimum(tl.maximum(index, 0), width - 1))
    page = tl.where(inside, page.to(tl.int64), null_page)
    tl.store(loc_ptr + t, page * page_size + rest)
    if ROWS:
        tl.store(lens_ptr + t, tl.where(live, pos + 1, 0).to(tl.int32))
        out = rows_ptr + t.to(tl.int64) * width
        for w0 in range(0, width, BLOCK_W):
            w = w0 + tl.arange(0, BLOCK_W)
            pages = tl.load(table_ptr + row + w, mask=w < width, other=0)
            tl.store(out + w, tl.where(live, pages, null_page), mask=w < width)


def cache_places(token_slots: torch.Tensor, positions: torch.Tensor,
                 block_table: torch.Tensor, page_size: int, cache_loc: torch.Tensor,
                 table: torch.Tensor | None = None,
                 seq_lens: torch.Tensor | None = None) -> None:
    T = token_slots.shape[0]
    if T == 0:
        return
    requests, width = block_table.shape
    rows = table is not None
    _places_kernel[(T,)](
        token_slots, positions, block_table, cache_loc,
        table if rows else cache_loc, seq_lens if rows else cache_loc,
        requests, width, page_size, NULL_PAGE,
        BLOCK_W=min(1024, triton.next_power_of_2(width)), ROWS=rows, num_warps=1,
        **pdl_args(token_slots.device, T, "cache_places"))


__all__ = ["cache_places"]
