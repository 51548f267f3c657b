"""FlashInfer's page lists of a decode step, built from the block table's host copy with
no loop over the rows, are what each row's pages say (the lists as a loop over
:meth:`PagedKVCache.pages_of` writes them), whatever the admissions, releases, writes
and pages freed behind a window before the step. FlashInfer itself runs only on CUDA
(``tests/inputs/test_decode_runner.py``); these lists are what it plans from."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.errors import OpInputError
from graphcap.kv import NULL_PAGE, PagedKVCache
from graphcap.opsdb.attention.flashinfer_decode import page_lists


def looped(cache: PagedKVCache, positions, slots, rows: int, window: int):
    """The lists by a loop over the rows: each row's pages from its first in the window
    to the one of its position, then a page of one token on the null page a pad."""
    size, indptr, indices, last = cache.page_size, [0], [], []
    for position, slot in zip(positions, slots, strict=True):
        first = max(0, position - window + 1) // size if window else 0
        indices += cache.pages_of(slot)[first: position // size + 1]
        indptr.append(len(indices))
        last.append(position % size + 1)
    for _ in range(rows - len(positions)):
        indices.append(NULL_PAGE)
        indptr.append(len(indices))
        last.append(1)
    return indptr, indices, last


@settings(max_examples=60, deadline=None)
@given(data=st.data(), window=st.sampled_from([0, 3, 8, 21]),
       page_size=st.sampled_from([1, 4, 16]))
def test_the_lists_are_each_rows_pages_after_any_admissions_writes_and_releases(
        data, window, page_size):
    cache = PagedKVCache(1, 1, 4, max_requests=5, max_len=48, page_size=page_size,
                         window=window)
    for _ in range(data.draw(st.integers(1, 12), "operations")):
        slot = data.draw(st.integers(0, cache.max_requests - 1), "slot")
        if slot not in cache.owned():
            if cache.free_pages * page_size >= 8:
                cache.admit(slot, data.draw(st.integers(
                    1, min(cache.max_len, cache.free_pages * page_size)), "tokens"))
        elif data.draw(st.booleans(), "release"):
            cache.release(slot)
        else:
            end = data.draw(st.integers(cache.written(slot), cache.capacity(slot)), "end")
            cache.wrote([(slot, end)])
    assert cache.host_table.tolist() == cache.block_table.tolist()
    live = sorted(cache.owned())
    slots = data.draw(st.permutations(live), "order")[:data.draw(st.integers(0, len(live)))]
    # A row at a position its pages hold, after any freed behind its window.
    positions = [data.draw(st.integers(max(cache.written(s) - 1, 0) if window else 0,
                                       cache.capacity(s) - 1), "position") for s in slots]
    rows = len(slots) + data.draw(st.integers(0, 3), "pads")
    got = page_lists(cache.host_table, page_size, positions, slots, rows, window)
    assert [a.dtype for a in got] == [np.int32] * 3
    assert [a.tolist() for a in got] == [list(v) for v in looped(cache, positions, slots,
                                                                  rows, window)]


def test_a_window_lists_only_the_pages_that_hold_it():
    cache = PagedKVCache(1, 1, 4, max_requests=2, max_len=64, page_size=4)
    cache.admit(1, 64)  # pages 1 .. 16
    indptr, indices, last = page_lists(cache.host_table, 4, [37], [1], 2, window=8)
    assert indices.tolist() == [8, 9, 10, NULL_PAGE]  # tokens 30 .. 37, then the pad's
    assert indptr.tolist() == [0, 3, 4] and last.tolist() == [2, 1]


def test_the_host_copy_is_read_only():
    cache = PagedKVCache(1, 1, 4, max_requests=2, max_len=16, page_size=4)
    cache.admit(0, 16)
    with pytest.raises(ValueError, match="read-only"):
        cache.host_table[0, 0] = 3
    assert cache.host_table[0].tolist() == cache.pages_of(0)


@pytest.mark.parametrize("positions, slots, rows", [([3, 4], [0], 2), ([3, 4], [0, 1], 1)])
def test_lists_of_unmatched_positions_and_slots_or_too_few_rows_are_refused(positions,
                                                                            slots, rows):
    cache = PagedKVCache(1, 1, 4, max_requests=2, max_len=16, page_size=4)
    cache.admit(0, 16)
    cache.admit(1, 16)
    with pytest.raises(OpInputError, match="as many positions as request slots"):
        page_lists(cache.host_table, 4, positions, slots, rows)
