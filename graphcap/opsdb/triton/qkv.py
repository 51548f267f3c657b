"""One kernel from the fused QKV projection to attention's inputs: split, per-head RMSNorm
of q and k (Qwen3; optional), neox rotary of q and k, and contiguous q, k, v.

Unfused, a layer runs six kernels here (two reshape copies, two norms, rotary, a copy of
v); at 16 tokens each is launch-bound, so the six cost what one does.

Contract (see :func:`graphcap.opsdb.qkv.reference`): ``qkv`` [T, (H + 2 Hk) * D] with a
contiguous last dim and any row stride; ``positions`` [T] int32/int64; ``q_weight`` and
``k_weight`` [D] or both None; ``cos_sin_cache`` [max_position, rot] (cos then sin,
rot even, <= D). Returns fresh contiguous q [T, H, D], k [T, Hk, D], v [T, Hk, D]. Like
the unfused ops, normalised values are rounded to the input dtype before they rotate, so
both paths give the same bits in the common case. One program per (token, head); grid
from host shapes only, ``T == 0`` launches nothing: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import pdl_args, pdl_start


@triton.jit
def _normed(row_ptr, w_ptr, d, mask, rstd, HAS_NORM: tl.constexpr):
    """Elements ``d`` of a head, normalised and rounded as the unfused norm stores them."""
    x = tl.load(row_ptr + d, mask=mask, other=0.0)
    if HAS_NORM:
        w = tl.load(w_ptr + d, mask=mask, other=0.0).to(tl.float32)
        x = (x.to(tl.float32) * rstd * w).to(row_ptr.dtype.element_ty)
    return x.to(tl.float32)


@triton.jit
def _qkv_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cache_ptr, q_ptr, k_ptr, v_ptr,
                qkv_stride, pos_stride, cache_stride, n_q, n_k, head_size, half, eps,
                HAS_NORM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    row = qkv_ptr + t * qkv_stride + h * head_size
    d = tl.arange(0, BLOCK_D)
    dmask = d < head_size
    # Variables assigned in both branches of a runtime `if` must keep one type: the value
    # branch's names are its own.
    if h >= n_q + n_k:  # a value head: copied as it is
        vals = tl.load(row + d, mask=dmask, other=0.0)
        tl.store(v_ptr + (t * n_k + h - n_q - n_k) * head_size + d, vals, mask=dmask)
    else:
        if h < n_q:
            w_ptr = qw_ptr
            dst = q_ptr + (t * n_q + h) * head_size
        else:
            w_ptr = kw_ptr
            dst = k_ptr + (t * n_k + h - n_q) * head_size
        rstd = 1.0
        if HAS_NORM:
            raw = tl.load(row + d, mask=dmask, other=0.0).to(tl.float32)
            rstd = 1.0 / tl.sqrt(tl.sum(raw * raw, axis=0) / head_size + eps)
        rot = 2 * half
        first = d < half
        rotated = d < rot
        partner = tl.where(first, d + half, d - half)
        x = _normed(row, w_ptr, d, dmask, rstd, HAS_NORM)
        xp = _normed(row, w_ptr, partner, rotated, rstd, HAS_NORM)
        pos = tl.load(pos_ptr + t * pos_stride).to(tl.int64)
        j = tl.where(first, d, d - half)
        cache_row = cache_ptr + pos * cache_stride
        cos = tl.load(cache_row + j, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(cache_row + half + j, mask=rotated, other=0.0).to(tl.float32)
        out = tl.where(first, x * cos - xp * sin, tl.where(rotated, x * cos + xp * sin, x))
        tl.store(dst + d, out.to(qkv_ptr.dtype.element_ty), mask=dmask)


def qkv_norm_rope(qkv: torch.Tensor, positions: torch.Tensor, q_weight: torch.Tensor | None,
                  k_weight: torch.Tensor | None, cos_sin_cache: torch.Tensor, num_heads: int,
                  num_kv_heads: int, head_size: int, eps: float):
    T = qkv.shape[0]
    q = qkv.new_empty(T, num_heads, head_size)
    k = qkv.new_empty(T, num_kv_heads, head_size)
    v = qkv.new_empty(T, num_kv_heads, head_size)
    if T == 0:
        return q, k, v
    has_norm = q_weight is not None
    block_d = triton.next_power_of_2(head_size)
    _qkv_kernel[(T, num_heads + 2 * num_kv_heads)](
        qkv, positions, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        cos_sin_cache, q, k, v, qkv.stride(0), positions.stride(0), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, head_size, cos_sin_cache.shape[-1] // 2, eps,
        HAS_NORM=has_norm, BLOCK_D=block_d, num_warps=1 if block_d <= 128 else 2,
        **pdl_args(qkv.device, T, "qkv_norm_rope"))
    return q, k, v
