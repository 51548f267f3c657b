"""FlashAttention as an attention backend: FA4 (``flash_attn.cute``) when importable,
else FA2/FA3's ``flash_attn_varlen_func``.

The max lengths are the bucket size, host ints baked into the graph (never 1: a
one-token fast path breaks mixed batches); rows past the real tokens are zeroed after.
Its TMA loads read whole K/V tiles past a request's end (the next request's rows, or
padding), so k and v pass through ``guard_kv`` first: no request sees another's values.

The variant options: a window as FlashAttention's ``window_size=(window - 1, 0)``,
``softcap``, and sinks as FA4's ``learnable_sink`` (FA2/3 have no sinks: where only they
are installed the backend's options leave sinks out, so selection passes it over and a
layer with sinks is refused there, naming the backends that compute them).

FA4 runs where ``flash_attn.cute`` and the CuTe DSL it is written in (``cutlass`` and
``cuda.bindings``, which nvidia-cutlass-dsl brings) are importable: flash-attn 2.8.3's
wheel ships FA4's sources as ``flash_attn/cute`` without the DSL, and its FA2 runs there.
"""

from __future__ import annotations

import functools
import importlib.util

import torch

from graphcap.opsdb.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    guard_kv,
    zero_padding_rows,
)
from graphcap.opsdb.attention.variant import OPTIONS, PLAIN, Variant


def _found(module: str) -> bool:
    """Whether ``module`` can be found (its parent packages imported, not itself)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a parent package missing, or failing to import
        return False


@functools.cache
def _fa4() -> bool:
    """Whether FA4 can be imported: ``flash_attn.cute`` and its CuTe DSL (see above)."""
    return all(map(_found, ("flash_attn.cute", "cutlass", "cuda.bindings")))


@functools.cache
def _fa2_or_fa3_only() -> bool:
    """Whether FlashAttention is installed without a FA4 that can be imported."""
    return _found("flash_attn") and not _fa4()


def _varlen_func():
    if _fa4():
        from flash_attn.cute import flash_attn_varlen_func

        return flash_attn_varlen_func, True
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func, False


class FlashAttention(AttentionBackend):
    name = "flash_attn"
    devices = ("cuda",)
    requires = ("flash_attn",)
    dtypes = (torch.float16, torch.bfloat16)

    @property
    def options(self) -> frozenset[str]:
        """FA4's (also where FlashAttention is not installed); FA2/3 compute the window
        and softcap only."""
        return frozenset({"window", "softcap"}) if _fa2_or_fa3_only() else frozenset(OPTIONS)

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        fn, is_fa4 = _varlen_func()  # sinks reach FA4 only (run_attention refuses by options)
        k, v = guard_kv(k, v, meta)
        cu, n = meta.cu_seqlens, meta.num_tokens
        kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True, softmax_scale=scale)
        if variant.window:  # keys i - window + 1 .. i
            kwargs["window_size"] = (variant.window - 1, 0)
        if variant.softcap:
            kwargs["softcap"] = variant.softcap
        if variant.sinks is not None:
            kwargs["learnable_sink"] = variant.sinks
        if is_fa4:
            result = fn(q, k, v, max_seqlen_q=n, max_seqlen_k=n, num_splits=1, **kwargs)
        else:  # at max_seqlen_q 1, FA2 reads one query row a request (the sentinels' too)
            result = fn(q, k, v, max_seqlen_q=max(n, 2), max_seqlen_k=n, **kwargs)
        out.copy_(result[0] if isinstance(result, tuple) else result)
        zero_padding_rows(out, meta)
