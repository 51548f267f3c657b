"""One kernel from the fused QKV projection to attention's inputs: split, per-head RMSNorm
of q and k (Qwen3; optional), neox rotary of q and k, and contiguous q, k, v.

Unfused, a layer runs six kernels here (two reshape copies, two norms, rotary, a copy of
v); at 16 tokens each is launch-bound, so the six cost what one does.

Contract (see :func:`graphcap.opsdb.qkv.reference`): ``qkv`` [T, (H + 2 Hk) * D] with a
contiguous last dim and any row stride; ``positions`` [T] int32/int64; ``q_weight`` and
``k_weight`` [D] or both None; ``cos_sin_cache`` [max_position, rot] (cos then sin,
rot even, <= D; a position reads its row as the reference's indexing does, a negative one
from the table's end, and one outside the table its nearest row, never memory outside it).
Returns fresh contiguous q [T, H, D], k [T, Hk, D], v [T, Hk, D]. Like
the unfused ops, normalised values are rounded to the input dtype before they rotate, so
both paths give the same bits in the common case. One program per token and block of
heads: one head for a few tokens, else up to TILE / D heads (all of a token's where they
fit) once there are PROGRAMS programs. Grid from host shapes only,
``T == 0`` launches nothing: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import pdl_args, pdl_start, table_row

TILE = 4096  # elements a program at most: heads x head size
PROGRAMS = 128  # about the SMs of a GPU
# A program a head up to this many (one-warp programs, one wave): on the H200 faster there
# than tiles (qwen3-0.6b, 16 tokens: 1.40 us against 1.64 with 4 heads a program), slower
# past it (64 tokens: 3.12 against 2.10; docs/notes/probes/qkv_tiles.py).
SINGLE = 1024


@triton.jit
def rope_at(cache_row, d, half):
    """Neox rotary's tables for columns ``d`` of a head at one position (``cache_row``,
    cos then sin): cos and sin in float32, each column's partner (``d`` +- ``half``),
    which columns come first in their pair and which rotate."""
    first = d < half
    rotated = d < 2 * half
    partner = tl.where(first, d + half, d - half)
    j = tl.where(first, d, d - half)
    cos = tl.load(cache_row + j, mask=rotated, other=1.0).to(tl.float32)
    sin = tl.load(cache_row + half + j, mask=rotated, other=0.0).to(tl.float32)
    return cos, sin, first, rotated, partner


@triton.jit
def norm_rope(raw, raw_p, w, wp, cos, sin, first, rotated, head_size, eps,
              HAS_NORM: tl.constexpr):
    """Heads ``raw`` [R, BLOCK_D] (zero past ``head_size``) RMS-normed by ``w`` (where
    ``HAS_NORM``) and rotated; ``raw_p`` holds each column's partner, ``wp`` its weight.
    Normed values are rounded to ``raw``'s dtype before they rotate, as the unfused ops
    store them; the result in that dtype."""
    x = raw.to(tl.float32)
    xp = raw_p.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / head_size + eps)[:, None]
        x = (x * rstd * w.to(tl.float32)).to(raw.dtype).to(tl.float32)
        xp = (xp * rstd * wp.to(tl.float32)).to(raw.dtype).to(tl.float32)
    out = tl.where(first, x * cos - xp * sin, tl.where(rotated, x * cos + xp * sin, x))
    return out.to(raw.dtype)


@triton.jit
def _qkv_kernel(qkv_ptr, pos_ptr, qw_ptr, kw_ptr, cache_ptr, q_ptr, k_ptr, v_ptr,
                qkv_stride, pos_stride, cache_stride, cache_rows, n_q, n_k, head_size, half,
                eps,
                HAS_NORM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]  # [BLOCK_H, 1]
    d = tl.arange(0, BLOCK_D)[None, :]  # [1, BLOCK_D]
    is_q = h < n_q
    is_k = (h >= n_q) & (h < n_q + n_k)
    is_v = h >= n_q + n_k
    mask = (h < n_q + 2 * n_k) & (d < head_size)
    pos = table_row(tl.load(pos_ptr + t * pos_stride).to(tl.int64), cache_rows)
    cos, sin, first, rotated, partner = rope_at(cache_ptr + pos * cache_stride, d, half)
    row = qkv_ptr + t * qkv_stride + h * head_size
    raw = tl.load(row + d, mask=mask, other=0.0)
    raw_p = tl.load(row + partner, mask=mask & rotated, other=0.0)
    w = raw
    wp = raw
    if HAS_NORM:
        w = tl.where(is_q, tl.load(qw_ptr + d, mask=d < head_size, other=0.0),
                     tl.load(kw_ptr + d, mask=d < head_size, other=0.0))
        wp = tl.where(is_q, tl.load(qw_ptr + partner, mask=rotated, other=0.0),
                      tl.load(kw_ptr + partner, mask=rotated, other=0.0))
    out = norm_rope(raw, raw_p, w, wp, cos, sin, first, rotated, head_size, eps, HAS_NORM)
    tl.store(q_ptr + (t * n_q + h) * head_size + d, out, mask=mask & is_q)
    tl.store(k_ptr + (t * n_k + h - n_q) * head_size + d, out, mask=mask & is_k)
    tl.store(v_ptr + (t * n_k + h - n_q - n_k) * head_size + d, raw, mask=mask & is_v)


def heads_per_program(heads: int, tokens: int, block_d: int) -> int:
    """Heads a program takes: one while a program a head makes at most SINGLE programs (a
    decode step, a short prompt), else as many as fit the tile once the grid has PROGRAMS
    programs."""
    if heads * tokens <= SINGLE:
        return 1
    spread = triton.next_power_of_2(max(1, heads * tokens // PROGRAMS))
    return min(triton.next_power_of_2(heads), max(1, TILE // block_d), spread)


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
    heads = num_heads + 2 * num_kv_heads
    block_d = triton.next_power_of_2(head_size)
    block_h = heads_per_program(heads, T, block_d)
    _qkv_kernel[(T, triton.cdiv(heads, block_h))](
        qkv, positions, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        cos_sin_cache, q, k, v, qkv.stride(0), positions.stride(0), cos_sin_cache.stride(0),
        cos_sin_cache.shape[0], num_heads, num_kv_heads, head_size,
        cos_sin_cache.shape[-1] // 2, eps,
        HAS_NORM=has_norm, BLOCK_H=block_h, BLOCK_D=block_d,
        num_warps=max(1 if block_d <= 128 else 2, min(8, block_h * block_d // 512)),
        **pdl_args(qkv.device, T, "qkv_norm_rope"))
    return q, k, v
