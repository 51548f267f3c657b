"""Linear layers of one to :data:`GEMV_ROWS` rows (decode steps) in GEMV form, with the
same prologue and epilogues as :mod:`graphcap.opsdb.triton.linear`'s few-row kernel:

    y = epilogue(prologue(x) @ W^T)      x [M, K], W [N, K] (or [2N, K] for SwiGLU)

At a few rows a projection is a read of its weight; what decides its time is how soon
every byte of it is asked for. A program here owns ``BLOCK_N`` output columns (two, on
the H200) and loads its whole ``[BLOCK_N, K]`` weight slice in one go (``BLOCK_K`` up to
K), so the launch has all of its weight in flight at once; each row's products are summed
on the CUDA cores (no tensor-core tile padded to 16 rows, no split of K, no partials to
merge). Under programmatic dependent launch a program reads its first weight slice
before the wait for the kernel before where the weight is a module's parameter
(:func:`preloads`), and otherwise asks L2 for it there and reads it after the wait (the
weight may be that kernel's output).

Measured on the H200 (``docs/notes/probes/gemv_rows.py``,
``docs/results/2026-12-03-gemv-rows-8b57f42-h200.json``): at one row this form reads
qwen3-0.6b's projections in 2.4-5.5 us against the tensor-core kernel's 5.3-6.6 and
cuBLAS's 5.1-10.7, about the speed of a bare read of the same bytes in one launch
(``docs/notes/probes/linear_floor.py``).

Numerics as the few-row kernel's: the normed x is rounded to x's dtype before the
products, float32 sums, SwiGLU's halves and the residual's product rounded first.
float32 inputs are multiplied in IEEE float32, compiled without fused multiply-adds: with
them, how the compiler pairs a float32 row's products and squares into FMAs follows the
launch's row count, and on the H100 the normed rows of a 7- or 8-row launch differed in
their last bits from the same rows alone (``docs/notes/probes/gemv_bitwise.py``,
``docs/results/2026-12-05-gpu-suite-1f51601-h100.json``; bf16 rows agreed either way,
and keep them). With ``NORM_LATE`` (the tiles of normed
projections of K up to 1024, :func:`gemv_config`) the products take x times the norm's
weight unrounded, in float32, and each row's 1 / rms scales its sums: nearer float32's
result than rounding the normed x first.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import (
    cast,
    interpreting,
    line_elements,
    pdl_args,
    pdl_launch_dependents,
    pdl_wait,
    prefetches,
)
from graphcap.opsdb.triton.linear import (
    _epilogue,
    _prefetch_weights,
    new_output,
    up_offset,
)

GEMV_ROWS = 8  # the most rows a launch takes: each row's products are its own pass
# Where the dispatch runs it (fused_linear): where a decode step measured faster on the
# H200: one row, weights of up to 32 MB (qwen3-0.6b's step at batch 1 0.953 ms against
# 1.176, docs/results/2026-12-03-bench-decode-gemv1-8b57f42-h200.json; llama3-8b's, its
# 32 MB o projection moved to the form alone, 4.624 / 4.738 ms against 4.737 / 4.898 in
# two runs, where q/k/v's 48 MB, gate/up's or down's moved made it no faster or slower:
# docs/results/2026-12-06-projection-dispatch-07837b8-h200.json). Run at up to 8
# rows it made qwen3-0.6b's step at batch 8 1.8x slower (the per-row reductions across
# warps), and llama3-8b's linears at one row took 4.66 ms of kernels against 4.14
# (docs/results/2026-12-03-bench-decode-gemv-1fe2f13-h200.json).
DISPATCH_ROWS = 1
DISPATCH_BYTES = 32 << 20
# Devices whose recorded steps chose otherwise, by torch.cuda.get_device_name: the
# largest weight the form takes there, and whether normed projections of K past 1024
# keep two weight slices in flight (AHEAD; q/k/v in slices of 1024). On the H100 SXM
# every llama3-8b projection in the form at those tiles made its batch-1 step 1.9-2.9%
# faster in three runs (5.801-6.039 ms against 5.971-6.201; the form at the default
# tiles 1.2-1.5%), and it runs 6 kernels a layer where the default runs 9
# (docs/results/2026-12-06-projection-tiles-cfdb0b6-h100.json). Its largest weight is
# gate/up's 235 MB; the LM heads of both presets (311 MB and 1 GB) stay on cuBLAS.
TUNED = {"NVIDIA H100 80GB HBM3": {"dispatch_bytes": 256 << 20, "ahead": True}}
_SLICE_ELEMENTS = 4096  # weight elements a program holds per slice (per half, SwiGLU)


@triton.jit
def _load_slice(w_rows, k0, col_ok, K, UP, BLOCK_K: tl.constexpr,
                SWIGLU: tl.constexpr, W_CACHE: tl.constexpr):
    """The [BLOCK_N, BLOCK_K] weight slice at k0 (and its up half's, for SwiGLU), loaded
    with the cache modifier ``W_CACHE`` ("" for the default; ".cg" keeps it out of L1)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    mask = col_ok[:, None] & (ks < K)[None, :]
    w = tl.load(w_rows + ks[None, :], mask=mask, other=0.0, cache_modifier=W_CACHE)
    w_up = w
    if SWIGLU:
        w_up = tl.load(w_rows + UP + ks[None, :], mask=mask, other=0.0,
                       cache_modifier=W_CACHE)
    return w, w_up


@triton.jit
def _rows_rstd(X, stride_xm, rows, K, eps, ROWS: tl.constexpr, ROWS_P2: tl.constexpr,
               BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row in float32 (zeros, unread, without
    ``NORM``), each row summed on its own over [BLOCK_K] slices: the same sums in the
    same order whatever ``ROWS`` a launch has, so a row's result does not depend on the
    rows beside it (a [ROWS_P2, BLOCK_K] reduction's order follows its shape on CUDA)."""
    rstd = tl.zeros([ROWS_P2], dtype=tl.float32)
    if NORM:
        offs = tl.arange(0, BLOCK_K)
        for m in tl.static_range(ROWS):
            squares = tl.zeros([BLOCK_K], dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(X + m * stride_xm + k0 + offs, mask=k0 + offs < K,
                            other=0.0).to(tl.float32)
                squares += x * x
            rstd = tl.where(rows == m, tl.rsqrt(tl.sum(squares, axis=0) / K + eps), rstd)
    return rstd


@triton.jit
def _gemv_kernel(
    X, W, Y, NORM_W, RES, BIAS, N, K, eps, stride_xm, stride_wn, stride_ym, stride_rm, UP,
    ROWS: tl.constexpr, ROWS_P2: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, INTERPRET: tl.constexpr,
    PDL: tl.constexpr, PREFETCH: tl.constexpr, LINE: tl.constexpr, PRELOAD: tl.constexpr,
    W_CACHE: tl.constexpr, NORM_LATE: tl.constexpr, AHEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    pdl_launch_dependents(PDL)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    if PRELOAD:
        # The weights are parameters, no kernel's output: the first slice is read while
        # the kernel before finishes.
        w, w_up = _load_slice(w_rows, 0, col_ok, K, UP, BLOCK_K, SWIGLU, W_CACHE)
        pdl_wait(PDL)
    else:
        if PREFETCH:
            # While the kernel before finishes, ask L2 for this program's weights; read
            # them only after the wait (they may be that kernel's output).
            _prefetch_weights(W, W + cols[None, :].to(tl.int64) * stride_wn, col_ok, 0, K,
                              UP, BLOCK_K, SWIGLU, LINE)
        pdl_wait(PDL)
        w, w_up = _load_slice(w_rows, 0, col_ok, K, UP, BLOCK_K, SWIGLU, W_CACHE)
    rows = tl.arange(0, ROWS_P2)
    row_ok = rows < ROWS
    # NORM_LATE: no pass over x before the products; they take x * g in float32 and
    # each row's sum of squares comes with them, its 1 / rms scaling the sums at the end.
    rstd = _rows_rstd(X, stride_xm, rows, K, eps, ROWS, ROWS_P2, BLOCK_K,
                      NORM and not NORM_LATE)
    squares = tl.zeros([ROWS_P2], dtype=tl.float32)
    acc = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([ROWS_P2, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        if AHEAD:  # the next slice asked for before this one's products (two in flight)
            w_next, w_up_next = _load_slice(w_rows, k0 + BLOCK_K, col_ok, K, UP, BLOCK_K,
                                            SWIGLU, W_CACHE)
        wf = w.to(tl.float32)
        wf_up = w_up.to(tl.float32)
        if NORM:
            g = tl.load(NORM_W + ks, mask=k_ok, other=0.0).to(tl.float32)
        for m in tl.static_range(ROWS):
            x = tl.load(X + m * stride_xm + ks, mask=k_ok, other=0.0)
            if NORM and NORM_LATE:
                x = x.to(tl.float32)
                squares = tl.where(rows == m, squares + tl.sum(x * x, axis=0), squares)
                x = x * g
            elif NORM:
                r = tl.sum(tl.where(rows == m, rstd, 0.0), axis=0)
                x = cast(x.to(tl.float32) * r * g, X.dtype.element_ty, INTERPRET)
            xf = x.to(tl.float32)[None, :]
            here = (rows == m)[:, None]
            acc = tl.where(here, acc + tl.sum(wf * xf, axis=1)[None, :], acc)
            if SWIGLU:
                acc_up = tl.where(here, acc_up + tl.sum(wf_up * xf, axis=1)[None, :], acc_up)
        # the next slice (past K: every lane masked, nothing read)
        if AHEAD:
            w, w_up = w_next, w_up_next
        else:
            w, w_up = _load_slice(w_rows, k0 + BLOCK_K, col_ok, K, UP, BLOCK_K,
                                  SWIGLU, W_CACHE)
    if NORM and NORM_LATE:
        late = tl.rsqrt(squares / tl.maximum(K, 1) + eps)[:, None]  # K 0: sums of 0
        acc = acc * late
        acc_up = acc_up * late
    _epilogue(acc, acc_up, rows, cols, row_ok, col_ok, Y, RES, BIAS, stride_ym, stride_rm,
              SWIGLU, RESIDUAL, HAS_BIAS, INTERPRET)


def gemv_config(k: int, norm: bool = False, swiglu: bool = False,
                ahead: bool = False) -> dict:
    """Two columns a program, the slice as long as K up to :data:`_SLICE_ELEMENTS`
    weight elements a program and half (32 a thread: no spills beside their float32
    copies, several programs an SM), four warps. With the RMSNorm folded in and K of up
    to 1024, four columns a program with all of K in one slice, the norm's scale applied
    to the sums (``NORM_LATE``): each program reads x once for twice the columns, and
    no pass over x comes before its products. On the H200, single launches over
    weights cycled past L2 (``docs/notes/probes/gemv_forms.py``,
    ``docs/results/2026-12-05-gemv-forms-43639f3-h200.json``): qwen3-0.6b's q/k/v 4.7 us
    against 6.5, gate/up 6.2 against 8.5, and its batch-1 step 4% faster; the residual
    projections (o, down) and llama3-8b's K of 4096 ran no faster in any other form.
    ``ahead`` (a device of :data:`TUNED` that asks for it): normed projections of K past
    1024 keep two slices in flight (``AHEAD``), those without SwiGLU in slices of at most
    1024."""
    if norm and k <= 1024:
        return {"BLOCK_N": 4, "BLOCK_K": max(16, triton.next_power_of_2(k)),
                "num_warps": 4, "NORM_LATE": True}
    block_n = 2
    block_k = max(16, min(triton.next_power_of_2(k), _SLICE_ELEMENTS // block_n))
    if ahead and norm:
        return {"BLOCK_N": block_n, "BLOCK_K": block_k if swiglu else min(block_k, 1024),
                "num_warps": 4, "AHEAD": True}
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": 4}


def tuning(device: torch.device) -> dict:
    """:data:`TUNED`'s entry for ``device``, else the defaults (:data:`DISPATCH_BYTES`,
    no ``AHEAD``)."""
    default = {"dispatch_bytes": DISPATCH_BYTES, "ahead": False}
    if device.type != "cuda":
        return default
    return TUNED.get(_device_name(device.index), default)


@functools.cache
def _device_name(index: int | None) -> str:
    return torch.cuda.get_device_name(index)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight=None,
                eps: float = 1e-6, residual=None, bias=None, swiglu: bool = False,
                tiles: dict | None = None) -> torch.Tensor:
    """``epilogue(prologue(x) @ weight^T)`` for ``x`` of at most :data:`GEMV_ROWS` rows,
    the arguments of :func:`graphcap.opsdb.triton.linear.skinny_linear`; a new [M, N]
    tensor. ``tiles`` overrides :func:`gemv_config` (benchmarks and tests), and may set
    ``W_CACHE`` (".cg": weights loaded past L1), ``NORM_LATE`` and ``AHEAD`` (each
    program asks for its next weight slice before it multiplies the one it holds, so two
    are in flight; off: the next is asked for after the products)."""
    y, (m, n, k) = new_output("gemv_linear", x, weight, swiglu, GEMV_ROWS, residual, bias)
    if m == 0 or n == 0:
        return y
    cfg = {"W_CACHE": "", "NORM_LATE": False, "AHEAD": False,
           **(tiles or gemv_config(k, norm=norm_weight is not None, swiglu=swiglu,
                                   ahead=tuning(x.device)["ahead"]))}
    res = residual if residual is not None else y
    launch = pdl_args(x.device, m, "gemv")
    _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        x, weight, y, norm_weight if norm_weight is not None else x, res,
        bias if bias is not None else x, n, k, float(eps), x.stride(0), weight.stride(0),
        y.stride(0), res.stride(0), up_offset(n, weight, swiglu), ROWS=m,
        ROWS_P2=max(2, triton.next_power_of_2(m)),
        NORM=norm_weight is not None, SWIGLU=swiglu, RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, INTERPRET=interpreting(),
        PREFETCH=launch["PDL"] and prefetches(weight),
        PRELOAD=launch["PDL"] and preloads(weight),
        LINE=min(line_elements(weight), cfg["BLOCK_K"]),
        enable_fp_fusion=x.dtype != torch.float32, **launch, **cfg)
    return y


def preloads(weight: torch.Tensor) -> bool:
    """Whether a PDL launch reads ``weight`` before it waits for the kernel before: only
    a module's parameter (``nn.Parameter``), which no kernel of a forward writes. Any
    other tensor may be the output of that kernel, still running, so it is only asked of
    L2 there and read after the wait."""
    return isinstance(weight, torch.nn.Parameter)


def gemv_rows(weight: torch.Tensor) -> int:
    """Up to how many rows the dispatch runs this form over ``weight``
    (:data:`DISPATCH_ROWS` where it is at most :data:`DISPATCH_BYTES`, or its device's
    :data:`TUNED` bound, else none)."""
    bound = tuning(weight.device)["dispatch_bytes"]
    return DISPATCH_ROWS if weight.numel() * weight.element_size() <= bound else 0


def dispatches(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`graphcap.opsdb.triton.linear.fused_linear` runs this form for
    ``x`` and ``weight``."""
    return x.shape[0] <= gemv_rows(weight)


__all__ = ["DISPATCH_BYTES", "DISPATCH_ROWS", "GEMV_ROWS", "TUNED", "dispatches",
           "gemv_config", "gemv_linear", "gemv_rows", "preloads", "tuning"]
