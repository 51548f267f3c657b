"""FlashInfer kernels behind opsdb's signatures (imported only when selected).

FlashInfer's kernels take float16/bfloat16 (the Kernel entries say so) and reject an
empty launch (seen on the H200: T == 0 gave an invalid launch configuration), so empty
inputs return without calling them.
"""

from __future__ import annotations

import flashinfer
import torch


def rms_norm(x, weight, eps):
    if x.shape[0] == 0:
        return torch.empty_like(x)
    return flashinfer.norm.rmsnorm(x, weight, eps)


def fused_add_rms_norm(x, residual, weight, eps):
    if x.shape[0]:
        flashinfer.norm.fused_add_rmsnorm(x, residual, weight, eps)


def silu_and_mul(x):
    if x.shape[0] == 0:
        return x.new_empty(0, x.shape[1] // 2)
    return flashinfer.activation.silu_and_mul(x)


def rotary_embedding(positions, query, key, cos_sin_cache, head_size):
    if positions.shape[0] == 0:
        return
    # FlashInfer reads a float32 cache; keep it float32 to avoid a cast per call.
    if cos_sin_cache.dtype != torch.float32:
        cos_sin_cache = cos_sin_cache.float()
    flashinfer.rope.apply_rope_with_cos_sin_cache_inplace(
        positions, query, key, head_size, cos_sin_cache, is_neox=True)
