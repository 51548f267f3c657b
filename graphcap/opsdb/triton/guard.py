"""``guard_kv`` in one kernel: keys and values that keep every request to itself.

Contract (the torch version is :func:`graphcap.opsdb.attention.base.guard_kv_reference`):
for k, v ``[T, Hk, D]`` and ``valid`` ``[T]`` (the real rows), the outputs are copies in
which a padding row (``valid`` false) is zero in k and v, and a real row whose value
vector of a head holds a NaN or an infinity has that value vector zeroed and its key
vector set to NaN. Attention kernels mask keys by assigning ``-inf`` to the scores of
keys a query may not see (FlashAttention, FlashInfer, graphcap's Triton kernel alike), so
a NaN key reaches only the rows that may attend to it, while a value is multiplied by its
probability even where that is zero (``0 * NaN = NaN``). One launch over ``[T, Hk]``
tiles; grid from host shapes only, no synchronisation: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_T = 16


@triton.jit
def _guard_kv_kernel(K, V, KO, VO, VALID, T, HEADS,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kot, stride_koh, stride_vot, stride_voh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    in_range = rows < T
    mask = in_range[:, None] & (cols < HEAD_DIM)[None, :]
    rows64 = rows.to(tl.int64)
    k = tl.load(K + rows64[:, None] * stride_kt + head * stride_kh + cols[None, :],
                mask=mask, other=0.0)
    v = tl.load(V + rows64[:, None] * stride_vt + head * stride_vh + cols[None, :],
                mask=mask, other=0.0)
    real = tl.load(VALID + rows, mask=in_range, other=0) != 0
    v32 = v.to(tl.float32)
    finite = (v32 == v32) & (tl.abs(v32) != float("inf"))
    bad = real & (tl.min(finite.to(tl.int32), axis=1) == 0)
    keep = real & ~bad
    v_out = tl.where(keep[:, None], v, 0.0)
    k_out = tl.where(bad[:, None], float("nan"), tl.where(real[:, None], k, 0.0))
    tl.store(KO + rows64[:, None] * stride_kot + head * stride_koh + cols[None, :],
             k_out.to(KO.dtype.element_ty), mask=mask)
    tl.store(VO + rows64[:, None] * stride_vot + head * stride_voh + cols[None, :],
             v_out.to(VO.dtype.element_ty), mask=mask)


def guard_kv(k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Guarded copies of ``k`` and ``v`` ``[T, Hk, D]`` (last dims contiguous) for the
    real rows ``valid`` ``[T]`` bool; see the module docstring."""
    if k.shape != v.shape or k.dim() != 3 or valid.shape != k.shape[:1]:
        raise ValueError(f"guard_kv takes k, v [T, Hk, D] and valid [T], got "
                         f"{tuple(k.shape)}, {tuple(v.shape)}, {tuple(valid.shape)}")
    if k.stride(2) != 1 or v.stride(2) != 1:
        k, v = k.contiguous(), v.contiguous()
    k_out, v_out = torch.empty_like(k), torch.empty_like(v)
    T, heads, dim = k.shape
    if T == 0 or heads == 0:
        return k_out, v_out
    grid = (triton.cdiv(T, _BLOCK_T), heads)
    _guard_kv_kernel[grid](
        k, v, k_out, v_out, valid.view(torch.uint8), T, heads,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_out.stride(0), k_out.stride(1), v_out.stride(0), v_out.stride(1),
        HEAD_DIM=dim, BLOCK_D=triton.next_power_of_2(dim), BLOCK_T=_BLOCK_T,
        num_warps=4 if dim >= 128 else 2)
    return k_out, v_out
