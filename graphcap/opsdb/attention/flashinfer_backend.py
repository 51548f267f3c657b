"""FlashInfer's ragged prefill wrapper as an attention backend.

``plan()`` runs on the host in ``update`` with CPU int32 indptrs, into a wrapper made with
``use_cuda_graph=True`` over static indptr buffers; ``run()`` is what the graph captures.
``run()`` insists that q holds exactly ``qo_indptr[-1]`` rows, so a synthetic last request
absorbs the padding rows (its output is zeroed afterwards), k and v pass through
``guard_kv`` first (its fa3 kernels read whole tiles past a request's end: the next
request's rows, or padding), and the request capacity is
the slot count plus that one. Re-planning before the previous plan's asynchronous copy
has run corrupts the metadata, so ``update`` waits on an event recorded after each plan.

A sliding window and soft-capped scores are plan-time options of FlashInfer's kernels
(``window_left``, ``logits_soft_cap``), so each (window, softcap) pair a model's layers use
gets a wrapper of its own in every shape, planned from the same offsets: the backend
learns the pairs from the first forward (a warm-up, outside any graph) and plans them all
in each ``update`` after. A windowed pair brings its windowless twin, the variant the op
runs for a shape no longer than the window. Attention sinks are no plan-time option: a
layer with sinks has the kernel return each row's log-sum-exp too and folds the sink
logits in after it (:func:`~graphcap.opsdb.attention.variant.add_sinks`).
"""

from __future__ import annotations

import math

import torch

from graphcap.opsdb.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    guard_kv,
    zero_padding_rows,
)
from graphcap.opsdb.attention.variant import (
    PLAIN,
    Variant,
    add_sinks,
    refuse_first_in_capture,
)
from graphcap.opsdb.spec import OpInputError

WORKSPACE_BYTES = 256 << 20  # graph mode can exceed the usual 128 MiB at large buckets


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    devices = ("cuda",)
    requires = ("flashinfer",)
    dtypes = (torch.float16, torch.bfloat16)
    options = frozenset({"window", "softcap", "sinks"})

    def __init__(self, heads: tuple[int, int, int] | None = None, dtype=None,
                 fa_backend: str = "fa3", scale: float | None = None):
        self.heads, self.dtype, self.fa_backend = heads, dtype, fa_backend
        self.scale = scale  # the softmax scale it plans with (None: 1 / sqrt(head dim))
        self.variants: list[tuple[int, float]] = [key(PLAIN)]  # the (window, softcap) pairs

    def metadata(self, num_tokens, num_slots, device):
        import flashinfer

        meta = super().metadata(num_tokens, num_slots, device)
        meta.indptr = torch.zeros(num_slots + 2, dtype=torch.int32, device=device)
        meta.indptr_host = torch.zeros(num_slots + 2, dtype=torch.int32)
        meta.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        meta.wrappers = {}  # (window, softcap) -> its wrapper, sharing the offsets
        meta.new_wrapper = lambda: flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            meta.workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=meta.indptr,
            kv_indptr_buf=meta.indptr, backend=self.fa_backend)
        meta.planned = None
        meta.plan_done = torch.cuda.Event()
        return meta

    def configure(self, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype,
                  scale: float | None = None) -> None:
        """Head layout, dtype and softmax scale, needed by plan(); set before the first
        update."""
        self.heads, self.dtype = (num_q_heads, num_kv_heads, head_dim), dtype
        self.scale = scale

    def plan(self, meta: AttentionMetadata) -> None:
        if self.heads is None:
            return  # planned lazily on the first forward, outside any graph
        hq, hk, d = self.heads
        ind = meta.indptr_host
        ind[: meta.num_slots + 1] = meta.cu_seqlens_host
        ind[meta.num_slots + 1] = meta.num_tokens  # the padding request
        meta.plan_done.synchronize()
        for window, softcap in self.variants:
            if (window, softcap) not in meta.wrappers:
                meta.wrappers[window, softcap] = meta.new_wrapper()
            meta.wrappers[window, softcap].plan(
                ind, ind, hq, hk, d, causal=True, window_left=window - 1,
                logits_soft_cap=softcap, q_data_type=self.dtype, kv_data_type=self.dtype,
                sm_scale=self.scale)
        meta.plan_done.record(torch.cuda.current_stream(meta.device))  # the copies'
        meta.planned = (hq, hk, d, self.dtype)

    def learn(self, variant: Variant) -> None:
        """Adds ``variant``'s pair (and a windowed one's windowless twin) to those every
        shape plans."""
        for pair in (key(variant), (0, variant.softcap)):
            if pair not in self.variants:
                self.variants.append(pair)

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        if meta.planned is None:
            self.configure(q.shape[1], k.shape[1], q.shape[2], q.dtype, scale)
            self.learn(variant)
            self.plan(meta)
        heads = (q.shape[1], k.shape[1], q.shape[2])
        if tuple(meta.planned[:3]) != heads:  # its work list is per planned head and tile
            raise OpInputError(
                f"attention backend {self.name!r} planned its kernels for (query heads, "
                f"key/value heads, head dim) {tuple(meta.planned[:3])} and this layer has "
                f"{heads}: FlashInfer fixes them when it plans (a head it did not plan is "
                "never computed), so one backend serves layers of one shape; pick another "
                "backend (triton, torch_masked) for a model whose layers differ")
        planned = self.scale if self.scale is not None else q.shape[2] ** -0.5
        if not math.isclose(scale, planned, rel_tol=1e-6):
            raise OpInputError(
                f"attention backend {self.name!r} planned its kernels with softmax scale "
                f"{planned:g} and this layer asks for {scale:g}: FlashInfer fixes the scale "
                "when it plans, so one backend serves layers of one scale; pick another "
                "backend (triton, torch_masked) for a model whose layers differ")
        if key(variant) not in meta.wrappers:
            refuse_first_in_capture(
                "FlashInfer prefill attention", variant, "Run the model once eagerly before "
                "capturing (graphcap.capture warms up first unless told not to), or use the "
                "triton backend")
            self.learn(variant)
            self.plan(meta)
        k, v = guard_kv(k, v, meta)
        wrapper = meta.wrappers[key(variant)]
        if variant.sinks is None:
            wrapper.run(q, k, v, out=out)
        else:
            _, lse = wrapper.run(q, k, v, out=out, return_lse=True)
            add_sinks(out, lse, variant.sinks)
        zero_padding_rows(out, meta)


def key(variant: Variant) -> tuple[int, float]:
    """The plan-time options of ``variant``: (window, softcap)."""
    return variant.window, variant.softcap
