"""The pre-norm decoder's two halves as opsdb ops, over tokens packed along dim 0.

Each takes the residual stream ``h`` [T, hidden] and returns ``h + half(norm(h))``, with
the norm fused into the matmul after it and the residual add into the matmul before it.
graphcap's reference decoders (:mod:`graphcap.models.decoder`) and the stock transformers
layers graphcap substitutes (:mod:`graphcap.hf.kernels`) run these same functions, so a
stock model on graphcap kernels launches what the reference decoder launches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcap.opsdb.attention import ATTENTION
from graphcap.opsdb.cached import CACHED_ATTENTION
from graphcap.opsdb.collective import ALL_REDUCE
from graphcap.opsdb.linear import LINEAR_RESIDUAL, RMS_NORM_LINEAR, RMS_NORM_SWIGLU
from graphcap.opsdb.moe import MOE_EXPERTS, MOE_TOPK_SOFTMAX
from graphcap.opsdb.norm import RMS_NORM
from graphcap.opsdb.qkv import QKV_NORM_ROPE


def residual_linear(x, weight, residual, bias=None, tp: str | None = None):
    """``residual + linear(x, weight, bias)``: one fused op without a bias. With ``tp``
    (a TP group's name) ``weight`` is this rank's rows of the input: the partial sums
    meet in an all-reduce, then the residual and the bias are added once."""
    if tp is not None:
        out = residual + ALL_REDUCE(F.linear(x, weight), tp)
        return out if bias is None else out + bias
    if bias is None:
        return LINEAR_RESIDUAL(x, weight, residual)
    return residual + F.linear(x, weight, bias)


def attention_inputs(h, positions, norm, eps, qkv, qkv_bias, q_norm, k_norm, qk_eps,
                     cos_sin, heads: int, kv_heads: int, head_dim: int):
    """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of the residual stream:
    ``rope(qk_norm(split(qkv(rms_norm(h)))))``. ``qkv`` [(heads + 2 kv_heads) * head_dim,
    hidden] is the fused q/k/v projection; ``q_norm``/``k_norm`` the per-head RMSNorm
    weights (Qwen3) or None; ``cos_sin`` the neox rotary cache [positions, rotary dims]
    read at ``positions`` [T]."""
    x = RMS_NORM_LINEAR(h, norm, eps, qkv, qkv_bias)
    return QKV_NORM_ROPE(x, positions, q_norm, k_norm, cos_sin, heads, kv_heads, head_dim,
                         qk_eps)


def attention_half(h, positions, norm, eps, qkv, qkv_bias, q_norm, k_norm, qk_eps,
                   cos_sin, heads: int, kv_heads: int, head_dim: int, scale: float, o,
                   o_bias=None, layer: int | None = None, tp: str | None = None):
    """``h + o(attention(q, k, v))`` of :func:`attention_inputs`, causal within each
    request of the forward context's metadata. With ``layer`` (the layer's index) and a
    K/V cache in the forward context (:class:`graphcap.kv.CacheBatch`), the layer's
    K/V are written to it first (``graphcap::cached_attention``); a decode step then
    attends over each row's cached tokens, a prefill among its new tokens. ``tp``: the
    heads are this rank's of a TP group, ``o`` its rows (:func:`residual_linear`)."""
    t = h.shape[0]
    q, k, v = attention_inputs(h, positions, norm, eps, qkv, qkv_bias, q_norm, k_norm,
                               qk_eps, cos_sin, heads, kv_heads, head_dim)
    out = torch.empty(t, heads, head_dim, dtype=h.dtype, device=h.device)
    if layer is None:
        ATTENTION(q, k, v, out, scale)
    else:  # the forward context's cache, if any, read at run time (also when compiled)
        CACHED_ATTENTION(q, k, v, out, scale, layer)
    return residual_linear(out.view(t, heads * head_dim), o, h, o_bias, tp)


def swiglu_half(h, norm, eps, gate_up, down, tp: str | None = None):
    """``h + down(silu(gate) * up)`` of ``rms_norm(h)``: ``gate_up`` [2I, hidden], the gate
    rows then the up rows (``tp``: this rank's columns of I, reduced after ``down``)."""
    return residual_linear(RMS_NORM_SWIGLU(h, norm, eps, gate_up), down, h, tp=tp)


def moe_half(h, norm, eps, router, top_k: int, renormalize: bool, w13, w2,
             tp: str | None = None):
    """``h +`` the top-k softmax-routed SwiGLU experts of ``rms_norm(h)``: ``router`` [E,
    hidden] (no bias), ``w13`` [E, 2I, hidden] (gate rows, then up rows), ``w2`` [E,
    hidden, I] (``tp``: this rank's columns of every expert's I, reduced after)."""
    x = RMS_NORM(h, norm, eps)
    weights, ids = MOE_TOPK_SOFTMAX(F.linear(x, router), top_k, renormalize)
    out = MOE_EXPERTS(x, w13, w2, weights, ids)
    return h + (out if tp is None else ALL_REDUCE(out, tp))
