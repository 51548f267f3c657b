"""The paged cache's K/V write: one program per token copies its ``[kv_heads, head_dim]``
key and value rows to the token's place in the cache (contract:
:mod:`graphcap.opsdb.kv`). A place outside the cache (negative, or past its last slot,
which the reference refuses) writes nothing: never the memory around the cache. Grid
from host shapes only, no host synchronisation, ``T == 0`` launches nothing: safe inside
a CUDA graph. Under programmatic dependent launch it lets the next kernel (decode
attention) start at once and waits for the one before it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import cast, in_table, interpreting, pdl_args, pdl_start


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, loc_ptr,
                     k_stride_t, k_stride_h, v_stride_t, v_stride_h, heads, head_dim, slots,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr,
                     PDL: tl.constexpr):
    pdl_start(PDL)
    t = tl.program_id(0)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    # A place outside the cache writes no head (a scalar mask, folded into the heads').
    mask = (h < tl.where(in_table(loc, slots), heads, 0))[:, None] & (d < head_dim)[None, :]
    src_k = k_ptr + t.to(tl.int64) * k_stride_t + h[:, None] * k_stride_h + d[None, :]
    src_v = v_ptr + t.to(tl.int64) * v_stride_t + h[:, None] * v_stride_h + d[None, :]
    # A token's place in the cache is heads * head_dim contiguous elements.
    dst = loc * heads * head_dim + h[:, None] * head_dim + d[None, :]
    key = tl.load(src_k, mask=mask)
    value = tl.load(src_v, mask=mask)
    tl.store(kc_ptr + dst, cast(key.to(tl.float32), kc_ptr.dtype.element_ty, INTERPRET),
             mask=mask)
    tl.store(vc_ptr + dst, cast(value.to(tl.float32), vc_ptr.dtype.element_ty, INTERPRET),
             mask=mask)


def kv_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, cache_loc: torch.Tensor) -> None:
    T, heads, head_dim = k.shape
    if T == 0 or heads == 0 or head_dim == 0:  # nothing to write (tl.arange(0, 0) fails)
        return
    block_h = triton.next_power_of_2(heads)
    block_d = triton.next_power_of_2(head_dim)
    _kv_write_kernel[(T,)](
        k, v, k_cache, v_cache, cache_loc, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        heads, head_dim, k_cache.shape[0] * k_cache.shape[1], BLOCK_H=block_h,
        BLOCK_D=block_d, INTERPRET=interpreting(),
        num_warps=max(1, min(8, block_h * block_d // 256)), **pdl_args(k.device, T, "kv_write"))


__all__ = ["kv_write"]
