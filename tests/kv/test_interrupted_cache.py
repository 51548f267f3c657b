"""A Ctrl-C at any bytecode instruction of the cache's admission, release, freeing
behind the window and rewinds leaves it whole: every page held by one slot or free, once;
a slot holding no pages claims no tokens; each block-table row (and its host copy)
lists its slot's pages; and the same request is admitted again."""

from __future__ import annotations

import pytest

from graphcap.kv import NULL_PAGE, PagedKVCache
from tests.support.interrupts import code_of, instructions, interrupted

METHODS = code_of(*(f for f in vars(PagedKVCache).values() if callable(f)))


def cache(window: int = 0) -> PagedKVCache:
    """Slot 0 holding a request of 10 tokens (4 written), slot 1 one of 30 (12 written)."""
    c = PagedKVCache(1, 1, 4, max_requests=3, max_len=32, page_size=4, window=window)
    c.admit(0, 10)
    c.admit(1, 30)
    c.wrote([(0, 4), (1, 12)])
    return c


def assert_whole(c: PagedKVCache) -> None:
    owned = c.owned()
    held = [p for pages in owned.values() for p in pages if p != NULL_PAGE]
    assert len(set(held)) == len(held) and len(held) + c.free_pages == c.pages, owned
    for slot in range(c.max_requests):
        pages = owned.get(slot, [])
        row = pages + [NULL_PAGE] * (c.max_pages - len(pages))
        assert c.block_table[slot].tolist() == c.host_table[slot].tolist() == row
        if slot in owned:
            assert c.written(slot) <= c.capacity(slot) <= len(pages) * c.page_size
        else:
            assert c.capacity(slot) == c.written(slot) == 0
    # Every free page is one no slot holds, once: released, the slots take every page.
    for slot in owned:
        c.release(slot)
    taken = [p for slot in range(c.max_requests) for p in c.admit(slot, c.max_len)]
    assert sorted(taken) == list(range(1, c.pages + 1)) and c.free_pages == 0


CALLS = {
    "admit": (0, lambda c: c.admit(2, 20)),
    "release": (0, lambda c: c.release(1)),
    "release_windowed": (3, lambda c: c.release(1)),  # its first pages freed already
    "wrote_windowed": (3, lambda c: c.wrote([(0, 6), (1, 25)])),  # frees pages behind
    "rewind": (0, lambda c: c.rewind(1, 5)),
    "unwrite": (0, lambda c: c.unwrite([(0, 2), (1, 7)])),
}


@pytest.mark.parametrize("name", CALLS)
def test_a_ctrl_c_at_any_instruction_leaves_the_cache_whole(name):
    window, call = CALLS[name]
    count = instructions(METHODS, call, cache(window))
    assert count > 20
    for n in range(1, count + 1):
        c = cache(window)
        _, out = interrupted(METHODS, n, call, c)
        assert isinstance(out, KeyboardInterrupt), (n, out)
        assert_whole(c)
