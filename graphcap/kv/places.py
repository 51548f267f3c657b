"""Where a batch's tokens live in a paged cache, by torch ops over its block table (the
reference of ``graphcap::cache_places``). **Page 0 is the null page**: no request owns
it, and a token out of range is placed there."""

from __future__ import annotations

import torch

NULL_PAGE = 0


def token_places(block_table: torch.Tensor, page_size: int, token_slots: torch.Tensor,
                 positions: torch.Tensor) -> torch.Tensor:
    """:meth:`PagedKVCache.cache_loc` over a block table ``[requests, max_pages]``: each
    token's place (int64), the null page where its slot or position is out of range."""
    requests, width = block_table.shape
    token_slots, positions = token_slots.long(), positions.long()
    index = positions // page_size
    inside = (token_slots >= 0) & (token_slots < requests) & (positions >= 0) & \
        (index < width)
    page = block_table[token_slots.clamp(0, requests - 1), index.clamp(0, width - 1)]
    page = torch.where(inside, page.long(), NULL_PAGE)
    return page * page_size + positions % page_size


def token_rows(block_table: torch.Tensor, token_slots: torch.Tensor,
               positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's request's block-table row ``[T, max_pages]`` and length ``[T]`` (its
    position plus one), both int32; the null page and 0 for a slot out of range (a pad)."""
    requests = block_table.shape[0]
    token_slots, positions = token_slots.long(), positions.long()
    live = (token_slots >= 0) & (token_slots < requests)
    table = block_table[token_slots.clamp(0, requests - 1)]
    table = torch.where(live[:, None], table, NULL_PAGE)
    return table, torch.where(live, positions + 1, 0).to(torch.int32)
