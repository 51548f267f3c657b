"""Linear layers for a few rows (prefill of short prompts, the last-token LM head), with
the ops around them fused in: RMSNorm before, SwiGLU or the residual add after.

At 16 tokens a decoder's matmuls read their weights and do almost no arithmetic; what
costs is their number and how well each one keeps the memory system busy. cuBLAS ran
qwen3-0.6b's 1024-column projections at 0.8-0.9 TB/s on the H200 (32 column tiles on
132 SMs, then a separate split-K reduction kernel), and the norm, activation and residual
add around them were kernels of their own. Here one kernel does

    y = epilogue(prologue(x) @ W^T)      x [M, K], W [N, K] (or [2N, K] for SwiGLU)

- prologue ``NORM``: RMSNorm of each row of x (a first pass over the row for its sum of
  squares; each tile is then scaled and rounded to x's dtype, as a separate norm kernel
  stores it);
- epilogue ``SWIGLU``: W holds gate rows then up rows; y = silu(gate) * up, each rounded
  to the output dtype first, as the unfused linear stores them;
- epilogue ``RESIDUAL``: y = residual + (x @ W^T rounded), added in float32;
- bias (plain and normed linears).

All M rows sit in one tile (``BLOCK_M`` up to 64); the grid covers N in ``BLOCK_N``
columns and, when that leaves SMs idle, splits K over ``SPLIT_K`` programs. Split
programs store float32 partial tiles; the last one to finish a column block (an atomic
counter) sums them, runs the epilogue and sets the counter back to zero, so no second
kernel is needed and the counters, one buffer per stream made outside every graph pool
(:mod:`graphcap.opsdb.triton.counters`), need no zeroing kernel before a launch. The
partials are allocated per call. No host synchronisation: safe to capture.

Under programmatic dependent launch (sm90+, few rows: :mod:`graphcap.opsdb.triton.common`)
a program releases the next kernel at once, asks L2 for its weight slice (weights of up
to ``common.PREFETCH_BYTES``) while the previous kernel finishes, and waits for that
kernel before it reads x. Where cuBLAS runs the matmul (the unfused ops), the RMSNorm
kernel before it asks L2 for the weight instead (:func:`graphcap.opsdb.triton.norm.rms_norm`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton import counters
from graphcap.opsdb.triton.common import (
    cast,
    dot,
    interpreting,
    line_elements,
    num_sms,
    pdl_args,
    pdl_launch_dependents,
    pdl_wait,
    prefetch_l2,
    prefetches,
    shared_memory,
)

MAX_ROWS = 64  # the fused kernel's row limit: beyond it cuBLAS's tiles win
_SMEM_BUDGET = 160 * 1024  # of a program's shared memory, where the device has more
_SMEM_SPARE = 8 * 1024  # left to what the stages' tiles do not count (the epilogue's)


@triton.jit
def _row_rstd(x_rows, row_ok, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
              NORM: tl.constexpr):
    """1 / sqrt(mean(x^2) + eps) of each row, in float32, over all K columns (with
    ``NORM``; zeros, unread, without)."""
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if NORM:
        offs = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + offs
            x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :],
                        other=0.0).to(tl.float32)
            rstd += tl.sum(x * x, axis=1)
        rstd = tl.rsqrt(rstd / K + eps)
    return rstd


@triton.jit
def _k_step(acc, acc_up, squares, k0, x_rows, w_cols, NORM_W, rstd, row_ok, col_ok, K,
            UP, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
            IEEE: tl.constexpr, INTERPRET: tl.constexpr, NORM_LATE: tl.constexpr):
    """One BLOCK_K slice of the product (and of the up half's, for SwiGLU); with
    ``NORM_LATE`` the rows' sums of squares so far too, x * g the product's operand."""
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    x = tl.load(x_rows + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    if NORM and NORM_LATE:
        g = tl.load(NORM_W + ks, mask=k_ok, other=0.0).to(tl.float32)
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
        x = cast(xf * g[None, :], x_rows.dtype.element_ty, INTERPRET)
    elif NORM:
        g = tl.load(NORM_W + ks, mask=k_ok, other=0.0).to(tl.float32)
        x = cast(x.to(tl.float32) * rstd[:, None] * g[None, :], x_rows.dtype.element_ty,
                 INTERPRET)
    w_mask = col_ok[None, :] & k_ok[:, None]
    w = tl.load(w_cols + ks[:, None], mask=w_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
    acc = dot(x, w, acc, IEEE, INTERPRET)
    if SWIGLU:
        w_up = tl.load(w_cols + UP + ks[:, None], mask=w_mask, other=0.0)
        acc_up = dot(x, w_up, acc_up, IEEE, INTERPRET)
    return acc, acc_up, squares


@triton.jit
def _prefetch_weights(W, w_cols, col_ok, k_lo, k_hi, UP, BLOCK_K: tl.constexpr,
                      SWIGLU: tl.constexpr, LINE: tl.constexpr):
    """An L2 prefetch of every 128-byte line (``LINE`` elements) of the weight columns
    ``w_cols`` over K in [k_lo, k_hi), and of the up half's for SwiGLU."""
    lines = tl.arange(0, BLOCK_K // LINE) * LINE
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + lines
        ok = col_ok[None, :] & (ks < k_hi)[:, None]
        prefetch_l2(tl.where(ok, w_cols + ks[:, None], W))
        if SWIGLU:
            prefetch_l2(tl.where(ok, w_cols + UP + ks[:, None], W))


@triton.jit
def _epilogue(acc, acc_up, rows, cols, row_ok, col_ok, Y, RES, BIAS, stride_ym, stride_rm,
              SWIGLU: tl.constexpr, RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr,
              INTERPRET: tl.constexpr):
    out_ty = Y.dtype.element_ty
    mask = row_ok[:, None] & col_ok[None, :]
    if HAS_BIAS:
        acc += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        gate = cast(acc, out_ty, INTERPRET).to(tl.float32)
        up = cast(acc_up, out_ty, INTERPRET).to(tl.float32)
        y = gate * tl.sigmoid(gate) * up
    elif RESIDUAL:
        res = tl.load(RES + rows[:, None] * stride_rm + cols[None, :], mask=mask, other=0.0)
        y = cast(acc, out_ty, INTERPRET).to(tl.float32) + res.to(tl.float32)
    else:
        y = acc
    tl.store(Y + rows[:, None] * stride_ym + cols[None, :], cast(y, out_ty, INTERPRET),
             mask=mask)


@triton.jit
def _skinny_linear_kernel(
    X, W, Y, NORM_W, RES, BIAS, PARTIAL, COUNTS,
    M, N, K, eps, stride_xm, stride_wn, stride_ym, stride_rm, UP,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, NORM: tl.constexpr, SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
    LINE: tl.constexpr, NORM_LATE: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pdl_launch_dependents(PDL)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    x_rows = X + rows[:, None] * stride_xm
    w_cols = W + cols[None, :].to(tl.int64) * stride_wn
    per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_lo = pid_k * per_split
    k_hi = tl.minimum(k_lo + per_split, K)
    if PREFETCH:
        # The weights are no earlier kernel's output: while that kernel finishes, ask L2
        # for this program's slice of them, then wait for x.
        _prefetch_weights(W, w_cols, col_ok, k_lo, k_hi, UP, BLOCK_K, SWIGLU,
                          LINE)
    pdl_wait(PDL)
    # NORM_LATE (one split only; a tile option, off: 2.6x slower for qwen3-0.6b's q/k/v
    # on the H200, performance-history item 86): no pass over x before the products,
    # which take x * g; each row's 1 / rms, from the sums of squares gathered with them,
    # scales the sums.
    rstd = _row_rstd(x_rows, row_ok, K, eps, BLOCK_M, BLOCK_K, NORM and not NORM_LATE)
    squares = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if INTERPRET:  # the interpreter takes no tensor bounds in range()
        k0 = k_lo
        while k0 < k_hi:
            acc, acc_up, squares = _k_step(acc, acc_up, squares, k0, x_rows, w_cols, NORM_W,
                                           rstd, row_ok, col_ok, K, UP, BLOCK_K,
                                           NORM, SWIGLU, IEEE, INTERPRET, NORM_LATE)
            k0 += BLOCK_K
    else:  # a for loop, so that Triton pipelines the weight loads (num_stages)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K):
            acc, acc_up, squares = _k_step(acc, acc_up, squares, k0, x_rows, w_cols, NORM_W,
                                           rstd, row_ok, col_ok, K, UP, BLOCK_K,
                                           NORM, SWIGLU, IEEE, INTERPRET, NORM_LATE)

    if NORM and NORM_LATE:
        late = tl.rsqrt(squares / tl.maximum(K, 1) + eps)[:, None]  # K 0: sums of 0
        acc = acc * late
        acc_up = acc_up * late
    if SPLIT_K == 1:
        _epilogue(acc, acc_up, rows, cols, row_ok, col_ok, Y, RES, BIAS, stride_ym,
                  stride_rm, SWIGLU, RESIDUAL, HAS_BIAS, INTERPRET)
    else:
        # Partials [2 (SwiGLU) or 1, SPLIT_K, BLOCK_M, N] in float32.
        tile = rows[:, None] * N + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        plane = BLOCK_M * N
        tl.store(PARTIAL + pid_k * plane + tile, acc, mask=mask)
        if SWIGLU:
            tl.store(PARTIAL + (SPLIT_K + pid_k) * plane + tile, acc_up, mask=mask)
        tl.debug_barrier()  # every thread's partial is stored before the count says so
        arrived = tl.atomic_add(COUNTS + pid_n, 1)  # acq_rel, GPU scope
        if arrived == SPLIT_K - 1:  # the last program of this column block sums
            # Every program of the block has counted: back to zero for the next launch.
            tl.atomic_xchg(COUNTS + pid_n, 0)
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            total_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                # .cg: from L2, never a stale L1 line of an earlier launch
                total += tl.load(PARTIAL + s * plane + tile, mask=mask, other=0.0,
                                 cache_modifier=".cg")
                if SWIGLU:
                    total_up += tl.load(PARTIAL + (SPLIT_K + s) * plane + tile, mask=mask,
                                        other=0.0, cache_modifier=".cg")
            _epilogue(total, total_up, rows, cols, row_ok, col_ok, Y, RES, BIAS, stride_ym,
                      stride_rm, SWIGLU, RESIDUAL, HAS_BIAS, INTERPRET)


def config(m: int, n: int, k: int, *, norm: bool, swiglu: bool, sms: int,
           element_size: int = 2, shared: int = _SMEM_BUDGET + _SMEM_SPARE) -> dict:
    """Tiles for ``m`` rows, ``n`` output columns, ``k`` inputs of ``element_size``
    bytes: all rows in one tile and as many pipeline stages as fit the shared memory
    (at most 160 KB of the ``shared`` bytes a program may have, 0 where unknown; at least
    two stages: BLOCK_K shrinks until two fit, for float32 or a GPU of 99 KB). From the
    H200 sweep (qwen3-0.6b and llama3-8b projections at 16 and 64 rows, bf16, weights
    cycled through more memory than L2 holds): 32 columns a program, 64 for very wide
    outputs (LM heads); K split until the grid covers the SMs, each split keeping two
    BLOCK_K slices or more (one at up to 16 rows), only without the norm (the normed
    projections are wide: split, their gate/up took 13.4 us against 8.5)."""
    block_m = max(16, triton.next_power_of_2(m))
    block_k = 256 if k >= 512 else max(16, min(128, triton.next_power_of_2(k)))
    block_n = 64 if n >= 8192 else 32

    def per_stage(bk: int) -> int:  # the x tile and the weight tile(s) of one stage
        return element_size * bk * (block_m + block_n * (2 if swiglu else 1))

    budget = min(_SMEM_BUDGET, shared - _SMEM_SPARE) if shared else _SMEM_BUDGET
    while block_k > 32 and 2 * per_stage(block_k) > budget:
        block_k //= 2
    blocks = triton.cdiv(n, block_n)
    slices = triton.cdiv(k, block_k)
    # Slices a split keeps at least: two, one at up to 16 rows, where more splits won
    # (performance-history item 29).
    least = 1 if block_m <= 16 else 2
    split = 1
    while not norm and blocks * split < sms and slices >= 2 * least * split and split < 8:
        split *= 2
    stages = max(2, min(4, budget // per_stage(block_k)))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split,
            "num_warps": 4, "num_stages": stages}


def _prefetches(weight: torch.Tensor) -> bool:
    """Whether a PDL launch asks L2 for the whole weight (common.PREFETCH_BYTES); a
    module-level name, so probes can switch it."""
    return prefetches(weight)


def fused_rows(weight: torch.Tensor, kind: str) -> int:
    """Up to how many rows the fused kernels beat the unfused ops around cuBLAS on the
    H200 (bf16, weights cycled past L2), for ``kind`` "plain" (``rms_norm_linear``),
    "swiglu" or "residual". At one row and weights of up to 32 MB the GEMV form runs
    (:mod:`graphcap.opsdb.triton.gemv`: qwen3-0.6b's decode step at batch 1 0.953 ms
    against 1.176, ``docs/results/2026-12-03-bench-decode-gemv1-8b57f42-h200.json``); else
    the tensor-core kernel here (``docs/results/2026-12-01-bench-ops-linear-*``):

    - plain: no more. The norm prologue saves the ``rms_norm`` launch but slows the
      matmul: qwen3-0.6b's q/k/v at 16 rows 7.9 us against 7.3 unfused, llama3-8b's 28.9
      against 21.6, so the norm and cuBLAS run apart;
    - swiglu: 16 rows for weights of up to 16 MB (qwen3-0.6b's gate/up 8.6 us against
      10.0, a norm and an activation launch saved), none past that (llama3-8b's:
      cuBLAS streams them faster);
    - residual: 64 rows up to 16 MB (qwen3-0.6b's o 7.3 against 7.7 at 64 rows, down 8.1
      against 9.9) and 16 past it (llama3-8b's o and down at 16 rows, where cuBLAS
      catches up by 64)."""
    from graphcap.opsdb.triton.gemv import gemv_rows

    if kind not in ("plain", "swiglu", "residual"):
        raise ValueError(f"fused_rows: kind {kind!r} is not 'plain', 'swiglu' or 'residual'")
    small = weight.numel() * weight.element_size() <= 16 << 20
    gemv = gemv_rows(weight)
    if kind == "plain":
        return gemv
    if kind == "swiglu":
        return max(gemv, 16 if small else 0)
    return max(gemv, MAX_ROWS if small else 16)


def new_output(name: str, x: torch.Tensor, weight: torch.Tensor, swiglu: bool,
               max_rows: int, residual=None, bias=None
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A linear kernel's checks (at most ``max_rows`` rows, contiguous last dims, no
    residual or bias beside SwiGLU, whose epilogue has neither) and its new [M, N] output
    with (M, N, K)."""
    m, k = x.shape
    n = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if m > max_rows:
        raise ValueError(f"{name} takes at most {max_rows} rows, got {m}")
    if swiglu and (residual is not None or bias is not None):
        raise ValueError(f"{name}: swiglu=True takes no residual or bias (its epilogue "
                         "adds neither)")
    if (x.numel() and x.stride(1) != 1) or (weight.numel() and weight.stride(1) != 1):
        raise ValueError("x and weight need a contiguous last dim")
    return torch.empty(m, n, dtype=x.dtype, device=x.device), (m, n, k)


def up_offset(n: int, weight: torch.Tensor, swiglu: bool) -> int:
    """Elements from a gate row of ``weight`` to its up row (``n`` rows on; 0 without
    SwiGLU), a host int: past 2**31 the kernels take it as int64, where ``N *
    stride_wn`` in the kernel wrapped in int32."""
    return n * weight.stride(0) if swiglu else 0


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight=None,
                  eps: float = 1e-6, residual=None, bias=None, swiglu: bool = False,
                  tiles: dict | None = None) -> torch.Tensor:
    """``epilogue(prologue(x) @ weight^T)`` as one kernel, for ``x`` of at most
    :data:`MAX_ROWS` rows; a new [M, N] tensor (N = weight rows, or half of them with
    ``swiglu``). ``norm_weight``: RMSNorm x first; ``residual`` [M, N]: add it;
    ``swiglu``: silu(gate) * up over weight's two halves; ``tiles`` overrides
    :func:`config` (benchmarks and tests)."""
    y, (m, n, k) = new_output("skinny_linear", x, weight, swiglu, MAX_ROWS, residual, bias)
    if m == 0 or n == 0:
        return y
    cfg = {"NORM_LATE": False,
           **(tiles or config(m, n, k, norm=norm_weight is not None, swiglu=swiglu,
                              sms=num_sms(x.device), element_size=x.element_size(),
                              shared=shared_memory(x.device)))}
    split = cfg["SPLIT_K"]
    if cfg["NORM_LATE"] and split > 1:
        raise ValueError("skinny_linear: NORM_LATE needs the whole of K in one program "
                         f"(SPLIT_K 1), got SPLIT_K {split}")
    if cfg["NORM_LATE"] and norm_weight is not None and x.dtype == torch.float16:
        raise ValueError("skinny_linear: NORM_LATE rounds x * g, not yet normalised, to "
                         "x's dtype for the products, which overflows float16 past 65504: "
                         "give bfloat16 or float32 rows, or leave NORM_LATE off")
    blocks = triton.cdiv(n, cfg["BLOCK_N"])
    partial = (torch.empty((2 if swiglu else 1) * split * cfg["BLOCK_M"] * n,
                           dtype=torch.float32, device=x.device) if split > 1 else y)
    launch = pdl_args(x.device, m, "skinny_linear")
    counts = y if split == 1 else counters.zeroed(x.device, blocks, launch)
    res = residual if residual is not None else y
    _skinny_linear_kernel[(blocks, split)](
        x, weight, y, norm_weight if norm_weight is not None else x, res,
        bias if bias is not None else x, partial, counts,
        m, n, k, float(eps), x.stride(0), weight.stride(0), y.stride(0), res.stride(0),
        up_offset(n, weight, swiglu), NORM=norm_weight is not None, SWIGLU=swiglu,
        RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        INTERPRET=interpreting(), LINE=min(line_elements(weight), cfg["BLOCK_K"]),
        PREFETCH=launch["PDL"] and _prefetches(weight), **launch, **cfg)
    return y


def fused_linear(x: torch.Tensor, weight: torch.Tensor, **kw) -> torch.Tensor:
    """:func:`skinny_linear`'s product, in GEMV form where
    :func:`graphcap.opsdb.triton.gemv.dispatches` says it wins (decode at batch 1)."""
    from graphcap.opsdb.triton.gemv import dispatches, gemv_linear

    if dispatches(x, weight):
        return gemv_linear(x, weight, **kw)
    return skinny_linear(x, weight, **kw)


def rms_norm_linear(x, norm_weight, eps, weight, bias=None):
    return fused_linear(x, weight, norm_weight=norm_weight, eps=eps, bias=bias)


def rms_norm_swiglu(x, norm_weight, eps, weight):
    return fused_linear(x, weight, norm_weight=norm_weight, eps=eps, swiglu=True)


def linear_residual(x, weight, residual):
    return fused_linear(x, weight, residual=residual)


__all__ = ["MAX_ROWS", "config", "fused_linear", "fused_rows", "linear_residual",
           "new_output", "rms_norm_linear", "rms_norm_swiglu", "skinny_linear"]
