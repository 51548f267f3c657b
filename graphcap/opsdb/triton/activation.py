"""Gated activation kernel: ``silu_and_mul`` (SwiGLU), ``[T, 2*I] -> [T, I]``.

Contract (see :mod:`graphcap.opsdb.reference`): ``out = silu(x[:, :I]) * x[:, I:]``
computed in float32 and cast to the output dtype. ``x`` and ``out`` need contiguous last
dims; rows may have any stride. The grid tiles ``[BLOCK_T, BLOCK_I]`` blocks of the
output; contiguous columns (with 16-divisible strides, which Triton specialises on) give
16-byte vectorised loads and stores. No host synchronisation, grid from host shapes only,
``T == 0`` launches nothing: safe inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one tile at most, and the widest tile row.
_MAX_TILE = 4096
_MAX_BLOCK_I = 1024
_MIN_BLOCK_I = 256
# Below this many programs, tiles shrink to spread small batches over the SMs.
_MIN_PROGRAMS = 264


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, T, inter, x_stride, out_stride,
                         BLOCK_T: tl.constexpr, BLOCK_I: tl.constexpr):
    pid_t = tl.program_id(0)
    pid_i = tl.program_id(1)
    rows = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (rows < T)[:, None] & (cols < inter)[None, :]
    rows64 = rows.to(tl.int64)
    gate_ptrs = x_ptr + rows64[:, None] * x_stride + cols[None, :]
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    y = gate * tl.sigmoid(gate) * up
    out_ptrs = out_ptr + rows64[:, None] * out_stride + cols[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _config(T: int, inter: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_I, num_warps): tiles of up to _MAX_TILE elements, made smaller
    (fewer rows, then narrower) while the grid would have fewer than _MIN_PROGRAMS."""
    block_i = min(triton.next_power_of_2(inter), _MAX_BLOCK_I)
    block_t = min(max(_MAX_TILE // block_i, 1), triton.next_power_of_2(T))

    def programs(bt: int, bi: int) -> int:
        return triton.cdiv(T, bt) * triton.cdiv(inter, bi)

    while block_t > 1 and programs(block_t, block_i) < _MIN_PROGRAMS:
        block_t //= 2
    while block_i > _MIN_BLOCK_I and programs(block_t, block_i) < _MIN_PROGRAMS:
        block_i //= 2
    # About 8 elements per thread, 1..8 warps.
    num_warps = min(max(block_t * block_i // 256, 1), 8)
    return block_t, block_i, num_warps


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x[:, :I]) * x[:, I:]`` in float32, cast to ``out``'s dtype.

    x [T, 2*I] (contiguous last dim, any row stride); writes ``out`` [T, I] (allocated
    with x's dtype and device when None) and returns it.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [T, 2*I], got {tuple(x.shape)}")
    T, inter = x.shape[0], x.shape[1] // 2
    if inter > 0 and x.stride(1) != 1:
        raise ValueError(f"x needs a contiguous last dim, got strides {x.stride()}")
    if out is None:
        out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    if out.shape != (T, inter) or (inter > 1 and out.stride(1) != 1):
        raise ValueError(f"out must be a [{T}, {inter}] with a contiguous last dim, "
                         f"got {tuple(out.shape)} strides {out.stride()}")
    if T == 0 or inter == 0:
        return out
    block_t, block_i, num_warps = _config(T, inter)
    grid = (triton.cdiv(T, block_t), triton.cdiv(inter, block_i))
    _silu_and_mul_kernel[grid](
        x, out, T, inter, x.stride(0), out.stride(0),
        BLOCK_T=block_t, BLOCK_I=block_i, num_warps=num_warps)
    return out
