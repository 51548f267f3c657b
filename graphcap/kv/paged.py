"""A preallocated paged K/V cache: pages of ``page_size`` tokens per layer, a block
table on the device, and a host allocator that hands a request its pages at admission.

Layout, per layer, for K and for V: ``[pages + 1, page_size, kv_heads, head_dim]``.
**Page 0 is the null page**: no request owns it; every unused block-table entry points at
it, and padded rows of a captured batch read and write only it, so a pad can neither
write a real page nor read another request's tokens. The block table ``[max_requests,
max_pages]`` int32 lives on the device (graphs read it); row ``r`` lists request slot
``r``'s pages in order, so token ``t`` of the request is slot ``t % page_size`` of page
``block_table[r, t // page_size]``.

A request's pages are allocated once, at :meth:`PagedKVCache.admit`, for every token it
may hold (prompt plus new tokens): the decode loop then needs no host allocation, and a
cache too small says so at admission (:class:`~graphcap.errors.CacheFull`), not mid-loop.

A cache of a model whose every layer attends to a window (``window``: the longest of
them) frees a request's pages once they lie wholly behind it, as its tokens are written:
no later step of the request reads them (its block-table entries point at the null page
again, which attention never reads outside a row's window) and other requests may take
them. With one layer of full attention the window is 0 and every page is kept.
"""

from __future__ import annotations

import operator
import warnings

import numpy as np
import torch

from graphcap.core.checks import as_int, positive_int
from graphcap.errors import BadBatch, CacheFull
from graphcap.kv.places import NULL_PAGE, token_places
from graphcap.kv.sizing import allocate, block_tables, check_room, check_storage


def longest_window(windows) -> int:
    """The ``window`` of a cache for a model whose layers attend through ``windows`` (one
    per layer, 0 for full attention): the longest when every layer is windowed, else 0
    (a layer of full attention reads every page)."""
    windows = list(windows)
    return max(windows) if windows and all(windows) else 0


class PagedKVCache:
    """``layers`` layers of K and V in pages; ``max_requests`` request slots of up to
    ``max_len`` tokens each; ``pages`` real pages (default: enough for every slot at
    ``max_len``), plus the null page; keys and values of ``dtype`` (float32, float16 or
    bfloat16: what the cache ops take) on ``device``.

        cache = PagedKVCache(layers=28, kv_heads=8, head_dim=128, max_requests=8,
                             max_len=4096, page_size=16, dtype=torch.bfloat16,
                             device="cuda")
        cache.admit(slot=0, tokens=prompt_len + max_new_tokens)
        k, v = cache.layer(3)             # [pages + 1, page_size, kv_heads, head_dim]
        cache.release(0)
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, *, max_requests: int,
                 max_len: int, page_size: int = 16, pages: int | None = None,
                 dtype: torch.dtype = torch.float32, device="cpu", window: int = 0):
        self.layers = positive_int(layers, "layers")
        self.kv_heads = positive_int(kv_heads, "kv_heads")
        self.head_dim = positive_int(head_dim, "head_dim")
        self.max_requests = positive_int(max_requests, "max_requests")
        self.max_len = positive_int(max_len, "max_len")
        self.page_size = positive_int(page_size, "page_size")
        self.max_pages = -(-self.max_len // self.page_size)  # a block-table row
        self.pages = positive_int(pages if pages is not None
                                  else self.max_requests * self.max_pages, "pages")
        self.window = as_int(window, "window (the longest window, every layer windowed)")
        if self.window < 0:
            raise ValueError(f"window={window}: the longest attention window of a model "
                             "whose every layer is windowed, or 0 (keep every page)")
        self.dtype, self.device = check_storage(dtype, device)
        shape = (self.layers, self.pages + 1, self.page_size, self.kv_heads, self.head_dim)
        check_room(shape, dtype, self.device)  # K and V first: the pages that fit
        self.block_table, self._table = block_tables(  # and its host copy
            self.max_requests, self.max_pages, self.device, NULL_PAGE)
        self.k, self.v = allocate(shape, dtype, self.device)  # CacheTooLarge, or both
        self.device = self.k.device  # "cuda" made "cuda:0": what tensors compare against
        self._free = list(range(self.pages, NULL_PAGE, -1))  # pop() gives low pages first
        self._owned: dict[int, list[int]] = {}
        self._capacity: dict[int, int] = {}
        self._written: dict[int, int] = {}  # tokens of each slot's K/V written so far
        self._dropped: dict[int, int] = {}  # leading pages freed behind the window

    # -- admission -------------------------------------------------------------------
    def admit(self, slot: int, tokens: int) -> list[int]:
        """Give request slot ``slot`` the pages for ``tokens`` tokens (its prompt and every
        token it may generate) and write its block-table row; returns the pages. Raises
        :class:`CacheFull` when the free pages do not cover it (nothing changes then)."""
        slot = self._slot(slot)
        if slot in self._owned:
            raise ValueError(f"request slot {slot} holds a request already; release({slot}) "
                             "it first")
        tokens = positive_int(tokens, "tokens (prompt plus new tokens)")
        if tokens > self.max_len:
            raise ValueError(f"a request of {tokens} tokens exceeds the cache's max_len "
                             f"{self.max_len}; build the cache with a larger max_len")
        need = -(-tokens // self.page_size)
        if need > len(self._free):
            fix = "release finished requests, or build" if need <= self.pages else \
                f"no release frees that many, the cache has {self.pages} in all; build"
            raise CacheFull(
                f"a request of {tokens} tokens needs {need} pages of {self.page_size} and "
                f"{len(self._free)} of {self.pages} are free ({len(self._owned)} requests "
                f"hold the rest): {fix} the cache with more pages")
        try:  # the slot owns its pages last: interrupted before, it is admitted for none
            pages = [self._free.pop() for _ in range(need)]
            self._table[slot, :need] = pages
            self.block_table[slot].copy_(torch.from_numpy(self._table[slot]))
            self._capacity[slot], self._written[slot], self._dropped[slot] = tokens, 0, 0
            self._owned[slot] = pages
        except BaseException:  # a Ctrl-C, at any point
            self._settle()
            raise
        return list(pages)

    def release(self, slot: int) -> None:
        """Free request slot ``slot``'s pages; its block-table row points at the null page
        again (what its pages held stays until another request overwrites it)."""
        slot = self._slot(slot)
        if slot not in self._owned:
            raise ValueError(f"request slot {slot} holds no request")
        try:  # the slot owns its pages no more first: interrupted after, it is released
            pages = self._owned.pop(slot)
            self._free.extend(reversed(pages[self._dropped.pop(slot):]))
            del self._capacity[slot], self._written[slot]
            self._table[slot] = NULL_PAGE
            self.block_table[slot].fill_(NULL_PAGE)
        except BaseException:
            self._settle()
            raise

    def capacity(self, slot: int) -> int:
        """Tokens request slot ``slot`` was admitted for (0 when it is free)."""
        return self._capacity.get(self._slot(slot), 0)

    def written(self, slot: int) -> int:
        """Tokens of request slot ``slot`` whose K/V are in the cache (positions 0 ..
        written - 1): a step may start at the next position or any before it (from
        :meth:`least_kept` on), never past."""
        return self._written.get(self._slot(slot), 0)

    def check_step(self, slots, positions, tokens: int = 1, *, checked: bool = False
                   ) -> None:
        """Refuse (``BadBatch``) a step of ``tokens`` tokens a slot, from its position of
        ``positions``, that reaches outside what the slot was admitted for, or starts past
        the tokens written (it would read pages never written, or a released request's
        leftovers). Changes nothing: the step's tokens count as written once it has run
        (:meth:`wrote`). ``checked``: ``slots`` are what :meth:`requests` returned (ints
        of admitted slots) and ``positions`` ints, as a runner's call has them: a step
        that passes costs a few C-level passes over them, no Python loop."""
        capacities, written = self._capacity, self._written
        if checked and len(slots) == len(positions) and self._fits(slots, positions, tokens):
            if self.window:
                for slot, position in zip(slots, positions, strict=True):
                    self.check_reach(slot, position)
            return
        if type(tokens) is not int or tokens < 1:
            raise ValueError(f"check_step: tokens={tokens!r}, not a positive int")
        over, slots, positions = [], list(slots), list(positions)
        if len(slots) != len(positions):
            raise BadBatch(f"{len(slots)} request slots and {len(positions)} positions: "
                           "give one position per request")
        for slot, position in zip(slots, positions, strict=True):
            slot = self._slot(slot, BadBatch)
            position = as_int(position, f"a position (slot {slot})", BadBatch)
            capacity = capacities.get(slot, 0)
            if not 0 <= position < capacity:
                held = "" if capacity else " (it holds no request)"
                raise BadBatch(f"position {position} of slot {slot} is outside the {capacity} "
                               f"tokens the slot was admitted for{held}: admit requests for "
                               "their prompt plus new tokens")
            if position > written[slot]:
                raise BadBatch(f"position {position} of slot {slot} skips past the "
                               f"{written[slot]} tokens written to its pages: step each "
                               "position in turn")
            if position + tokens > capacity:
                over.append((slot, position + tokens))
            self.check_reach(slot, position)
        if over:  # tokens > 1: the last tokens of a step past what was admitted
            raise BadBatch(f"steps of {tokens} tokens end past what their slots were admitted "
                           f"for: (slot, end) {over}; admit requests for their prompt plus "
                           "new tokens")

    def _fits(self, slots: list[int], positions: list[int], tokens: int) -> bool:
        """Whether every admitted slot of ``slots`` may take ``tokens`` tokens from its
        position (what :meth:`check_step`'s loop checks, the errors left to it)."""
        if not positions or tokens < 1 or min(positions) < 0:
            return False
        ends = positions if tokens == 1 else [p + tokens - 1 for p in positions]
        try:
            return all(map(operator.lt, ends, map(self._capacity.__getitem__, slots))) and \
                all(map(operator.le, positions, map(self._written.__getitem__, slots)))
        except KeyError:  # a slot holding no request: the loop names it
            return False

    def check_reach(self, slot: int, position: int) -> None:
        """Refuse (``BadBatch``) a token at ``position`` of ``slot`` whose window reaches
        back to pages freed behind it."""
        least = self.least_kept(slot)
        if least and position < least:
            freed = self._dropped[slot] * self.page_size
            reach = "is one of" if position < freed else "attends back to"
            raise BadBatch(
                f"position {position} of slot {slot} {reach} the tokens before {freed}, "
                f"whose pages were freed behind every layer's window of {self.window} "
                f"tokens: continue from position {least} on, release({slot}) and admit it "
                "again to start over, or build the cache with window=0 to keep every page")

    def wrote(self, ends, tokens: int = 1) -> None:
        """A forward that ran wrote each ``(slot, end)`` of ``ends`` (every slot admitted, or
        none counts): the request's tokens ``0 .. end - 1`` are cached now, what follows stale.
        Called once the forward has run: a step that raised counts nothing. ``tokens``: what the
        call wrote a request (a verify step's 1 + k, a draft's k steps), of which a
        :meth:`rewind` may keep only the first: pages behind the window are freed as of it."""
        ends, written = list(ends), self._written
        if missing := [slot for slot, _ in ends if slot not in written]:
            raise ValueError(f"request slot {missing[0]!r} holds no request")
        for slot, end in ends:  # slots a call's check took: a dict lookup each, per step
            written[slot] = end
            if self.window:
                self._free_behind(slot, end - tokens + 1)

    def unwrite(self, starts) -> None:
        """A forward that raised may have written each ``(slot, start)`` of ``starts``
        from ``start`` on: the request keeps only its tokens before ``start`` (fewer, if
        it had fewer), and its next step goes on from there; where pages were freed
        behind the window past ``start`` (a call that ran, cut short as :meth:`wrote` freed
        them), the tokens a step after them needs (:meth:`least_kept`), which it wrote."""
        for slot, start in starts:
            if slot in self._written:
                self._written[slot] = max(min(self._written[slot], start),
                                          self.least_kept(slot))

    def rewind(self, slot: int, end: int) -> None:
        """Keep only tokens ``0 .. end - 1`` of request slot ``slot``'s (a verify step's
        accepted ones): the K/V after them are stale, never read, and the next step
        writes over them. ``end`` may not pass the tokens written, nor reach back to
        pages freed behind the window (``ValueError`` naming it; nothing changes)."""
        slot = self._slot(slot)
        if slot not in self._written:
            raise ValueError(f"rewind of slot {slot}: it holds no request")
        written, least = self._written[slot], self.least_kept(slot)
        end = as_int(end, f"rewind of slot {slot}: the tokens to keep")  # numpy, 0-d too
        if not least <= end <= written:
            why = " (a step after fewer would attend to pages freed behind the window)" \
                if least else ""
            raise ValueError(f"rewind of slot {slot} to {end}: keep between {least}{why} "
                             f"and the {written} tokens written")
        self._written[slot] = end

    def least_kept(self, slot: int) -> int:
        """The fewest tokens a :meth:`rewind` of ``slot`` may keep: 0, or, once pages were
        freed behind the window, as many as a step after them needs to find its window's
        pages all there."""
        freed = self._dropped.get(slot, 0) * self.page_size
        return freed + self.window - 1 if freed else 0

    def _free_behind(self, slot: int, written: int) -> None:
        """Free the pages of ``slot`` wholly behind the window of a step at ``written - 1``
        (the earliest a next step may be): its tokens ``written - 1 - window`` and before."""
        behind = max(0, written - self.window) // self.page_size
        dropped = self._dropped[slot]
        if behind <= dropped:
            return
        owned = self._owned[slot]
        try:  # the pages are the slot's until its list says they are not
            self._free.extend(reversed(owned[dropped:behind]))
            owned[dropped:behind] = [NULL_PAGE] * (behind - dropped)
            self._table[slot, dropped:behind] = NULL_PAGE
            self.block_table[slot, dropped:behind].fill_(NULL_PAGE)
            self._dropped[slot] = behind
        except BaseException:
            self._settle()
            raise

    def _settle(self) -> None:
        """The cache as the slots' page lists say, after an admission, release or freeing
        an exception (a Ctrl-C) cut short: a slot that owns no pages holds no request, and
        every page no slot owns is free, once; each block-table row lists its slot's."""
        owned = self._owned
        for record in (self._capacity, self._written, self._dropped):
            for slot in [s for s in record if s not in owned]:
                del record[slot]
        held = {page for pages in owned.values() for page in pages}
        self._free = [p for p in range(self.pages, NULL_PAGE, -1) if p not in held]
        self._table.fill(NULL_PAGE)
        for slot, pages in owned.items():
            self._dropped[slot] = pages.count(NULL_PAGE)  # its first pages, freed
            self._table[slot, :len(pages)] = pages
        self.block_table.copy_(torch.from_numpy(self._table))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def pages_of(self, slot: int) -> list[int]:
        """The pages of the request in ``slot``, in order, a page freed behind the window
        as the null page (the list itself: read it)."""
        return self._owned.get(slot, [])

    @property
    def host_table(self) -> np.ndarray:
        """The block table's host copy ``[max_requests, max_pages]`` int32, as
        :meth:`pages_of` lists each slot's pages (read-only: a view)."""
        view = self._table.view()
        view.flags.writeable = False
        return view

    def owned(self) -> dict[int, list[int]]:
        """Request slot -> its pages (as :meth:`pages_of`), for the slots that hold a
        request."""
        return {slot: list(pages) for slot, pages in self._owned.items()}

    def _slot(self, slot, error: type[Exception] = ValueError) -> int:
        number = as_int(slot, "a request slot", error)
        if not 0 <= number < self.max_requests:
            raise error(f"request slot {slot!r} is not one of 0..{self.max_requests - 1}")
        return number

    def requests(self, slots, count: int) -> list[int]:
        """``slots`` as ints, checked (``BadBatch``): one distinct request slot for each of
        ``count`` requests, each holding a request."""
        if type(slots) is list and slots and set(map(type, slots)) == {int} and \
                min(slots) >= 0 and max(slots) < self.max_requests:
            slots = slots[:]  # every one a request slot's int: none to convert
        elif isinstance(slots, (set, frozenset, dict, str, bytes)) or not hasattr(
                slots, "__iter__") or (isinstance(slots, torch.Tensor) and slots.dim() != 1):
            raise BadBatch(f"slots must be ints in the requests' order (a list, a tuple, a "
                           f"1-D tensor), got {slots!r}")
        else:
            slots = [self._slot(s, BadBatch) for s in slots]
        distinct = set(slots)
        if len(slots) != count or len(distinct) != count:
            raise BadBatch(f"slots {slots} repeat a request slot or miss one: give one "
                           f"distinct request slot per request ({count} requests)")
        if self._capacity.keys() >= distinct:
            return slots
        free = [s for s in slots if s not in self._capacity]
        if free:
            raise BadBatch(f"request slots {free} hold no request: cache.admit(slot, "
                           "tokens) each first")
        return slots

    def check_prompts(self, slots: list[int], lens: list[int]) -> None:
        """Refuse (``BadBatch``) prompts longer than their slots were admitted for."""
        over = [(s, n) for s, n in zip(slots, lens, strict=True) if n > self._capacity[s]]
        if over:
            raise BadBatch(f"prompts longer than their slots were admitted for: (slot, "
                           f"tokens) {over}; admit them for their prompt plus new tokens")

    # -- what the kernels read -------------------------------------------------------
    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index``'s K and V: ``[pages + 1, page_size, kv_heads, head_dim]``."""
        if not 0 <= index < self.layers:
            raise IndexError(f"layer {index} of a cache of {self.layers} layers")
        return self.k[index], self.v[index]

    def slots(self, token_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Deprecated: :meth:`cache_loc` (a slot is a request slot)."""
        warnings.warn("PagedKVCache.slots() is deprecated: call cache_loc() (each token's "
                      "place in the cache)", DeprecationWarning, stacklevel=2)
        return self.cache_loc(token_slots, positions)

    def cache_loc(self, token_slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The place of each token in the cache (``page * page_size + offset``): token ``i`` is
        position ``positions[i]`` of the request in slot ``token_slots[i]``. On the device, no
        host synchronisation (graphs compute it per replay). A free request slot, a
        position past the request's pages, and any slot or position out of range
        (negative included: a pad) map to the null page, never to another request's."""
        return token_places(self.block_table, self.page_size, token_slots, positions)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def __repr__(self) -> str:
        return (f"PagedKVCache({self.layers} layers, {self.pages} pages of {self.page_size}"
                f" x {self.kv_heads} x {self.head_dim} {str(self.dtype).removeprefix('torch.')}"
                f", {self.max_requests} requests of up to {self.max_len} tokens, "
                f"{len(self._free)} pages free)")

