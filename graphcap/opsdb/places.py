"""Each token's place in a paged cache, and the pages and length it attends over, from its
request slot and position: ``cache_places``, what a graph recomputes on every replay.

``block_table`` ``[R, W]`` int32 is the cache's table (row ``r``: request slot ``r``'s
pages in order; at least one row and one page, else refused); token ``i`` is position
``positions[i]`` of the request in slot ``token_slots[i]``. The op writes, in place:

- ``cache_loc`` ``[T]`` int64: ``page * page_size + position % page_size``, the page being
  the request's page ``position // page_size``; the null page (:data:`graphcap.kv.NULL_PAGE`)
  where the slot is out of range (a pad: negative), the position negative or past the
  row's pages, so no token ever writes another request's place;
- with ``table`` ``[T, W]`` and ``seq_lens`` ``[T]`` (both int32, or neither): each
  token's request's row (the null page for a pad) and ``position + 1`` (0 for a pad),
  what decode attention reads.

The reference is :mod:`graphcap.kv`'s own torch ops (:func:`~graphcap.kv.places.token_places`,
:func:`~graphcap.kv.places.token_rows`), some twenty small kernels; the Triton kernel is one
launch. No host synchronisation.
"""

from __future__ import annotations

import torch

from graphcap.kv.places import token_places, token_rows
from graphcap.opsdb import checks
from graphcap.opsdb.spec import Kernel, register_op

OP = "cache_places"
INTS = (torch.int32, torch.int64)


def cache_places_reference(token_slots, positions, block_table, page_size: int, cache_loc,
                           table=None, seq_lens=None) -> None:
    """The places (and rows and lengths) by :mod:`graphcap.kv`'s torch ops, in place."""
    cache_loc.copy_(token_places(block_table, page_size, token_slots, positions))
    if table is not None:
        rows, lens = token_rows(block_table, token_slots, positions)
        table.copy_(rows)
        seq_lens.copy_(lens)


def check_cache_places(token_slots, positions, block_table, page_size, cache_loc, table=None,
                       seq_lens=None) -> None:
    checks.tensor(OP, "token_slots", token_slots, ndim=1, dtypes=INTS)
    device = token_slots.device
    checks.tensor(OP, "positions", positions, ndim=1, dtypes=INTS, device=device)
    checks.tensor(OP, "block_table", block_table, ndim=2, dtypes=(torch.int32,),
                  device=device)
    checks.tensor(OP, "cache_loc", cache_loc, ndim=1, dtypes=(torch.int64,), device=device)
    if 0 in block_table.shape:  # every token's row and page index clamp into the table
        raise checks.OpInputError(
            f"{OP}: block_table {tuple(block_table.shape)} has no rows or no pages; a "
            "table holds one row per request slot and at least one page a row")
    tokens = token_slots.shape[0]
    checks.same(OP, "the token count", positions.shape[0], tokens, "positions",
                "token_slots")
    checks.same(OP, "the token count", cache_loc.shape[0], tokens, "cache_loc",
                "token_slots")
    if page_size < 1:
        raise checks.OpInputError(f"{OP}: page_size must be positive, got {page_size}")
    if (table is None) != (seq_lens is None):
        raise checks.OpInputError(f"{OP}: table and seq_lens go together (a decode step's "
                                  "rows and lengths), or neither (a prefill's places)")
    if table is not None:
        checks.tensor(OP, "table", table, ndim=2, dtypes=(torch.int32,), device=device)
        checks.tensor(OP, "seq_lens", seq_lens, ndim=1, dtypes=(torch.int32,),
                      device=device)
        checks.same(OP, "the shape", tuple(table.shape), (tokens, block_table.shape[1]),
                    "table", "[tokens, block_table's width]")
        checks.same(OP, "the token count", seq_lens.shape[0], tokens, "seq_lens",
                    "token_slots")
    for name, t in (("token_slots", token_slots), ("positions", positions),
                    ("block_table", block_table), ("cache_loc", cache_loc),
                    ("table", table), ("seq_lens", seq_lens)):
        if t is not None and not t.is_contiguous():
            raise checks.OpInputError(f"{OP}: {name} must be contiguous")


def cache_places_inputs(device, dtype, max_tokens: int = 12):
    """Tokens of live slots at positions inside and past their rows, pads (slot -1, and
    slots past the table), negative positions; with or without the rows and lengths."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        rows, width = d(st.integers(1, 4)), d(st.integers(1, 6))
        page_size = d(st.sampled_from([1, 4, 16]))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        table = torch.randint(0, 64, (rows, width), generator=gen, dtype=torch.int32)
        slots = torch.randint(-1, rows + 2, (t,), generator=gen)
        positions = torch.randint(-2, width * page_size + 3, (t,), generator=gen)
        cast = d(st.sampled_from(INTS))
        out = torch.full((t,), -7, dtype=torch.int64)
        paged = d(st.booleans())
        more = (torch.full((t, width), -7, dtype=torch.int32),
                torch.full((t,), -7, dtype=torch.int32)) if paged else (None, None)
        to = lambda x: x.to(device) if x is not None else None  # noqa: E731
        return (to(slots.to(cast)), to(positions.to(d(st.sampled_from(INTS)))), to(table),
                page_size, to(out), *(to(m) for m in more))

    return draw()


CACHE_PLACES = register_op(
    f"graphcap::{OP}",
    "(Tensor token_slots, Tensor positions, Tensor block_table, int page_size, "
    "Tensor(a!) cache_loc, Tensor(b!)? table=None, Tensor(c!)? seq_lens=None) -> ()",
    reference=cache_places_reference,
    kernels={"triton": Kernel("graphcap.opsdb.triton.places:cache_places",
                              requires=("triton",))},
    check=check_cache_places, inputs=cache_places_inputs,
    doc="each token's place in a paged cache [T] (and its request's pages [T, W] and "
        "length [T]) from its request slot and position",
)
