"""The fused q/k/v kernel (split, qk-norm, rotary, contiguous outputs): its programs' heads
by token count, and at model size, captured in a real CUDA graph and replayed with new
inputs. Random shapes, dtypes and strides are covered against the reference by the opsdb
property test (tests/opsdb/test_opsdb.py, Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from graphcap.opsdb.qkv import qkv_reference
from graphcap.opsdb.reference import rope_cache
from tests.conftest import requires_cuda

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def inputs(T, hq, hk, d, dtype, seed, norm, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(T, (hq + 2 * hk) * d, generator=g).to(device, dtype)
    w = [torch.rand(d, generator=g).to(device, dtype) + 0.5 for _ in range(2)] if norm \
        else [None, None]
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    cache = rope_cache(d, 4096, 1e6).to(device)
    return qkv, positions, w, cache


@pytest.mark.parametrize("T,hq,hk,d,norm", [(1, 16, 8, 128, True), (16, 16, 8, 128, True),
                                            (160, 16, 8, 128, True), (40, 64, 8, 64, False),
                                            (48, 40, 8, 64, True)],
                         ids=["decode row", "16 tokens", "qwen3, 160 tokens",
                              "gpt-oss, 40 tokens", "56 heads in tiles of 32"])
def test_many_tokens_take_several_heads_a_program_with_the_references_result(T, hq, hk, d,
                                                                           norm):
    """A program takes one head while the tokens are few (a decode row, 16 tokens of
    qwen3-0.6b) and up to a tile of heads past that, the last tile partly past the heads
    (56 in tiles of 32). Each against the unfused reference (on the CPU, Triton's
    interpreter)."""
    from graphcap.opsdb.triton.qkv import SINGLE, heads_per_program, qkv_norm_rope

    heads = hq + 2 * hk
    block = heads_per_program(heads, T, d)
    assert block == 1 if heads * T <= SINGLE else block > 1
    qkv, positions, (qw, kw), cache = inputs(T, hq, hk, d, torch.bfloat16, T, norm, DEVICE)
    got = qkv_norm_rope(qkv, positions, qw, kw, cache, hq, hk, d, 1e-6)
    want = qkv_reference(qkv, positions, qw, kw, cache, hq, hk, d, 1e-6)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


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
