"""The pre-norm decoder's two halves as opsdb ops, over tokens packed along dim 0.

Each takes the residual stream ``h`` [T, hidden] and returns ``h + half(norm(h))``, with
the norm fused into the matmul after it and the residual add into the matmul before it.
graphcap's reference decoders (:mod:`graphcap.models.decoder`) and the stock transformers
layers graphcap substitutes (:mod:`graphcap.hf.kernels`) run these same functions, so a
stock model on graphcap kernels launches what the reference decoder launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from graphcap.opsdb.attention import ATTENTION
from graphcap.opsdb.cached import QKV_CACHED_ATTENTION
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


@dataclass(frozen=True)
class AttentionLayer:
    """What an attention layer is, beside its weights: ``heads`` query heads and
    ``kv_heads`` key/value heads of ``head_dim``, the softmax ``scale``, the epsilons of
    its input RMSNorm (``eps``) and of its per-head q/k norms (``qk_eps``), its index in a
    K/V cache (``layer``; None: it keeps none), its TP group (``tp``: the heads are
    this rank's, ``o`` its rows), and its sliding ``window`` and score ``softcap`` (0:
    none; :mod:`graphcap.opsdb.attention.variant`)."""

    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    eps: float
    qk_eps: float
    layer: int | None = None
    tp: str | None = None
    window: int = 0
    softcap: float = 0.0


@dataclass
class AttentionWeights:
    """An attention layer's tensors, read at each call (a weight replaced between calls
    is seen): the input RMSNorm ``norm``; the fused q/k/v projection ``qkv``
    ``[(heads + 2 kv_heads) * head_dim, hidden]`` and its bias; the per-head RMSNorm
    weights ``q_norm``/``k_norm`` (Qwen3) or None; the output projection ``o`` and its
    bias; the neox rotary cache ``cos_sin`` ``[positions, rotary dims]``; the learned
    sink logit of each query head ``sinks`` ``[heads]`` (gpt-oss) or None."""

    norm: torch.Tensor
    qkv: torch.Tensor
    o: torch.Tensor
    cos_sin: torch.Tensor
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None


def attention_inputs(h, positions, w: AttentionWeights, a: AttentionLayer):
    """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] of the residual stream:
    ``rope(qk_norm(split(qkv(rms_norm(h)))))``, the rotary cache read at ``positions``
    [T]."""
    x = RMS_NORM_LINEAR(h, w.norm, a.eps, w.qkv, w.qkv_bias)
    return QKV_NORM_ROPE(x, positions, w.q_norm, w.k_norm, w.cos_sin, a.heads, a.kv_heads,
                         a.head_dim, a.qk_eps)


def attention_half(h, positions, w: AttentionWeights, a: AttentionLayer):
    """``h + o(attention(q, k, v))`` of :func:`attention_inputs`, causal within each
    request of the forward context's metadata. With a ``layer`` index and a K/V cache in
    the forward context (:class:`graphcap.kv.CacheBatch`), the layer's K/V are written to
    it first (``graphcap::qkv_cached_attention``, from the projection's rows); a decode
    step then attends over each row's cached tokens, a prefill among its new tokens."""
    t = h.shape[0]
    out = torch.empty(t, a.heads, a.head_dim, dtype=h.dtype, device=h.device)
    if a.layer is None:
        q, k, v = attention_inputs(h, positions, w, a)
        ATTENTION(q, k, v, out, a.scale, a.window, a.softcap, w.sinks)
    else:  # the forward context's cache, if any, read at run time (also when compiled)
        x = RMS_NORM_LINEAR(h, w.norm, a.eps, w.qkv, w.qkv_bias)
        QKV_CACHED_ATTENTION(x, positions, w.q_norm, w.k_norm, w.cos_sin, out, a.heads,
                             a.kv_heads, a.head_dim, a.qk_eps, a.scale, a.layer, a.window,
                             a.softcap, w.sinks)
    return residual_linear(out.view(t, a.heads * a.head_dim), w.o, h, w.o_bias, a.tp)


def swiglu_half(h, norm, eps, gate_up, down, tp: str | None = None):
    """``h + down(silu(gate) * up)`` of ``rms_norm(h)``: ``gate_up`` [2I, hidden], the gate
    rows then the up rows (``tp``: this rank's columns of I, reduced after ``down``)."""
    return residual_linear(RMS_NORM_SWIGLU(h, norm, eps, gate_up), down, h, tp=tp)


def moe_half(h, norm, eps, router, top_k: int, renormalize: bool, w13, w2,
             tp: str | None = None, router_bias=None, b13=None, b2=None,
             alpha: float = 0.0, limit: float = 0.0, interleaved: bool = False,
             w13_scale=None, w2_scale=None):
    """``h +`` the top-k softmax-routed gated experts of ``rms_norm(h)``: ``router`` [E,
    hidden] and its bias, ``w13`` [E, 2I, hidden] (gate rows, then up rows) and its bias
    ``b13`` [E, 2I], ``w2`` [E, hidden, I] and its bias ``b2`` [E, hidden]; SwiGLU, or
    gpt-oss's clamped GLU with ``alpha`` > 0 (``tp``: this rank's columns of every
    expert's I, reduced after; ``b2`` then only on one rank, zeros on the others);
    ``interleaved``: gate and up alternate along ``w13``'s rows and ``b13`` (gpt-oss's
    checkpoints), and the weights may be transposed views; with ``w13_scale`` and
    ``w2_scale``, MXFP4 experts (``graphcap::moe_experts``)."""
    x = RMS_NORM(h, norm, eps)
    weights, ids = MOE_TOPK_SOFTMAX(F.linear(x, router, router_bias), top_k, renormalize)
    out = MOE_EXPERTS(x, w13, w2, weights, ids, b13, b2, alpha, limit, interleaved,
                      w13_scale, w2_scale)
    return h + (out if tp is None else ALL_REDUCE(out, tp))
