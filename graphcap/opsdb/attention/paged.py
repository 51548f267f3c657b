"""Attention over a paged cache (a decode step, an extend: each token over its request's
cached tokens up to itself), its backends behind the same :func:`get_backend` as
prefill's (``kind="decode"``), with the same split: a plan on the host, a kernel in the
graph.

A backend's ``metadata(cache, tokens)`` makes one shape's plan (a row per token) once;
``plan.update(positions, slots)`` rewrites it on the host from the call's host values,
before each replay or eager run, outside any graph; ``backend.forward(q, k_cache,
v_cache, kv, out, scale)`` runs in the graph and reads the plan the forward's
:class:`~graphcap.kv.CacheBatch` carries (``kv.plan``). A backend whose kernel reads only
the cache batch's device tensors (the block table and lengths computed in the graph)
has nothing to plan.

- ``graphcap``: ``graphcap::decode_attention``, its kernel chosen per call from opsdb
  (Triton on CUDA, torch elsewhere); the default.
- ``flashinfer``: FlashInfer's paged decode (:mod:`.flashinfer_decode`), planned per call.
"""

from __future__ import annotations

from graphcap.kv.batch import CacheBatch
from graphcap.kv.paged import PagedKVCache
from graphcap.opsdb.attention.variant import OPTIONS, PLAIN, Variant, refuse
from graphcap.opsdb.decode import DECODE_ATTENTION


class DecodePlan:
    """One shape's plan: nothing to rewrite for a kernel that reads only the device
    (``on_host`` False: the caller need not gather the call's host values for it)."""

    on_host = False

    def __init__(self, backend: DecodeBackend, cache: PagedKVCache, tokens: int):
        self.backend, self.cache, self.tokens = backend, cache, tokens

    def update(self, positions, slots) -> None:
        """The call's tokens (host ints, or host tensors of them): token ``b`` is position
        ``positions[b]`` of the request in slot ``slots[b]``; the rest are pads."""


class DecodeBackend:
    """One way to attend over a paged cache; subclasses set ``name`` and ``forward``, and
    ``options``, the :mod:`.variant` options it computes."""

    name = "base"
    kind = "decode"
    options: frozenset[str] = frozenset()
    # Whether ``forward`` takes a decode step's new keys and values (``own``) and writes
    # them to the cache itself, in the same kernel (else ``graphcap::kv_write`` first).
    writes_own = False
    # Whether ``forward`` also takes ``rope`` (positions, q/k norm weights, cos/sin cache,
    # eps) with ``own``: ``q`` and ``k`` are then the projection's rows, which it
    # normalises and rotates itself (else ``graphcap::qkv_norm_rope`` first).
    rotates = False

    def unavailable(self, cache: PagedKVCache) -> str | None:
        """Why it cannot serve ``cache`` (device, dtype, head dim), or None."""
        return None

    def metadata(self, cache: PagedKVCache, tokens: int) -> DecodePlan:
        return DecodePlan(self, cache, tokens)

    def forward(self, q, k_cache, v_cache, kv: CacheBatch, out, scale: float,
                kernel: str | None = None, variant: Variant = PLAIN, own=None,
                rope=None) -> None:
        raise NotImplementedError


class OpsdbDecode(DecodeBackend):
    """``graphcap::decode_attention`` over the cache batch's block table and lengths;
    ``kernel`` names one of its kernels (the op's reference path passes ``"torch"``)."""

    name = "graphcap"
    options = frozenset(OPTIONS)
    writes_own = True
    # Its Triton kernel can rotate the projection's rows itself (one kernel fewer a
    # layer), but a decode step measured slower so on the H200 (qwen3-0.6b back to back:
    # 3.54 ms against 2.90 at batch 64, 0.862 against 0.833 at batch 1,
    # docs/results/2026-12-04-bench-decode-qwen3-0.6b-a7327c8-h200.json), so it takes
    # graphcap::qkv_norm_rope first.
    rotates = False

    def forward(self, q, k_cache, v_cache, kv, out, scale, kernel=None,
                variant: Variant = PLAIN, own=None, rope=None) -> None:
        k, v = own if own is not None else (None, None)
        DECODE_ATTENTION(q, k_cache, v_cache, kv.block_table, kv.seq_lens, out, scale,
                         variant.window, variant.softcap, variant.sinks, k, v,
                         None if own is None else kv.cache_loc, *(rope or ()),
                         kernel=kernel)


DEFAULT = OpsdbDecode()


def backend_of(kv: CacheBatch) -> DecodeBackend:
    """The backend that planned ``kv`` (the default for a cache batch made without a
    plan)."""
    return DEFAULT if kv.plan is None else kv.plan.backend


def attend_pages(q, k_cache, v_cache, kv: CacheBatch, out, scale: float,
                 kernel: str | None = None, variant: Variant = PLAIN, own=None,
                 rope=None) -> None:
    """Each row of ``q`` over its request's pages: the kernel of :func:`backend_of`
    ``kv``, which must compute the layer's ``variant``. ``own``: a decode step's new (k,
    v), which that backend writes at ``kv.cache_loc`` itself (``writes_own``); ``rope``:
    what it normalises and rotates ``q`` and that ``k`` by first (``rotates``)."""
    backend = backend_of(kv)
    if variant.used:
        refuse("decode attention", backend.name, backend.options, variant.used,
               [DEFAULT.name] if set(variant.used) <= DEFAULT.options else [])
    if rope is None:  # backends that take no rope keep their signature
        backend.forward(q, k_cache, v_cache, kv, out, scale, kernel, variant, own=own)
    else:
        backend.forward(q, k_cache, v_cache, kv, out, scale, kernel, variant, own=own,
                        rope=rope)
