"""The attention kernels' score arithmetic: soft-capping, and decode attention's two
products in either form (tensor cores, or CUDA cores for a GQA group of a few heads)."""

from __future__ import annotations

import triton
import triton.language as tl

from graphcap.opsdb.triton.common import cast, dot


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
def scores_of(q, k, IEEE: tl.constexpr, INTERPRET: tl.constexpr, CUDA_CORES: tl.constexpr):
    """``q @ k.T`` in float32 for ``q`` [BLOCK_H, BLOCK_D] and ``k`` [BLOCK_N, BLOCK_D]:
    a tensor-core product (``BLOCK_H`` at least 16), or with ``CUDA_CORES`` products
    and sums in registers (any ``BLOCK_H``: a GQA group of 2 computes 2 rows, not 16)."""
    if CUDA_CORES:
        return tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
    else:
        return dot(q, tl.trans(k), tl.zeros([q.shape[0], k.shape[0]], tl.float32), IEEE,
                   INTERPRET)


@triton.jit
def add_weighted(acc, p, v, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
                 CUDA_CORES: tl.constexpr):
    """``acc + p @ v`` in float32 for probabilities ``p`` [BLOCK_H, BLOCK_N] and values
    ``v`` [BLOCK_N, BLOCK_D], the probabilities rounded to the values' dtype first (as
    FlashAttention does), in either form of :func:`scores_of`."""
    p = cast(p, v.dtype, INTERPRET)
    if CUDA_CORES:
        return acc + tl.sum(p.to(tl.float32)[:, :, None] * v.to(tl.float32)[None, :, :],
                            axis=1)
    else:
        return dot(p, v, acc, IEEE, INTERPRET)
