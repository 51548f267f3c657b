"""MoE routing in Triton: softmax over the experts, then the top-k, one program per token
(specification: :func:`graphcap.opsdb.reference.moe_topk_softmax`). The softmax runs
over the E router logits in float32 registers, then k rounds of arg-max over the logits
(ties go to the lowest expert id; a NaN logit ranks first, as in torch.topk, and a NaN
or +inf logit makes the row's weights NaN; every id names an expert). And the grouping
of the routed (token, slot) pairs by expert that the expert kernels tile
(:func:`align_pairs`). No host synchronisation: safe to capture in a CUDA graph."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["align_pairs", "moe_topk_softmax", "rows_per_tile"]


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr,
    num_experts, stride_lt, stride_le,
    TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    emask = offs_e < num_experts
    x = tl.load(logits_ptr + t * stride_lt + offs_e * stride_le, mask=emask,
                other=-float("inf")).to(tl.float32)
    m = tl.max(x, axis=0)
    p = tl.exp(x - m)
    p = tl.where(emask, p, 0.0)
    probs = p / tl.sum(p, axis=0)

    # The rounds rank the logits, not the probabilities (two logits a few ulps apart can
    # round to one probability, and the GPU's exp is not correctly rounded): a NaN logit
    # first, as torch.topk ranks it, then the largest; ties to the lowest expert id.
    # Padding lanes are never live.
    nan = x != x
    live = emask
    offs_k = tl.arange(0, BLOCK_K)
    top_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        any_nan = tl.max((live & nan).to(tl.int32), axis=0) > 0
        best = tl.max(tl.where(live & ~nan, x, -float("inf")), axis=0)
        pick = live & tl.where(any_nan, nan, x == best)
        idx = tl.min(tl.where(pick, offs_e, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(offs_e == idx, probs, 0.0), axis=0)
        top_w = tl.where(offs_k == j, weight, top_w)
        top_i = tl.where(offs_k == j, idx, top_i)
        live = live & (offs_e != idx)
    kmask = offs_k < TOP_K
    if RENORMALIZE:
        top_w = top_w / tl.sum(tl.where(kmask, top_w, 0.0), axis=0)
    tl.store(weights_ptr + t * TOP_K + offs_k, top_w, mask=kmask)
    tl.store(ids_ptr + t * TOP_K + offs_k, top_i, mask=kmask)


def moe_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the top-k, per token (one Triton program per token).

    router_logits [T, E] (any float dtype, E <= 256 recommended; computed in float32).
    Returns ``(weights [T, top_k] float32, ids [T, top_k] int32)``, ordered by decreasing
    logit (ties: lowest expert id first), the experts torch.topk over the logits picks.
    With ``renormalize`` the k weights of a token sum to 1. No host synchronisation: safe
    to capture in a CUDA graph.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got {tuple(router_logits.shape)}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, E={num_experts}]")
    device = router_logits.device
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    _topk_softmax_kernel[(num_tokens,)](
        router_logits, weights, ids,
        num_experts, router_logits.stride(0), router_logits.stride(1),
        TOP_K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        RENORMALIZE=bool(renormalize),
        num_warps=4 if block_e >= 512 else (2 if block_e >= 128 else 1),
    )
    return weights, ids


def rows_per_tile(num_pairs: int, num_experts: int) -> int:
    """Rows per tile, from host shapes only: small tiles waste less padding when few
    pairs land on each expert (tl.dot needs at least 16 rows)."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16
    if per_expert <= 64:
        return 32
    return 64


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group the (token, slot) pairs by expert, each expert padded to ``block_m`` rows.

    Returns ``sorted_pairs`` [N + E*(block_m-1)] int32 (pair ids in expert order, N in
    padding rows) and ``cum_padded`` [E] int32 (end row of each expert's padded group;
    the last entry is the number of rows in use). A pair whose id names no expert
    (outside ``[0, E)``: expert parallelism's -1, say) is in no group, only ever past the
    rows in use. Static shapes, no host sync.
    """
    device = topk_ids.device
    ids = topk_ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    capacity = n + num_experts * (block_m - 1)
    # An id of no expert to a group E after the others' (-1 and E to E, as any id past
    # them): grouped as an expert's, its rows fall past the rows in use (and short of
    # the capacity: the experts' padding is at most E*(block_m-1)).
    ids = ids.clamp(-1, num_experts).remainder_(num_experts + 1)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, ids, torch.ones_like(ids))
    padded = (counts + (block_m - 1)) // block_m * block_m
    cum_padded = padded.cumsum(0)
    # shift from a pair's rank in the unpadded sorted order to its padded row
    shift = (cum_padded - padded) - (counts.cumsum(0) - counts)
    sorted_ids, order = torch.sort(ids, stable=True)
    rows = torch.arange(n, device=device, dtype=torch.int64) + shift.index_select(0, sorted_ids)
    sorted_pairs = torch.full((capacity,), n, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, rows, order.to(torch.int32))
    return sorted_pairs, cum_padded[:num_experts].to(torch.int32)
