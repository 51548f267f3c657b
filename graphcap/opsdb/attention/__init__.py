"""Attention: the ``graphcap::attention`` split op (prefill, among the new tokens) and its
backends (each says where it runs, and whether its metadata is static:
``AttentionBackend.static_metadata``); beside them the backends of attention over a paged
cache (:mod:`.paged`: decode steps and extends). One registry and one call picks either
kind: ``get_backend(name, device, ...)`` (prefill) and ``get_backend(name,
kind="decode", cache=cache)``; each plans on the host and runs its kernel in the graph.

The op takes a caller-allocated ``out`` and writes it (a split op's contract); the batch's
metadata comes from the forward context, prepared by the backend outside any graph.
"""

from __future__ import annotations

import torch

from graphcap.core.context import current_attention
from graphcap.errors import BackendUnavailable
from graphcap.opsdb import checks
from graphcap.opsdb.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    validate_seq_lens,
)
from graphcap.opsdb.attention.flash_attn_backend import FlashAttention
from graphcap.opsdb.attention.flashinfer_backend import FlashInferAttention
from graphcap.opsdb.attention.flashinfer_decode import FlashInferDecode
from graphcap.opsdb.attention.paged import DecodeBackend, OpsdbDecode
from graphcap.opsdb.attention.torch_backends import TorchMasked, TorchVarlen
from graphcap.opsdb.attention.triton_backend import TritonAttention
from graphcap.opsdb.attention.variant import OPTIONS, Variant, check_variant, refuse
from graphcap.opsdb.spec import register_op

BACKENDS: dict[str, type[AttentionBackend]] = {
    cls.name: cls
    for cls in (FlashAttention, FlashInferAttention, TritonAttention, TorchMasked, TorchVarlen)
}
DECODE_BACKENDS: dict[str, type[DecodeBackend]] = {
    cls.name: cls for cls in (OpsdbDecode, FlashInferDecode)
}


def get_backend(name: str | None = None, device="cpu", strategy: str | None = None,
                dtype: torch.dtype | None = None, *, kind: str = "prefill",
                cache=None, options=()) -> AttentionBackend | DecodeBackend:
    """An attention backend by name, or the best available on ``device`` for ``strategy``
    (and for q/k/v of ``dtype`` when given). ``options``: the :mod:`.variant` options a
    model's layers use, which the best one computes and a named one must
    (:func:`check_serves`). ``kind="decode"``: a backend of attention over ``cache``'s
    pages (a :class:`~graphcap.kv.PagedKVCache`), checked against it; None gives the
    default, ``graphcap::decode_attention``."""
    if kind == "decode":
        backend = _decode_backend(name, cache)
        check_serves(backend, options, cache=cache)
        return backend
    if kind != "prefill":
        raise ValueError(f"get_backend(kind={kind!r}): 'prefill' or 'decode'")
    device = torch.device(device)
    if name is not None:
        if not isinstance(name, str) or name not in BACKENDS:  # a list: no dict key
            raise BackendUnavailable(
                f"no attention backend {name!r}; choose one of {sorted(BACKENDS)}")
        backend = BACKENDS[name]()
        why = backend.unavailable(device)
        if why:
            raise BackendUnavailable(f"attention backend {name!r} {why}")
        if strategy:
            backend.check_strategy(strategy)
        check_serves(backend, options, device=device)
        return backend
    for cls in BACKENDS.values():
        backend = cls()
        if (backend.unavailable(device, interpreted=False) is None
                and backend.runs_under(strategy or "eager")
                and (dtype is None or dtype in backend.dtypes)
                and set(options) <= backend.options):
            return backend
    known = sorted({str(d).removeprefix("torch.") for cls in BACKENDS.values()
                    for d in cls.dtypes})
    advice = (f"; the backends take {', '.join(known)}: build the model in one of them"
              if dtype is not None and str(dtype).removeprefix("torch.") not in known
              else "")
    raise BackendUnavailable(f"no attention backend runs on {device} under {strategy}"
                             + (f" for {dtype}" if dtype is not None else "")
                             + (f" computing {', '.join(options)}" if options else "")
                             + advice)


def serving(options, device=None, *, cache=None) -> list[str]:
    """The backends that compute every one of ``options`` (:mod:`.variant` option names,
    e.g. a variant's ``used``) and run here: prefill's on ``device``, or with ``cache``
    decode's over it."""
    if cache is not None:
        backends = [cls() for cls in DECODE_BACKENDS.values()]
        return [b.name for b in backends
                if set(options) <= b.options and b.unavailable(cache) is None]
    backends = [cls() for cls in BACKENDS.values()]
    return [b.name for b in backends
            if set(options) <= b.options and b.unavailable(torch.device(device)) is None]


def check_serves(backend: AttentionBackend | DecodeBackend, options, *, device=None,
                 cache=None, whose: str = "the model's layers") -> None:
    """``BackendUnavailable`` where ``backend`` (prefill's on ``device``, or a decode
    backend over ``cache``) does not compute every one of ``options``, the :mod:`.variant`
    options ``whose`` layers declare (``graphcap_attention_options``): what the op would
    refuse at their first call, said before anything is built, naming the backends here
    that compute them. It reads what the backend says it computes (``options``, the
    table of ``graphcap ops``): no backend's package is imported."""
    if unknown := sorted(set(options) - set(OPTIONS)):
        raise ValueError(f"{whose} declare attention options {unknown}, which are none of "
                         f"{list(OPTIONS)}: declare only those")
    if set(options) <= backend.options:
        return
    what = "decode attention" if isinstance(backend, DecodeBackend) else "prefill attention"
    refuse(what, backend.name, backend.options, [o for o in OPTIONS if o in options],
           serving(options, device, cache=cache), whose=whose, error=BackendUnavailable)


def _decode_backend(name: str | None, cache) -> DecodeBackend:
    if cache is None:
        raise ValueError("get_backend(kind='decode') needs cache=: the paged cache its "
                         "kernel reads")
    if name is None:
        return OpsdbDecode()
    if name not in DECODE_BACKENDS:
        raise BackendUnavailable(f"no decode attention backend {name!r}; choose one of "
                                 f"{sorted(DECODE_BACKENDS)}")
    backend = DECODE_BACKENDS[name]()
    why = backend.unavailable(cache)
    if why:
        raise BackendUnavailable(f"decode attention {name!r} {why}")
    return backend


def check_attention(q, k, v, out, scale, window=0, softcap=0.0, sinks=None):
    op = "attention"
    checks.tensor(op, "q", q, ndim=3)
    check_variant(op, q, window, softcap, sinks)
    for name, t in (("k", k), ("v", v), ("out", out)):
        checks.tensor(op, name, t, ndim=3, dtypes=(q.dtype,), device=q.device)
    checks.same(op, "the shape", tuple(k.shape), tuple(v.shape), "k", "v")
    checks.same(op, "the shape", tuple(out.shape), tuple(q.shape), "out", "q")
    checks.writable(op, "out", out)
    checks.same(op, "the token count", k.shape[0], q.shape[0], "k", "q")
    checks.same(op, "the head dim", k.shape[2], q.shape[2], "k", "q")
    if k.shape[1] == 0 or q.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise checks.OpInputError(
            f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} "
            "key/value heads (GQA needs Hq % Hk == 0)")


def run_attention(q, k, v, out, scale, window=0, softcap=0.0, sinks=None):
    """The op's call: the kernel of the backend that prepared the forward's metadata."""
    meta = current_attention()
    meta.attended = True
    if q.shape[0] != meta.num_tokens:
        raise checks.OpInputError(
            f"attention: q has {q.shape[0]} tokens but the metadata was prepared for "
            f"{meta.num_tokens}; prepare metadata for this token count")
    backend = meta.backend
    backend.check_dtype(q.dtype)
    variant = Variant(window, softcap, sinks).binding(meta.num_tokens)
    if not variant.used:  # a backend written before the options takes six arguments
        backend.forward(q, k, v, out, meta, scale)
        return
    if not set(variant.used) <= backend.options:  # names the backends that would serve it
        refuse("prefill attention", backend.name, backend.options, variant.used,
               serving(variant.used, q.device))
    backend.forward(q, k, v, out, meta, scale, variant)


def static_metadata():
    """The forward's metadata when its backend runs on it from static buffers (the
    backends full capture allows), else None."""
    meta = current_attention()
    return meta if meta.backend.static_metadata else None


def reference_attention(q, k, v, out, scale, window=0, softcap=0.0, sinks=None):
    from graphcap.opsdb.reference import attention_varlen

    meta = current_attention()
    meta.attended = True
    out.copy_(attention_varlen(q, k, v, meta.cu_seqlens_host, scale, True, window, softcap,
                               sinks))


def _fake(q, k, v, out, scale, window=0, softcap=0.0, sinks=None):
    return None


ATTENTION = register_op(
    "graphcap::attention",
    "(Tensor q, Tensor k, Tensor v, Tensor(a!) out, float scale, int window=0, "
    "float softcap=0.0, Tensor? sinks=None) -> ()",
    reference=reference_attention, fake=_fake, split=True, check=check_attention,
    dispatch=run_attention, static_state=static_metadata,
    doc="causal prefill attention over packed requests, a sliding window, soft-capped "
        "scores and sink logits per layer; metadata from the forward context",
)

__all__ = ["ATTENTION", "BACKENDS", "DECODE_BACKENDS", "AttentionBackend",
           "AttentionMetadata", "DecodeBackend", "Variant", "check_serves", "serving",
           "get_backend", "reference_attention", "run_attention", "static_metadata",
           "validate_seq_lens"]
