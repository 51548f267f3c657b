"""Rotary position embedding kernel (neox style), in place on query and key.

Contract (see :mod:`graphcap.opsdb.reference`): ``query`` [T, Hq*D] and ``key`` [T, Hk*D]
(or [T, H, D] views), contiguous within a row, any row stride; ``positions`` [T] int32 or
int64; ``cos_sin_cache`` [max_position, rot_dim], cos in the first half and sin in the
second. The first ``rot_dim <= head_size`` dims of every head rotate, dim i pairing with
dim i + rot_dim/2; the rest are left untouched. A position reads the table's row as the
reference's ``cos_sin_cache[positions]`` does (a negative one counting from its end);
one outside the table (which the reference refuses) reads its nearest row, never memory
outside it. Maths in float32, stored in each tensor's dtype. One program per token loads
its cos/sin row once and rotates all query then key heads in ``[BLOCK_HEADS, BLOCK_R]``
tiles (a constexpr number of head blocks: usually one). No host synchronisation, grid
from host shapes only, ``T == 0`` launches nothing: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import table_row

# Elements of one [heads, rot_dim/2] tile at most.
_MAX_TILE = 2048


@triton.jit
def _rotate_heads(row_ptr, n_heads, head_size, half, cos, sin, r, rmask,
                  BLOCK_HEADS: tl.constexpr, N_BLOCKS: tl.constexpr):
    h = tl.arange(0, BLOCK_HEADS)
    for b in range(N_BLOCKS):
        heads = b * BLOCK_HEADS + h
        mask = (heads < n_heads)[:, None] & rmask[None, :]
        p1 = row_ptr + heads[:, None] * head_size + r[None, :]
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p1 + half, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos - x2 * sin
        o2 = x2 * cos + x1 * sin
        tl.store(p1, o1.to(row_ptr.dtype.element_ty), mask=mask)
        tl.store(p1 + half, o2.to(row_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(pos_ptr, q_ptr, k_ptr, cache_ptr, pos_stride, q_stride, k_stride,
                   cache_stride, cache_rows, n_q_heads, n_k_heads, head_size, half,
                   BLOCK_HEADS: tl.constexpr, BLOCK_R: tl.constexpr,
                   Q_BLOCKS: tl.constexpr, K_BLOCKS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = table_row(tl.load(pos_ptr + t * pos_stride).to(tl.int64), cache_rows)
    r = tl.arange(0, BLOCK_R)
    rmask = r < half
    cache_row = cache_ptr + pos * cache_stride
    cos = tl.load(cache_row + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_row + half + r, mask=rmask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + t * q_stride, n_q_heads, head_size, half, cos, sin, r, rmask,
                  BLOCK_HEADS, Q_BLOCKS)
    _rotate_heads(k_ptr + t * k_stride, n_k_heads, head_size, half, cos, sin, r, rmask,
                  BLOCK_HEADS, K_BLOCKS)


def _heads(name: str, t: torch.Tensor, T: int, head_size: int) -> tuple[int, int]:
    """(row stride, number of heads) of a [T, H*D] or [T, H, D] tensor; heads must be
    packed contiguously inside a row."""
    if t.shape[0] != T:
        raise ValueError(f"{name} has {t.shape[0]} rows, positions has {T}")
    if t.dim() == 2:
        if t.shape[1] % head_size:
            raise ValueError(f"{name} width {t.shape[1]} is not a multiple of {head_size}")
        n, packed = t.shape[1] // head_size, t.shape[1] <= 1 or t.stride(1) == 1
    elif t.dim() == 3 and t.shape[2] == head_size:
        n = t.shape[1]
        packed = (head_size <= 1 or t.stride(2) == 1) and (n <= 1 or t.stride(1) == head_size)
    else:
        raise ValueError(f"{name} must be [T, H*{head_size}] or [T, H, {head_size}], "
                         f"got {tuple(t.shape)}")
    if not packed:
        raise ValueError(f"{name} needs heads packed within a row, got strides {t.stride()}")
    return t.stride(0), n


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """Neox-style rotary embedding, in place on ``query`` and ``key``.

    positions [T] int32/int64; query [T, Hq*head_size]; key [T, Hk*head_size] (or None);
    cos_sin_cache [max_position, rot_dim] with rot_dim even and <= head_size. Positions are
    not bounds-checked (that would need a host sync): a negative one counts from the
    table's end, as torch's indexing does; one outside the table reads its nearest row.
    """
    if positions.dim() != 1:
        raise ValueError(f"positions must be [T], got {tuple(positions.shape)}")
    T = positions.shape[0]
    rot = cos_sin_cache.shape[-1]
    if cos_sin_cache.dim() != 2 or rot % 2 or rot > head_size or cos_sin_cache.stride(1) != 1:
        raise ValueError(f"cos_sin_cache must be a [max_position, rot_dim] with an even "
                         f"rot_dim <= head_size={head_size} and a contiguous last dim, got "
                         f"{tuple(cos_sin_cache.shape)} strides {cos_sin_cache.stride()}")
    q_stride, n_q = _heads("query", query, T, head_size)
    if key is None:
        key, k_stride, n_k = query, 0, 0
    else:
        k_stride, n_k = _heads("key", key, T, head_size)
    if T == 0 or rot == 0 or (n_q == 0 and n_k == 0):
        return
    if cos_sin_cache.shape[0] == 0:
        raise ValueError("cos_sin_cache has no rows (positions) to read")
    half = rot // 2
    block_r = triton.next_power_of_2(half)
    block_heads = min(triton.next_power_of_2(max(n_q, n_k)), max(_MAX_TILE // block_r, 1))
    # About 4 elements of each half per thread, 1..8 warps.
    num_warps = min(max(block_heads * block_r // 128, 1), 8)
    _rotary_kernel[(T,)](
        positions, query, key, cos_sin_cache, positions.stride(0), q_stride, k_stride,
        cos_sin_cache.stride(0), cos_sin_cache.shape[0], n_q, n_k, head_size, half,
        BLOCK_HEADS=block_heads, BLOCK_R=block_r, Q_BLOCKS=triton.cdiv(n_q, block_heads),
        K_BLOCKS=triton.cdiv(n_k, block_heads), num_warps=num_warps)
