"""Split-KV decode attention over a paged cache (contract: :mod:`graphcap.opsdb.decode`).

Stage 1, grid ``(rows, query heads, splits)``: each program walks its split of the row's
tokens in blocks of ``BLOCK_N`` (each token's page from the block table), with an online
softmax in float32, and writes its partial output and log-sum-exp; a split past the row's
length writes an empty partial (LSE ``-inf``). Stage 2, grid ``(rows, query heads)``:
merges the partials by their LSEs (and the head's sink logit, which joins the softmax
with no value); a row with no token comes out zero, not 0/0. With a window the splits
cover only the row's last ``window`` tokens: the K/V read is bounded by the window, not
the context; soft-capping applies to each score before the online softmax. The
split count follows from host shapes only (rows, heads, the block table's width, the
SMs), so the grid is fixed at capture and a replay's lengths change only the work inside
it. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton.common import cast, interpreting, num_sms

_MAX_SPLITS = 32


@triton.jit
def soft_cap(scores, softcap):
    """``softcap * tanh(scores / softcap)``, tanh from exp (+-1 where exp overflows)."""
    return softcap * (1.0 - 2.0 / (tl.exp(2.0 * (scores / softcap)) + 1.0))


@triton.jit
def _decode_split_kernel(q_ptr, kc_ptr, vc_ptr, table_ptr, lens_ptr, mid_o_ptr, mid_lse_ptr,
                         q_stride_b, q_stride_h, table_stride, width, heads, kv_heads,
                         head_dim, split_len, scale, window, softcap,
                         PAGE: tl.constexpr, GROUP: tl.constexpr, SPLITS: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    kvh = h // GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    length = tl.minimum(tl.load(lens_ptr + b), width * PAGE)
    lo = 0
    if WINDOW:  # the splits cover the window only: the read is bounded by it
        lo = tl.maximum(length - window, 0)
    start = lo + s * split_len
    end = tl.minimum(start + split_len, length)
    q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + h * q_stride_h + d, mask=d_mask,
                other=0.0).to(tl.float32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), axis=0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), axis=0)
    acc = tl.zeros([BLOCK_D], tl.float32)
    slot_stride = kv_heads * head_dim
    for n0 in range(start, end, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)
        t_mask = t < end
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // PAGE, mask=t_mask,
                       other=0).to(tl.int64)
        slot = page * PAGE + t % PAGE
        offs = slot[:, None] * slot_stride + kvh * head_dim + d[None, :]
        kv_mask = t_mask[:, None] & d_mask[None, :]
        k = tl.load(kc_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(t_mask, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))  # finite: a token is in the block
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    row = (b.to(tl.int64) * heads + h) * SPLITS + s
    # Empty by its token count, not by l_i: NaN in the row's own tokens stays NaN.
    has = end > start
    safe = tl.where(has, l_i, 1.0)  # an empty split: no 0/0 even where it is not kept
    tl.store(mid_o_ptr + row * BLOCK_D + d, tl.where(has, acc / safe, 0.0))
    tl.store(mid_lse_ptr + row, tl.where(has, m_i + tl.log(safe), float("-inf")))


@triton.jit
def _decode_merge_kernel(mid_o_ptr, mid_lse_ptr, sinks_ptr, out_ptr, out_stride_b,
                         out_stride_h, heads, head_dim, SPLITS: tl.constexpr,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
                         SINKS: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    row = (b.to(tl.int64) * heads + h) * SPLITS
    lse = tl.load(mid_lse_ptr + row + s, mask=s < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    if SINKS:  # the head's sink logit joins the softmax, with no value
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        top = tl.maximum(top, sink)
    top = tl.where(top == float("-inf"), 0.0, top)  # a row with no token: every weight 0
    weight = tl.where(lse == float("-inf"), 0.0, tl.exp(lse - top))  # NaN passes
    parts = tl.load(mid_o_ptr + (row + s)[:, None] * BLOCK_D + d[None, :],
                    mask=(s < SPLITS)[:, None], other=0.0)
    total = tl.sum(weight, axis=0)
    if SINKS:
        total += tl.exp(sink - top)
    o = tl.sum(weight[:, None] * parts, axis=0)
    o = tl.where(total == 0, 0.0, o / tl.where(total == 0, 1.0, total))
    tl.store(out_ptr + b.to(tl.int64) * out_stride_b + h * out_stride_h + d,
             cast(o, out_ptr.dtype.element_ty, INTERPRET), mask=d < head_dim)


def splits_for(rows: int, heads: int, max_len: int, block_n: int, sms: int) -> int:
    """Splits per (row, head): enough programs to fill the SMs twice over, no split
    shorter than one block, at most ``_MAX_SPLITS``."""
    blocks = triton.cdiv(max(max_len, 1), block_n)
    wanted = triton.cdiv(2 * sms, max(rows * heads, 1))
    return max(1, min(blocks, wanted, _MAX_SPLITS))


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                     scale: float, window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None, num_splits: int | None = None
                     ) -> None:
    B, Hq, D = q.shape
    _, page, Hk, _ = k_cache.shape
    if B == 0 or Hq == 0:
        return
    width = block_table.shape[1]
    if window >= width * page:  # it cannot bind: every row's tokens lie inside it
        window = 0
    max_len = window or width * page  # the most tokens a row reads
    interpret = interpreting()
    block_n = 16 if interpret else 32
    if num_splits is None:  # the interpreter: several splits, so the merge is exercised
        num_splits = (max(1, min(triton.cdiv(max_len, block_n), 4)) if interpret else
                      splits_for(B, Hq, max_len, block_n, num_sms(q.device)))
    if isinstance(num_splits, bool) or not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    split_len = triton.cdiv(triton.cdiv(max_len, num_splits), block_n) * block_n
    block_d = triton.next_power_of_2(D)
    mid_o = torch.empty((B, Hq, num_splits, block_d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((B, Hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(B, Hq, num_splits)](
        q, k_cache, v_cache, block_table, seq_lens, mid_o, mid_lse,
        q.stride(0), q.stride(1), block_table.stride(0), width, Hq, Hk, D, split_len,
        float(scale), int(window), float(softcap), PAGE=page, GROUP=Hq // Hk,
        SPLITS=num_splits, BLOCK_N=block_n, BLOCK_D=block_d, WINDOW=window > 0,
        SOFTCAP=softcap > 0, num_warps=4 if block_d >= 128 else 2)
    _decode_merge_kernel[(B, Hq)](
        mid_o, mid_lse, mid_lse if sinks is None else sinks.contiguous(), out, out.stride(0),
        out.stride(1), Hq, D, SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=block_d, SINKS=sinks is not None, INTERPRET=interpret, num_warps=1)


__all__ = ["decode_attention", "splits_for"]
