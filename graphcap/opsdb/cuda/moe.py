"""MXFP4 experts in operand order (:mod:`graphcap.opsdb.mxfp4`) by ``moe_mxfp4.cu``.

The same contract as :func:`graphcap.opsdb.triton.moe.moe_experts` (its routing
alignment, here by the extension's one-CTA ``align``, and its sum over the top-k slots;
a slot of an id outside [0, E) adds nothing): static shapes, no host synchronisation, so
a call is captured once and replayed with new routing."""

from __future__ import annotations

import torch

from graphcap.opsdb.cuda import extension, hopper
from graphcap.opsdb.triton.moe import sum_slots


def tile(num_pairs: int, num_experts: int, hopper: bool) -> tuple[str, int, int, int]:
    """(kernel, rows a tile, a, b) for about ``num_pairs / num_experts`` rows an expert:
    ``"mma"`` (mma.sync: a row blocks a warp, b warps) or, on Hopper, ``"wgmma"`` (warpgroup
    products: a 64-row blocks a warpgroup, b warpgroups). The fastest of the H200 sweeps of
    gpt-oss-120b's experts at 0.5, 4, 16 and 64 rows an expert
    (docs/notes/probes/moe_mxfp4_cuda.py, moe_mxfp4_wgmma.py)."""
    if num_pairs <= 8 * num_experts:
        return "mma", 8, 2, 4
    if hopper:
        return "wgmma", 32 if num_pairs <= 32 * num_experts else 64, 1, 2
    return "mma", 16, 4, 4


def moe_experts(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, alpha=0.0,
                limit=0.0, interleaved=False, w13_scale=None, w2_scale=None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``graphcap::moe_experts`` for MXFP4 experts in operand order, bf16 activations."""
    module = extension("moe_mxfp4")
    num_tokens = x.shape[0]
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    inter_size, hidden = 8 * w13.shape[1], 16 * w2.shape[1]
    if num_tokens == 0 or top_k == 0:
        return (x.new_empty(x.shape) if out is None else out).zero_()
    aligned = x.stride(1) == 1 and x.stride(0) % 8 == 0 and x.data_ptr() % 16 == 0
    xb = x if x.dtype == torch.bfloat16 and aligned else torch.empty(
        x.shape, dtype=torch.bfloat16, device=x.device).copy_(x)
    num_pairs = num_tokens * top_k
    weights = topk_weights.reshape(-1).float().contiguous()
    bias13, bias2 = (None if b is None else b.to(torch.bfloat16).contiguous() for b in (b13, b2))
    kernel, rows, a, b = tile(num_pairs, num_experts, hopper(x.device))
    launch = module.experts_wgmma if kernel == "wgmma" else module.experts
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    sorted_pairs, cum_padded = module.align(ids, num_experts, rows)
    inter = torch.empty(num_pairs, inter_size, dtype=torch.bfloat16, device=x.device)
    pairs = torch.empty(num_pairs, hidden, dtype=torch.bfloat16, device=x.device)
    for mode, (src, w, s, bias, dst) in enumerate(((xb, w13, w13_scale, bias13, inter),
                                                 (inter, w2, w2_scale, bias2, pairs))):
        launch(src, w, s, bias, sorted_pairs, cum_padded, weights, dst, mode, rows // 8, a, b,
               num_pairs, top_k, bool(interleaved), float(alpha), float(limit))
    # inter freed before out is made: the two may share memory (as the Triton kernels').
    del inter
    if out is None and x.dtype == torch.bfloat16:
        return sum_slots(pairs, ids, num_experts, x.new_empty(x.shape))
    summed = sum_slots(pairs, ids, num_experts, torch.empty_like(xb))
    return summed.to(x.dtype) if out is None else out.copy_(summed)
