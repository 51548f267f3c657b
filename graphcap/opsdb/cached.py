"""``graphcap::cached_attention``: attention that keeps layer ``layer``'s K/V in the
forward's paged cache when the forward context has one (:class:`graphcap.kv.CacheBatch`).

Without a cache it is ``graphcap::attention`` (prefill among the new tokens). With one,
the tokens' K/V are written at their places in the cache first (``graphcap::kv_write``; in
a decode step the default backend's kernel writes them itself, in the same launch); then a
decode step or an extend attends over each token's cached tokens up to itself (a row
per token, through the decode attention backend that planned the cache batch, by default
``graphcap::decode_attention``), a prefill from position 0 among its
new tokens (``graphcap::attention``). The cache and its per-batch tensors come from the forward
context, not the arguments, so a torch.compiled forward (tc_piecewise) sees one opaque
split op, traced once, and the cache is read at run time, as prefill's metadata is.
Decode's state lives on the device in the shape's static tensors: the op captures (its
``static_state`` is the ``CacheBatch``). ``window``, ``softcap`` and ``sinks`` are the
layer's :mod:`~graphcap.opsdb.attention.variant`, passed to whichever attention runs.

``graphcap::qkv_cached_attention`` is the same from the fused q/k/v projection's rows:
``graphcap::qkv_norm_rope`` (split, qk-norm, rotary), then ``cached_attention``. In a
decode step whose backend rotates the rows itself (its ``rotates``) both run as one
kernel. The default backend's Triton kernel can, but does not by default (measured
slower: :class:`~graphcap.opsdb.attention.paged.OpsdbDecode`). Models built from
:mod:`graphcap.models.blocks` call it.
"""

from __future__ import annotations

from graphcap.core.context import attention_if_any, current_kv
from graphcap.errors import UnsupportedModel
from graphcap.opsdb import checks
from graphcap.opsdb.attention import (
    check_attention,
    reference_attention,
    run_attention,
    static_metadata,
)
from graphcap.opsdb.attention.paged import attend_pages, backend_of
from graphcap.opsdb.attention.variant import Variant
from graphcap.opsdb.kv import KV_WRITE
from graphcap.opsdb.qkv import QKV_NORM_ROPE, check_qkv, heads_of
from graphcap.opsdb.spec import register_op

OP = "cached_attention"
QKV_OP = "qkv_cached_attention"


def _layer_of(kv, layer: int, op: str, window: int, k):
    """Layer ``layer``'s (k_cache, v_cache), noted as written. A layer that attends
    further back than the cache keeps pages for (full attention, or a longer window) is
    refused: it would read freed pages as its request's. So are keys ``k`` of another
    dtype than the cache's, before any is written: a prefill would round them into the
    cache and every later step over its pages fail."""
    if not 0 <= layer < kv.cache.layers:
        raise UnsupportedModel(
            f"{op}: layer {layer} of a K/V cache of {kv.cache.layers} layers; make the "
            "cache with as many layers as the model, and pass each attention its own index")
    if k.dtype != kv.cache.dtype:
        raise UnsupportedModel(
            f"{op}: layer {layer}'s keys and values are {k.dtype}, but the K/V cache "
            f"holds {kv.cache.dtype}: build the cache in the model's dtype "
            f"(PagedKVCache(..., dtype={k.dtype}))")
    kept = kv.cache.window
    if kept and not 0 < window <= kept:
        reach = f"a window of {window}" if window else "full attention"
        raise UnsupportedModel(
            f"{op}: layer {layer} attends with {reach}, but the K/V cache frees pages "
            f"behind a window of {kept} (the model's graphcap_kv_window, or the cache's "
            "window=): declare the longest window of its layers, or 0 where any layer "
            "attends to every token (graphcap.kv.paged.longest_window)")
    kv.written.add(layer)
    return kv.cache.layer(layer)


def _run(q, k, v, out, scale, layer, window, softcap, sinks, attention, kernel=None
         ) -> None:
    kv = current_kv()
    if kv is None:
        attention(q, k, v, out, scale, window, softcap, sinks)
        return
    k_cache, v_cache = _layer_of(kv, layer, OP, window, k)
    variant = Variant(window, softcap, sinks)
    if kv.decode and backend_of(kv).writes_own:  # the write in the attention kernel
        attend_pages(q, k_cache, v_cache, kv, out, scale, kernel, variant, own=(k, v))
        return
    KV_WRITE(k, v, k_cache, v_cache, kv.cache_loc, kernel=kernel)
    if kv.reads_pages:  # each token's own request's pages: requests stay apart
        meta = attention_if_any()
        if meta is not None:  # an extend: packed requests, attended apart
            meta.attended = True
        attend_pages(q, k_cache, v_cache, kv, out, scale, kernel, variant)  # kv.plan's
    else:
        attention(q, k, v, out, scale, window, softcap, sinks)


def _dispatch(q, k, v, out, scale, layer, window=0, softcap=0.0, sinks=None):
    _run(q, k, v, out, scale, layer, window, softcap, sinks, run_attention)


def _reference_of(q, k, v, out, scale, layer, window=0, softcap=0.0, sinks=None):
    _run(q, k, v, out, scale, layer, window, softcap, sinks, reference_attention,
         kernel="torch")


def _check(q, k, v, out, scale, layer, window=0, softcap=0.0, sinks=None):
    check_attention(q, k, v, out, scale, window, softcap, sinks)
    if layer < 0:
        raise checks.OpInputError(f"{OP}: layer must be >= 0, got {layer}")


def _state():
    """The static state of attention over the pages (the ``CacheBatch``), else prefill
    attention's."""
    kv = current_kv()
    if kv is not None and kv.reads_pages:
        return kv
    return static_metadata()


def _fake(q, k, v, out, scale, layer, window=0, softcap=0.0, sinks=None):
    return None


def _run_rows(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
              num_kv_heads, head_size, eps, scale, layer, window, softcap, sinks, attention,
              kernel=None) -> None:
    kv = current_kv()
    if kv is not None and kv.decode and backend_of(kv).rotates:  # one kernel
        q, k, v = heads_of(qkv, num_heads, num_kv_heads, head_size)
        k_cache, v_cache = _layer_of(kv, layer, QKV_OP, window, k)
        attend_pages(q, k_cache, v_cache, kv, out, scale, kernel,
                     Variant(window, softcap, sinks), own=(k, v),
                     rope=(positions, q_weight, k_weight, cos_sin_cache, eps))
        return
    # qkv_norm_rope's kernel, not the op: this op's check already ran check_qkv
    args = (qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads, num_kv_heads,
            head_size, eps)
    q, k, v = QKV_NORM_ROPE.kernel_for(qkv.device, kernel, qkv.dtype, args)(*args)
    _run(q, k, v, out, scale, layer, window, softcap, sinks, attention, kernel)


def _rows_dispatch(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
                   num_kv_heads, head_size, eps, scale, layer, window=0, softcap=0.0,
                   sinks=None):
    _run_rows(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
              num_kv_heads, head_size, eps, scale, layer, window, softcap, sinks,
              run_attention)


def _rows_reference(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
                    num_kv_heads, head_size, eps, scale, layer, window=0, softcap=0.0,
                    sinks=None):
    _run_rows(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
              num_kv_heads, head_size, eps, scale, layer, window, softcap, sinks,
              reference_attention, kernel="torch")


def _rows_check(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
                num_kv_heads, head_size, eps, scale, layer, window=0, softcap=0.0,
                sinks=None):
    check_qkv(qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads, num_kv_heads,
              head_size, eps)
    _check(*heads_of(qkv, num_heads, num_kv_heads, head_size), out, scale, layer, window,
           softcap, sinks)


def _rows_fake(qkv, positions, q_weight, k_weight, cos_sin_cache, out, num_heads,
               num_kv_heads, head_size, eps, scale, layer, window=0, softcap=0.0,
               sinks=None):
    return None


CACHED_ATTENTION = register_op(
    f"graphcap::{OP}",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float scale, int layer, int window=0, "
    "float softcap=0.0, Tensor? sinks=None) -> ()",
    reference=_reference_of, fake=_fake, split=True, check=_check, dispatch=_dispatch,
    static_state=_state,
    doc="attention keeping layer's K/V in the forward context's paged cache (decode over "
        "it, prefill among the new tokens); without a cache, graphcap::attention",
)


QKV_CACHED_ATTENTION = register_op(
    f"graphcap::{QKV_OP}",
    "(Tensor qkv, Tensor positions, Tensor? q_weight, Tensor? k_weight, "
    "Tensor cos_sin_cache, Tensor(a!) out, int num_heads, int num_kv_heads, int head_size, "
    "float eps, float scale, int layer, int window=0, float softcap=0.0, "
    "Tensor? sinks=None) -> ()",
    reference=_rows_reference, fake=_rows_fake, split=True, check=_rows_check,
    dispatch=_rows_dispatch, static_state=_state,
    doc="graphcap::qkv_norm_rope then graphcap::cached_attention, from the fused q/k/v "
        "projection's rows; one kernel in a decode step whose backend rotates",
)
