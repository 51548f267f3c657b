"""Varlen causal prefill attention in Triton (FlashAttention-2 style), no KV cache, GQA.

``attention_varlen`` computes, for every request packed along dim 0 of ``q``/``k``/``v``,
``softmax(q k^T * scale + causal_mask) v`` per query head, with query head ``h`` reading
key/value head ``h // (Hq // Hk)``. It matches :func:`graphcap.opsdb.reference.attention_varlen`.

Kernel. One program per (query head, block of ``BLOCK_M`` query rows, request). It loads its
query tile once, streams key/value tiles of ``BLOCK_N`` rows through an online softmax kept in
float32 (``exp2`` with ``scale * log2(e)`` folded into one multiplier), and writes its output
tile once. Under the causal mask the key blocks wholly below the diagonal run without any
mask; only the blocks that straddle the diagonal (or the request's end) are masked, and the
blocks above the diagonal are never visited. Rows of the grid whose block starts past their
request's length exit at once; the heaviest (last) query blocks are scheduled first.

Variants (:mod:`graphcap.opsdb.attention.variant`, each a constexpr flag, so the plain
kernel is unchanged): with a sliding window the key blocks wholly before every row's
window are never visited and those straddling its edge are masked; soft-capping applies
``softcap * tanh(s / softcap)`` to each scaled score before the base-2 softmax; a sink
logit per query head joins each row's normaliser at the end.

Capture contract. The launcher performs no host synchronisation and allocates nothing: the
grid is ``(Hq, cdiv(max_seqlen, BLOCK_M), R + 1)``, a function of host values only (the
tensors' shapes and the host int ``max_seqlen``, which is baked into a captured graph). A
graph captured once over static ``q``/``k``/``v``/``out``/``cu_seqlens`` buffers can be
replayed with different contents of those buffers, so long as every request length stays
``<= max_seqlen`` and ``cu_seqlens[-1] <= T``; the number of request slots ``R`` is fixed
by ``cu_seqlens``'s shape, and unused slots are zero-length ("sentinel") requests.

Padding rule. Rows outside ``[cu_seqlens[0], cu_seqlens[-1])`` are padding: the extra request
slot of the grid (index ``R``) writes zeros there, so ``out`` needs no zeroing by the caller.
Padding rows of ``q``/``k``/``v`` are never read into a real row's result: every key/value
load is masked to the request's own rows, so NaN or Inf in padding cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import (
    interpreting,
    num_sms,
    pdl_args,
    pdl_start,
    shared_memory,
)
from graphcap.opsdb.triton.decode_math import soft_cap

_LOG2E = 1.4426950408889634
_LOG2E_F = tl.constexpr(_LOG2E)


@triton.jit
def _rows(index, WIDE: tl.constexpr):
    """Row indices to multiply by a row stride: in int64 where the launch's rows times its
    widest row stride pass 2**31 elements (``WIDE``; in int32 they would wrap, and the
    kernel read and write out of bounds), else as they are (int32, the faster code)."""
    if WIDE:  # one return: the GPU compiler refuses two of different types
        index = index.to(tl.int64)
    return index


@triton.jit
def _load_keys(ptrs, rows, offs_d, MASKED: tl.constexpr, HEAD_DIM: tl.constexpr,
               EVEN_D: tl.constexpr):
    """A block of keys (or values): ``rows`` the in-request mask where MASKED; columns
    past HEAD_DIM (a head dim padded to a power of two) read as zeros."""
    if MASKED:
        if EVEN_D:
            return tl.load(ptrs, mask=rows[:, None], other=0.0)
        return tl.load(ptrs, mask=rows[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if EVEN_D:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _attn_step(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_n, offs_d,
               start_n, seqlen, qk_scale, sm_scale, window, softcap,
               MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
               INTERPRET: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
               HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr, WIDE: tl.constexpr):
    """One key block ``[start_n, start_n + BLOCK_N)`` of the online softmax.

    MASKED: mask keys past ``seqlen`` (and above the diagonal when CAUSAL, and before the
    window when WINDOW); otherwise every key of the block is valid for every row, and no
    mask is built at all. SOFTCAP: each score is soft-capped (in natural units) first.
    """
    cols = start_n + offs_n
    k_ptrs = k_base + _rows(cols, WIDE)[:, None] * stride_kt + offs_d[None, :]
    v_ptrs = v_base + _rows(cols, WIDE)[:, None] * stride_vt + offs_d[None, :]
    if MASKED:
        in_req = cols < seqlen
        k = _load_keys(k_ptrs, in_req, offs_d, True, HEAD_DIM, EVEN_D)
    else:
        k = _load_keys(k_ptrs, cols, offs_d, False, HEAD_DIM, EVEN_D)
    if INTERPRET:
        # Triton 3.6's interpreter multiplies bf16 dot operands as their uint16 bit patterns:
        # widen to float32 there (exact for 16-bit floats, as the tensor cores' products are).
        qk = tl.dot(q.to(tl.float32), tl.trans(k).to(tl.float32), input_precision="ieee")
    else:
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if SOFTCAP:
        qk = soft_cap(qk * sm_scale, softcap) * _LOG2E_F
    else:
        qk = qk * qk_scale
    if MASKED:
        keep = in_req[None, :]
        if CAUSAL:
            keep = keep & (offs_m[:, None] >= cols[None, :])
        if WINDOW:
            keep = keep & (cols[None, :] > offs_m[:, None] - window)
        qk = tl.where(keep, qk, float("-inf"))
    # Without a window, the first block a row visits holds at least one key it may see (the
    # masked blocks run first and start at a key <= every row of the tile, inside the
    # request), so m_new is finite from then on and no (-inf) - (-inf) NaN appears.
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    m_ref = m_new
    if WINDOW:  # a row may see no key of the block, nor of any block before it
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk - m_ref[:, None])
    alpha = tl.math.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if MASKED:
        # Masked keys have p == 0, but 0 * NaN is NaN: padding v must not be read.
        v = _load_keys(v_ptrs, in_req, offs_d, True, HEAD_DIM, EVEN_D)
    else:
        v = _load_keys(v_ptrs, cols, offs_d, False, HEAD_DIM, EVEN_D)
    p = p.to(v.dtype)
    if INTERPRET:
        acc = tl.dot(p.to(tl.float32), v.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(p, v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _attn_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, offs_m, offs_d,
                lo, hi, seqlen, qk_scale, sm_scale, window, softcap,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, WINDOW: tl.constexpr,
                SOFTCAP: tl.constexpr, HEAD_DIM: tl.constexpr, EVEN_D: tl.constexpr,
                WIDE: tl.constexpr):
    """Online softmax over key blocks ``[lo, hi)`` (``lo`` a multiple of ``BLOCK_N``)."""
    offs_n = tl.arange(0, BLOCK_N)
    if INTERPRET:
        # The interpreter cannot take tensor bounds in range() under numpy >= 2.4 (its
        # scalars are 1-element arrays); a while loop computes the same thing.
        start_n = lo
        while start_n < hi:
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       offs_m, offs_n, offs_d, start_n, seqlen, qk_scale,
                                       sm_scale, window, softcap, MASKED, CAUSAL,
                                       DOT_PRECISION, INTERPRET, WINDOW, SOFTCAP, HEAD_DIM,
                                       EVEN_D, WIDE)
            start_n += BLOCK_N
    else:
        # A for loop, so that Triton software-pipelines the K/V loads (num_stages).
        for start_n in tl.range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attn_step(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                       offs_m, offs_n, offs_d, start_n, seqlen, qk_scale,
                                       sm_scale, window, softcap, MASKED, CAUSAL,
                                       DOT_PRECISION, INTERPRET, WINDOW, SOFTCAP, HEAD_DIM,
                                       EVEN_D, WIDE)
    return acc, l_i, m_i


@triton.jit
def _attn_varlen_fwd(
    Q, K, V, Out, CU, SINKS, T, qk_scale, sm_scale, window, softcap,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    NUM_REQ, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    EVEN_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    WIDE: tl.constexpr,
):
    pdl_start(PDL)
    head = tl.program_id(0)
    num_m = tl.num_programs(1)
    m_block = num_m - 1 - tl.program_id(1)  # heaviest causal blocks first
    req = tl.program_id(2)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_r = tl.arange(0, BLOCK_M)

    if req == NUM_REQ:
        # Padding slot: zero this head's rows before cu_seqlens[0] and from cu_seqlens[-1]
        # to T, in BLOCK_M-row tiles strided over the grid's m programs.
        first = tl.load(CU)
        last = tl.load(CU + NUM_REQ)
        zeros = tl.zeros([BLOCK_M, BLOCK_D], dtype=Out.dtype.element_ty)
        o_head = Out + head * stride_oh
        step = num_m * BLOCK_M
        r0 = m_block * BLOCK_M
        while r0 < first:
            rows = r0 + offs_r
            tl.store(o_head + _rows(rows, WIDE)[:, None] * stride_ot + offs_d[None, :], zeros,
                     mask=(rows < first)[:, None] & d_ok[None, :])
            r0 += step
        r0 = last + m_block * BLOCK_M
        while r0 < T:
            rows = r0 + offs_r
            tl.store(o_head + _rows(rows, WIDE)[:, None] * stride_ot + offs_d[None, :], zeros,
                     mask=(rows < T)[:, None] & d_ok[None, :])
            r0 += step
        return

    start = tl.load(CU + req)
    seqlen = tl.load(CU + req + 1) - start
    m0 = m_block * BLOCK_M
    if m0 >= seqlen:
        return

    kv_head = head // GROUP
    offs_m = m0 + offs_r
    row_ok = offs_m < seqlen
    start64 = start.to(tl.int64)
    q_ptrs = (Q + start64 * stride_qt + head * stride_qh
              + _rows(offs_m, WIDE)[:, None] * stride_qt + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    k_base = K + start64 * stride_kt + kv_head * stride_kh
    v_base = V + start64 * stride_vt + kv_head * stride_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Masked blocks first, then the unmasked ones (the softmax is order-free). This order
    # also keeps the wgmma pipeline unserialised on sm90 (ptxas warns C7515 the other way).
    full_lo = 0
    if CAUSAL:
        # Masked: the diagonal blocks [m0, min(m0 + BLOCK_M, seqlen)). Unmasked: keys
        # [0, m0), below the diagonal for every row and inside the request (m0 < seqlen).
        full_hi = m0
        diag_hi = tl.minimum(m0 + BLOCK_M, seqlen)
    else:
        # Masked: the request's last, partial key block. Unmasked: all whole blocks.
        full_hi = (seqlen // BLOCK_N) * BLOCK_N
        diag_hi = seqlen
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                offs_m, offs_d, full_hi, diag_hi, seqlen, qk_scale, sm_scale,
                                window, softcap, BLOCK_N, True, CAUSAL, DOT_PRECISION,
                                INTERPRET, WINDOW, SOFTCAP, HEAD_DIM, EVEN_D, WIDE)
    if WINDOW:
        # Keys before m0 - window + 1 are out of every row's window: never visited. The
        # blocks from there up to the first one inside every row's window are masked.
        win_lo = (tl.maximum(m0 - window + 1, 0) // BLOCK_N) * BLOCK_N
        full_lo = tl.minimum(tl.maximum(
            tl.cdiv(tl.maximum(m0 + BLOCK_M - window, 0), BLOCK_N) * BLOCK_N, win_lo), m0)
        acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                    offs_m, offs_d, win_lo, full_lo, seqlen, qk_scale,
                                    sm_scale, window, softcap, BLOCK_N, True, CAUSAL,
                                    DOT_PRECISION, INTERPRET, WINDOW, SOFTCAP, HEAD_DIM,
                                    EVEN_D, WIDE)
    acc, l_i, m_i = _attn_inner(acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt,
                                offs_m, offs_d, full_lo, full_hi, seqlen, qk_scale, sm_scale,
                                window, softcap, BLOCK_N, False, CAUSAL, DOT_PRECISION,
                                INTERPRET, WINDOW, SOFTCAP, HEAD_DIM, EVEN_D, WIDE)

    if HAS_SINKS:  # the head's sink logit joins each row's softmax, with no value
        sink = tl.load(SINKS + head).to(tl.float32) * _LOG2E_F
        m_f = tl.maximum(m_i, sink)
        alpha = tl.math.exp2(m_i - m_f)
        l_i = l_i * alpha + tl.math.exp2(sink - m_f)
        acc = acc * alpha[:, None]
    acc = acc / l_i[:, None]
    o_ptrs = (Out + start64 * stride_ot + head * stride_oh
              + _rows(offs_m, WIDE)[:, None] * stride_ot + offs_d[None, :])
    tl.store(o_ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _config(head_dim: int, dtype: torch.dtype, programs_at_128: int, num_sms: int,
            interpret: bool, max_seqlen: int = 1 << 30, shared: int = 0
            ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for one launch.

    ``programs_at_128``: query-block programs the grid would have at BLOCK_M = 128 (host
    values only); ``shared``: the bytes a program may have (0: unknown). Tiles were
    checked against ptxas for sm_90a: no spills (fp32 D=128: 32 bytes), no serialised
    wgmma, shared memory <= 160 KiB; compiled for sm_89, every tile fits its 99 KB but
    head dim 256's, halved there.
    """
    if interpret:
        return 32, 16, 4, 1  # small tiles: fast on the CPU, still several blocks per request
    if dtype == torch.float32:
        return (64, 32, 8, 2) if head_dim <= 128 else (32, 16, 8, 2)
    if head_dim > 128:  # 104 KB of shared memory: half the tiles where a program has less
        return (64, 64, 8, 2) if not shared or shared >= 112 * 1024 else (32, 32, 4, 2)
    # Short buckets: a query tile no taller than the bucket, so no program computes rows
    # that are all padding (BLOCK_N must divide BLOCK_M: the causal loop starts its
    # unmasked blocks at the tile's first row).
    if max_seqlen <= 16:
        return 16, 16, 4, 2
    if max_seqlen <= 32:
        return 32, 32, 4, 2
    if max_seqlen <= 128:
        return 64, 32, 4, 2
    if programs_at_128 < num_sms:
        # Short buckets (e.g. 512 tokens): halve the query tile so the grid fills the chip.
        return 64, 64, 4, 3
    return (128, 64, 4, 3) if head_dim <= 64 else (128, 64, 8, 3)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                     cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
                     causal: bool = True, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen (causal) prefill attention; writes ``out`` in place and returns it.
    ``window`` (causal only), ``softcap`` and ``sinks`` (``[Hq]``):
    :mod:`graphcap.opsdb.attention.variant`.

    q [T, Hq, D]; k, v [T, Hk, D] with ``Hq % Hk == 0``; out [T, Hq, D], allocated by the
    caller. D in 1..256 (padded to a power of two of at least 16 in registers, the columns
    past D read as zeros); float32, float16 or bfloat16. The last dim of each
    tensor must be contiguous; the other strides are free (q/k/v may be views of one fused
    qkv tensor). ``cu_seqlens`` [R + 1] int32 on the device: request ``i`` owns rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (zero-length sentinel requests allowed anywhere).
    Rows outside ``[cu_seqlens[0], cu_seqlens[-1])`` are padding and come out zero, whatever
    q/k/v hold there.

    ``max_seqlen`` is a host int, an upper bound on every request's length (pass the token
    bucket); it fixes the grid. No host synchronisation, no allocation: safe to capture in a
    CUDA graph and replay with new contents of the same q/k/v/out/cu_seqlens buffers.
    """
    T, Hq, D = q.shape
    Hk = k.shape[1]
    if k.shape != (T, Hk, D) or v.shape != (T, Hk, D) or out.shape != (T, Hq, D):
        raise ValueError(f"shapes q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}, out {tuple(out.shape)} do not match")
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"query heads {Hq} must be a multiple of key/value heads {Hk}")
    if not 1 <= D <= 256:
        raise ValueError(f"head dim {D} must be in 1..256")
    if not (q.dtype == k.dtype == v.dtype == out.dtype):
        raise ValueError("q, k, v and out must share one dtype")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"unsupported dtype {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s last dim must be contiguous")
    if cu_seqlens.dtype != torch.int32 or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
        raise ValueError("cu_seqlens must be a 1-D int32 tensor [R + 1]")
    if cu_seqlens.device != q.device or not (q.device == k.device == v.device == out.device):
        raise ValueError("q, k, v, out and cu_seqlens must be on one device")
    num_req = cu_seqlens.numel() - 1
    if window and not causal:
        raise ValueError("a sliding window needs causal attention")
    if sinks is not None and (sinks.shape != (Hq,) or sinks.device != q.device):
        raise ValueError(f"sinks must be one value per query head [{Hq}] on {q.device}")
    if T == 0 or Hq == 0:
        return out

    interpret = interpreting()
    max_seqlen = max(int(max_seqlen), 1)
    if window >= max_seqlen:  # it cannot bind: no request is that long
        window = 0
    programs_at_128 = triton.cdiv(max_seqlen, 128) * num_req * Hq
    block_d = max(16, triton.next_power_of_2(D))
    block_m, block_n, num_warps, num_stages = _config(
        block_d, q.dtype, programs_at_128, num_sms(q.device), interpret, max_seqlen,
        shared_memory(q.device))
    num_m = triton.cdiv(max_seqlen, block_m)
    grid = (Hq, num_m, num_req + 1)
    # A row index (of q, k, v or out, up to T plus a tile past it) times a row stride:
    # int32 where it cannot pass 2**31, int64 past that (long requests of wide rows).
    widest = max(t.stride(0) for t in (q, k, v, out))
    wide = (max(T, max_seqlen) + block_m + block_n) * widest >= 2**31
    _attn_varlen_fwd[grid](
        q, k, v, out, cu_seqlens, cu_seqlens if sinks is None else sinks.contiguous(), T,
        float(scale) * _LOG2E, float(scale), int(window), float(softcap),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        num_req, GROUP=Hq // Hk, HEAD_DIM=D, BLOCK_D=block_d, EVEN_D=block_d == D,
        BLOCK_M=block_m, BLOCK_N=block_n, CAUSAL=bool(causal),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRET=interpret, WINDOW=window > 0, SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None, WIDE=wide, num_warps=num_warps, num_stages=num_stages,
        **pdl_args(q.device, T, "attention"),
    )
    return out


__all__ = ["attention_varlen"]
