"""FlashInfer's paged decode kernel as a decode attention backend (``flashinfer``):
``DecodeInputs(cache, attention="flashinfer")``, or ``decode_attention="flashinfer"`` for
any paged kind of input.

FlashInfer plans a batch on the host: each row's pages (``indptr``, ``indices``) and the
tokens of its last page. Each shape's plan (:class:`FlashInferPlan`) makes a wrapper with
``use_cuda_graph=True`` over static device buffers sized for the shape, so ``run()`` is
what a graph captures and ``update()`` rewrites those buffers before each replay, outside
the graph, from the call's host positions and request slots and the block table's host
copy (:func:`page_lists`; no device read). Every layer shares the call's plan. A padded
row is planned as one token on the null page and its output zeroed in the graph (its
length is 0 on the device), so NaN there reaches no row. What it supports: CUDA, float16
and bfloat16, head dims 64, 128 and 256, the cache's NHD layout ``[pages, page_size,
kv_heads, head_dim]``.

A sliding window and soft-capped scores are plan-time options of FlashInfer's kernels, so
each (window, softcap) pair a model's layers use gets a wrapper of its own in every shape,
planned from the same call: a windowed pair's rows are planned over the pages that hold
their window only (the read per step is bounded by the window, and pages released behind
it are never named), FlashInfer's ``window_left`` masking the rest of the first one. The
backend learns the pairs from the first run (a warm-up, outside any graph). A layer with
attention sinks has the kernel return each row's log-sum-exp too and folds the sink
logits in after it (:func:`~graphcap.opsdb.attention.variant.add_sinks`).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from graphcap.core.checks import staged
from graphcap.errors import BackendUnavailable, OpInputError
from graphcap.kv.paged import NULL_PAGE, PagedKVCache
from graphcap.opsdb.attention.paged import DecodeBackend, DecodePlan
from graphcap.opsdb.attention.variant import (
    PLAIN,
    Variant,
    add_sinks,
    refuse_first_in_capture,
)
from graphcap.opsdb.spec import unavailable

NAME = "flashinfer"
DTYPES = (torch.float16, torch.bfloat16)
HEAD_DIMS = (64, 128, 256)
# Query heads per key/value head that FlashInfer's decode kernel is built for; other
# groups (Qwen2.5-7B's 7) run its prefill kernel with one query a row (tensor cores).
DECODE_GROUPS = (1, 2, 3, 4, 8)
WORKSPACE_BYTES = 128 << 20


def why_not(cache: PagedKVCache) -> str | None:
    """Why FlashInfer's decode cannot serve ``cache``, or None."""
    why = unavailable(cache.device, ("cuda",), ("flashinfer",), interpreted=False)
    if why is None and cache.k.dtype not in DTYPES:
        why = f"takes float16 or bfloat16 caches, not {cache.k.dtype}"
    if why is None and cache.head_dim not in HEAD_DIMS:
        why = f"takes head dims {', '.join(map(str, HEAD_DIMS))}, not {cache.head_dim}"
    return why


def page_lists(table: np.ndarray, page_size: int, positions, slots, rows: int,
               window: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's page lists of a step of ``rows`` rows over a block table's host copy
    ``table``: ``indptr`` ``[rows + 1]``, ``indices`` (each row's pages in order) and the
    tokens of each row's last page, all int32. Row ``b`` < ``len(positions)`` attends
    from position ``positions[b]`` of the request in slot ``slots[b]`` over its pages up
    to that position (those that hold its window only, where ``window``); each row after
    them (a pad) is one token of the null page. No loop over the rows and no work per
    unlisted column of the table: with their staging as tensors, the lists of 64 rows of
    1024 tokens take a third to a half of a loop's time on the CI host (35-56 against
    104-172 us), most of it saved on converting Python lists."""
    positions = np.asarray(positions, dtype=np.int64)
    slots = np.asarray(slots, dtype=np.int64)
    count = len(positions)
    if len(slots) != count or count > rows:
        raise OpInputError(f"FlashInfer's page lists of {rows} rows take as many positions "
                           f"as request slots, at most {rows}: got {count} and {len(slots)}")
    firsts = np.maximum(positions - window + 1, 0) // page_size if window else 0
    pages = np.ones(rows, dtype=np.int64)  # a pad: one page, the null page
    pages[:count] = positions // page_size + 1 - firsts
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(pages, out=indptr[1:])
    # Each listed page's place in the flat table: its row's first, then one more a page.
    live = indptr[count]
    place = np.repeat(slots * table.shape[1] + firsts - indptr[:count], pages[:count])
    place += np.arange(live)
    indices = np.full(indptr[-1], NULL_PAGE, dtype=np.int32)
    indices[:live] = table.reshape(-1).take(place)
    last = np.ones(rows, dtype=np.int32)
    last[:count] = positions % page_size + 1
    return indptr.astype(np.int32), indices, last


class FlashInferDecode(DecodeBackend):
    """What a model's shapes share: the query heads and scale the first run saw (so a
    shape captured without a warm-up of its own never plans inside its capture) and the
    float workspace (the kernels' scratch: replays run one at a time)."""

    name = NAME
    options = frozenset({"window", "softcap", "sinks"})

    def __init__(self):
        self.heads: tuple[int, float] | None = None
        self.workspace: torch.Tensor | None = None
        self.variants: list[tuple[int, float]] = [(0, 0.0)]  # the (window, softcap) pairs

    def unavailable(self, cache: PagedKVCache) -> str | None:
        return why_not(cache)

    def metadata(self, cache: PagedKVCache, tokens: int) -> FlashInferPlan:
        return FlashInferPlan(self, cache, tokens)

    def forward(self, q, k_cache, v_cache, kv, out, scale, kernel=None,
                variant: Variant = PLAIN, own=None) -> None:
        """``out`` = each row's attention over its planned pages; pads (length 0) zero."""
        plan, pair = kv.plan, (variant.window, variant.softcap)
        if self.heads is None:  # the first run of any shape, eager (a warm-up)
            self.heads = (q.shape[1], scale)
        if q.shape[1] != self.heads[0] or not math.isclose(scale, self.heads[1],
                                                           rel_tol=1e-6):
            raise OpInputError(
                f"decode attention {NAME!r} planned its kernels for {self.heads[0]} query "
                f"heads at softmax scale {self.heads[1]:g}, and this layer has {q.shape[1]} "
                f"at {scale:g}: FlashInfer fixes both when it plans, so it serves models "
                "whose layers agree; use decode attention 'graphcap' for this one")
        if pair not in self.variants:
            refuse_first_in_capture(
                "FlashInfer decode attention", variant, "Run a decode step eagerly before "
                "capturing, or use decode attention 'graphcap'")
            self.variants.append(pair)
        if pair not in plan.wrappers:  # a plan updated before the pair was known
            plan.replan()
        if variant.sinks is None:
            plan.wrappers[pair].run(q, (k_cache, v_cache), out=out)
        else:
            _, lse = plan.wrappers[pair].run(q, (k_cache, v_cache), out=out, return_lse=True)
            add_sinks(out, lse, variant.sinks)
        zero_pads(out, kv.seq_lens)


def zero_pads(out: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """Each row of ``out`` ``[rows, heads, head_dim]`` whose length is 0 (a pad) zeroed in
    place, NaN included: two kernels a layer (the mask and the fill)."""
    out.masked_fill_((seq_lens <= 0)[:, None, None], 0.0)


class FlashInferPlan(DecodePlan):
    """The plan and wrapper of one shape of ``tokens`` tokens (a row each) over ``cache``."""

    on_host = True

    def __init__(self, backend: FlashInferDecode, cache: PagedKVCache, tokens: int):
        why = why_not(cache)
        if why:
            raise BackendUnavailable(f"decode attention {NAME!r} {why}")
        import flashinfer

        super().__init__(backend, cache, tokens)
        if backend.workspace is None:
            backend.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8,
                                            device=cache.device)
        self._flashinfer = flashinfer
        self.wrappers: dict[tuple[int, float], object] = {}  # planned, per (window, softcap)
        self._step: tuple[np.ndarray, np.ndarray] = (np.zeros(0, np.int64),) * 2
        # FlashInfer's plan writes its schedule into the wrapper's pinned host workspace and
        # copies it to the device asynchronously: the next plan waits for that copy, or it
        # would rewrite the schedule a queued replay is yet to receive (another batch's).
        self._copied = torch.cuda.Event()

    def _wrapper(self, pair: tuple[int, float]):
        """The wrapper of ``pair``, over static page buffers of its own (a windowed pair
        plans fewer pages)."""
        if pair not in self.wrappers:
            device, tokens = self.cache.device, self.tokens
            group = self.backend.heads[0] // self.cache.kv_heads
            self.wrappers[pair] = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self.backend.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=group not in DECODE_GROUPS,
                paged_kv_indptr_buffer=torch.zeros(tokens + 1, dtype=torch.int32,
                                                   device=device),
                paged_kv_indices_buffer=torch.zeros(
                    tokens * self.cache.block_table.shape[1], dtype=torch.int32,
                    device=device),
                paged_kv_last_page_len_buffer=torch.ones(tokens, dtype=torch.int32,
                                                         device=device))
        return self.wrappers[pair]

    def update(self, positions, slots) -> None:
        self._step = tuple(np.asarray(v.tolist() if isinstance(v, torch.Tensor) else v,
                                      dtype=np.int64) for v in (positions, slots))
        if self.backend.heads is not None:
            self.replan()

    def replan(self) -> None:
        """Plans every pair the backend knows for the last update's tokens, once the last
        plan's copies have left the host workspace."""
        self._copied.synchronize()
        for pair in self.backend.variants:
            self._plan(pair)
        self._copied.record(torch.cuda.current_stream(self.cache.device))  # the copies'

    def _plan(self, pair: tuple[int, float]) -> None:
        cache, (positions, slots) = self.cache, self._step
        size, (window, softcap) = cache.page_size, pair
        indptr, indices, last = page_lists(cache.host_table, size, positions, slots,
                                           self.tokens, window)
        hq, scale = self.backend.heads
        device = cache.device
        # The pages go to the device first: FlashInfer copies host page indices into its
        # buffer with a blocking copy, which waits for every step queued before this one.
        pages = staged(indices, torch.int32, device).to(device, non_blocking=True)
        self._wrapper(pair).plan(
            staged(indptr, torch.int32, device), pages,
            staged(last, torch.int32, device), hq, cache.kv_heads, cache.head_dim, size,
            window_left=window - 1, logits_soft_cap=softcap, q_data_type=cache.k.dtype,
            kv_data_type=cache.k.dtype, sm_scale=scale)
