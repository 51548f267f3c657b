"""The fused q/k/v kernel (split, qk-norm, rotary, contiguous outputs) at model size,
captured in a real CUDA graph and replayed with new inputs. Random shapes, dtypes and
strides are covered against the reference by the opsdb property test (tests/opsdb/test_opsdb.py,
Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from graphcap.opsdb.qkv import qkv_reference
from graphcap.opsdb.reference import rope_cache
from tests.conftest import requires_cuda


def inputs(T, hq, hk, d, dtype, seed, norm):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to("cuda", dtype)
    w = [torch.rand(d, generator=g).to("cuda", dtype) + 0.5 for _ in range(2)] if norm \
        else [None, None]
    positions = torch.randint(0, 4096, (T,), generator=g).to("cuda")
    cache = rope_cache(d, 4096, 1e6).to("cuda")
    return qkv, positions, w, cache


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("norm", [True, False], ids=["qwen3-qk-norm", "llama"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_model_sized_qkv_kernel_replays_in_a_cuda_graph(dtype, norm):
    from graphcap.core import new_pool
    from graphcap.opsdb.triton.qkv import qkv_norm_rope

    T, hq, hk, d, eps = 37, 16, 8, 128, 1e-6  # Qwen3-0.6B's attention shape
    qkv, positions, (qw, kw), cache = inputs(T, hq, hk, d, dtype, 0, norm)
    pool = new_pool("cuda")
    with pool.warmup():
        qkv_norm_rope(qkv, positions, qw, kw, cache, hq, hk, d, eps)
    graph = pool.graph()
    outs = graph.capture(qkv_norm_rope, qkv, positions, qw, kw, cache, hq, hk, d, eps)
    for seed in (1, 2):
        new_qkv, new_pos, _, _ = inputs(T, hq, hk, d, dtype, seed, norm)
        qkv.copy_(new_qkv)
        positions.copy_(new_pos)
        graph.replay()
        torch.cuda.synchronize()
        want = qkv_reference(new_qkv, new_pos, qw, kw, cache, hq, hk, d, eps)
        for got, ref in zip(outs, want, strict=True):
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
