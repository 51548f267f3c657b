"""RMSNorm kernels: ``rms_norm`` and ``fused_add_rms_norm`` (residual add + RMSNorm).

Contract (see :mod:`graphcap.opsdb.reference`): ``x`` is ``[T, H]`` with a contiguous last
dim (rows may have any stride), ``weight`` is ``[H]`` contiguous. The sum of squares, the
normalisation and the weight product are computed in float32 and cast back to the output
dtype. One program handles one row: the whole row sits in registers for ``H <= 8192``;
longer rows are streamed in ``BLOCK_H`` chunks (two passes). Launchers never synchronise
with the host and size their grids from host shapes only, so they can be captured in a
CUDA graph; ``T == 0`` launches nothing.

``rms_norm(..., prefetch=weight)``: launched with PDL (few rows, sm90+), the kernel starts
while the kernel before it still runs; before it waits for that one, its programs ask L2
for ``weight`` (a tensor of up to ``common.PREFETCH_BYTES`` that no kernel of the stream
writes: the weight of the matmul after the norm). A cuBLAS matmul, which cannot start
early, then reads its weight from L2, not from memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import (
    line_elements,
    num_sms,
    pdl_args,
    pdl_launch_dependents,
    pdl_start,
    pdl_wait,
    prefetch_share_l2,
    prefetches,
)

# Rows up to this many elements are normalised from registers in a single pass.
_MAX_FUSED_H = 8192
# Chunk width when a row is longer than that.
_LOOP_BLOCK_H = 4096
# Cache lines of the next matmul's weight one program asks L2 for, at most.
AHEAD_LINES = 2048


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, ahead_ptr, x_stride, out_stride, T, H, eps,
                     ahead_lines, BLOCK_H: tl.constexpr, SINGLE_PASS: tl.constexpr,
                     N_CHUNKS: tl.constexpr, PDL: tl.constexpr, AHEAD: tl.constexpr,
                     LINE: tl.constexpr):
    pdl_launch_dependents(PDL)
    if AHEAD:  # the next matmul's weight, asked of L2 while the previous kernel runs
        prefetch_share_l2(ahead_ptr, ahead_lines, LINE, 1024)
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    if row >= T:  # a program that only asked L2 for its share of the weight
        return
    x_row = x_ptr + row * x_stride
    out_row = out_ptr + row * out_stride
    cols = tl.arange(0, BLOCK_H)
    if SINGLE_PASS:
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = x * rstd * w
        tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for chunk in range(N_CHUNKS):
            offs = chunk * BLOCK_H + cols
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        for chunk in range(N_CHUNKS):
            offs = chunk * BLOCK_H + cols
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = x * rstd * w
            tl.store(out_row + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, x_stride, res_stride, H, eps,
                               BLOCK_H: tl.constexpr, SINGLE_PASS: tl.constexpr,
                               N_CHUNKS: tl.constexpr, PDL: tl.constexpr):
    pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * x_stride
    res_row = res_ptr + row * res_stride
    cols = tl.arange(0, BLOCK_H)
    if SINGLE_PASS:
        mask = cols < H
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
        total = x + r
        tl.store(res_row + cols, total.to(res_ptr.dtype.element_ty), mask=mask)
        rstd = tl.rsqrt(tl.sum(total * total, axis=0) / H + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = total * rstd * w
        tl.store(x_row + cols, y.to(x_ptr.dtype.element_ty), mask=mask)
    else:
        # Pass 1 only reads, so pass 2 can recompute the exact float32 sum from the
        # untouched inputs (the stored residual is rounded to its dtype).
        acc = tl.zeros([BLOCK_H], dtype=tl.float32)
        for chunk in range(N_CHUNKS):
            offs = chunk * BLOCK_H + cols
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            total = x + r
            acc += total * total
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        for chunk in range(N_CHUNKS):
            offs = chunk * BLOCK_H + cols
            mask = offs < H
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            r = tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
            total = x + r
            tl.store(res_row + offs, total.to(res_ptr.dtype.element_ty), mask=mask)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            y = total * rstd * w
            tl.store(x_row + offs, y.to(x_ptr.dtype.element_ty), mask=mask)


def _config(H: int) -> tuple[int, bool, int, int]:
    """(BLOCK_H, SINGLE_PASS, N_CHUNKS, num_warps) for rows of ``H`` elements. The chunk
    count is a constexpr (a fixed trip count; also, Triton 3.6's interpreter cannot loop
    to a runtime bound under numpy >= 2.4)."""
    block = triton.next_power_of_2(H)
    single = block <= _MAX_FUSED_H
    if not single:
        block = _LOOP_BLOCK_H
    # About 8 elements (16 bytes of bf16) per thread, 1..16 warps.
    num_warps = min(max(block // 256, 1), 16)
    return block, single, triton.cdiv(H, block), num_warps


def _check_rows(name: str, t: torch.Tensor, H: int) -> None:
    if t.dim() != 2 or t.shape[1] != H:
        raise ValueError(f"{name} must be [T, {H}], got {tuple(t.shape)}")
    if H > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} needs a contiguous last dim, got strides {t.stride()}")


def _check_weight(weight: torch.Tensor, H: int) -> None:
    if weight.shape != (H,) or (H > 1 and weight.stride(0) != 1):
        raise ValueError(f"weight must be a contiguous [{H}], got {tuple(weight.shape)}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             out: torch.Tensor | None = None, prefetch: torch.Tensor | None = None
             ) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` per row, computed in float32.

    x [T, H] (contiguous last dim, any row stride), weight [H]; writes ``out`` [T, H]
    (allocated with ``torch.empty_like(x)`` when None, cast to its dtype) and returns it.
    ``prefetch``: a contiguous tensor on x's device that the next kernel reads and no
    kernel writes (the weight of the matmul after the norm), asked of L2 while the
    kernel waits for the previous one; only when launched with PDL and up to
    ``common.PREFETCH_BYTES``, else ignored. The result is the same either way.
    """
    H = x.shape[-1]
    _check_rows("x", x, H)
    _check_weight(weight, H)
    if out is None:
        out = torch.empty_like(x)
    _check_rows("out", out, H)
    if out.shape[0] != x.shape[0]:
        raise ValueError(f"out has {out.shape[0]} rows, x has {x.shape[0]}")
    T = x.shape[0]
    if T == 0 or H == 0:
        return out
    block, single, chunks, num_warps = _config(H)
    launch = pdl_args(x.device, T, "rms_norm")
    ahead = (launch["PDL"] and prefetch is not None and prefetch.device == x.device
             and prefetch.is_contiguous() and prefetches(prefetch))
    line, lines, programs = 1, 0, T
    if ahead:  # spread over enough programs that none issues more than AHEAD_LINES (one
        # program asking for a whole 8 MB weight took tens of microseconds)
        line = line_elements(prefetch)
        lines = triton.cdiv(prefetch.numel(), line)
        programs = max(T, min(triton.cdiv(lines, AHEAD_LINES), num_sms(x.device)))
    _rms_norm_kernel[(programs,)](
        x, weight, out, prefetch if ahead else x, x.stride(0), out.stride(0), T, H, eps,
        lines,
        BLOCK_H=block, SINGLE_PASS=single, N_CHUNKS=chunks, num_warps=num_warps,
        AHEAD=ahead, LINE=line, **launch)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual <- x + residual``; ``x <- rms_norm(x + residual)``.

    x and residual [T, H] (contiguous last dims, any row strides), weight [H]. The sum is
    taken in float32, stored to ``residual`` in its dtype, and the norm is computed from
    the float32 sum (not from the rounded residual), as the reference does.
    """
    H = x.shape[-1]
    _check_rows("x", x, H)
    _check_rows("residual", residual, H)
    _check_weight(weight, H)
    if residual.shape[0] != x.shape[0]:
        raise ValueError(f"residual has {residual.shape[0]} rows, x has {x.shape[0]}")
    T = x.shape[0]
    if T == 0 or H == 0:
        return
    block, single, chunks, num_warps = _config(H)
    _fused_add_rms_norm_kernel[(T,)](
        x, residual, weight, x.stride(0), residual.stride(0), H, eps,
        BLOCK_H=block, SINGLE_PASS=single, N_CHUNKS=chunks, num_warps=num_warps,
        **pdl_args(x.device, T, "fused_add_rms_norm"))
