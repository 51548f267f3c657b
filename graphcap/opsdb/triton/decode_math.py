"""The attention kernels' score arithmetic: soft-capping; decode attention's block of a
row's keys and values, its two products on tensor cores, and its attention over a split
on CUDA cores (for a GQA group of a few heads)."""

from __future__ import annotations

import triton
import triton.language as tl

from graphcap.opsdb.triton.common import cast, dot, table_row


@triton.jit
def soft_cap(scores, softcap):
    """``softcap * tanh(scores / softcap)``: tanh from exp (+-1 where exp overflows), and
    near zero from its series (``1 - 2 / (e^2x + 1)`` cancels there: where scores are
    small against the cap, e^2x rounds to 1 and every score would become 0)."""
    x = scores / softcap
    x2 = x * x
    series = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0))))
    return softcap * tl.where(tl.abs(x) < 0.125, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def kv_block(kc_ptr, table_row_ptr, pages, n0, read_end, head_off, slot_stride, d, d_mask,
             PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Tokens ``n0 .. n0 + BLOCK_N`` of a row (each token's page from its block table
    row), before ``read_end``: their mask, the offsets of their keys and values in the
    cache, the offsets' mask, and their keys."""
    t = n0 + tl.arange(0, BLOCK_N)
    t_mask = t < read_end
    page = tl.load(table_row_ptr + t // PAGE, mask=t_mask, other=0).to(tl.int64)
    page = table_row(page, pages)  # as the reference's k_cache[pages] reads it
    offs = (page * PAGE + t % PAGE)[:, None] * slot_stride + head_off + d[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    return t_mask, offs, kv_mask, tl.load(kc_ptr + offs, mask=kv_mask, other=0.0)


@triton.jit
def attend_in_lanes(q, kc_ptr, vc_ptr, table_row_ptr, pages, start, read_end, head_off,
                    slot_stride, d, d_mask, scale, softcap, SOFTCAP: tl.constexpr,
                    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, AHEAD: tl.constexpr):
    """Attention of heads ``q`` [BLOCK_H, BLOCK_D] over tokens ``start .. read_end`` of a
    row with CUDA-core products: each of ``BLOCK_N`` lanes keeps its own online softmax
    (maximum, sum, weighted values in float32) over the tokens it takes (one a block), so
    the loop exchanges nothing between threads but the sums of the scores' products; the
    lanes are merged once, after it. A block's values are asked for with its keys, and
    with ``AHEAD`` the next block's keys and values before this block's products. Returns
    the running maximum, the sum of the probabilities against it, and the unnormalised
    output [BLOCK_H, BLOCK_D], as the tensor-core loop leaves them. The probabilities stay
    float32 (not rounded to the cache's dtype as the tensor-core products round them)."""
    # Reshapes, not [None] indexing: Triton then keeps the loads' layout (a thread 8 of a
    # head dim's elements, 16 threads a token) for the products, with no exchange through
    # shared memory in the loop.
    qf = tl.reshape(q.to(tl.float32), [q.shape[0], 1, q.shape[1]])
    m = tl.full([q.shape[0], BLOCK_N], float("-inf"), tl.float32)
    l_sum = tl.zeros([q.shape[0], BLOCK_N], tl.float32)
    acc = tl.zeros([q.shape[0], BLOCK_N, q.shape[1]], tl.float32)
    if AHEAD:
        t_mask, offs, kv_mask, k = kv_block(kc_ptr, table_row_ptr, pages, start, read_end,
                                            head_off, slot_stride, d, d_mask, PAGE, BLOCK_N)
        v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
    for n0 in range(start, read_end, BLOCK_N):
        if AHEAD:  # the next block's (past read_end: masked, nothing read)
            t_next, offs, kv_mask, k_next = kv_block(kc_ptr, table_row_ptr, pages,
                                                     n0 + BLOCK_N, read_end, head_off,
                                                     slot_stride, d, d_mask, PAGE, BLOCK_N)
            v_next = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
        else:
            t_mask, offs, kv_mask, k = kv_block(kc_ptr, table_row_ptr, pages, n0, read_end,
                                                head_off, slot_stride, d, d_mask, PAGE,
                                                BLOCK_N)
            v = tl.load(vc_ptr + offs, mask=kv_mask, other=0.0)
        scores = tl.sum(qf * tl.reshape(k.to(tl.float32), [1, BLOCK_N, k.shape[1]]), axis=2)
        scores = scores * scale
        if SOFTCAP:
            scores = soft_cap(scores, softcap)
        scores = tl.where(t_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, scores)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a lane with no token yet
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe)
        acc = acc * alpha[:, :, None] + p[:, :, None] * tl.reshape(
            v.to(tl.float32), [1, BLOCK_N, v.shape[1]])
        l_sum = l_sum * alpha + p
        m = m_new
        if AHEAD:
            t_mask, k, v = t_next, k_next, v_next
    top = tl.max(m, axis=1)
    weight = tl.exp(m - tl.where(top == float("-inf"), 0.0, top)[:, None])
    return top, tl.sum(l_sum * weight, axis=1), tl.sum(acc * weight[:, :, None], axis=1)


@triton.jit
def scores_of(q, k, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """``q @ k.T`` in float32 for ``q`` [BLOCK_H, BLOCK_D] and ``k`` [BLOCK_N, BLOCK_D], a
    tensor-core product (``BLOCK_H`` at least 16)."""
    return dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), IEEE,
               INTERPRET)


@triton.jit
def add_weighted(acc, p, v, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc + p @ v`` in float32 for probabilities ``p`` [BLOCK_H, BLOCK_N] and values
    ``v`` [BLOCK_N, BLOCK_D], a tensor-core product of the probabilities rounded to the
    values' dtype (as FlashAttention does)."""
    return dot(cast(p, v.dtype, INTERPRET), v, acc, IEEE, INTERPRET)
