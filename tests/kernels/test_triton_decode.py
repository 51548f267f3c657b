"""The paged cache's K/V write and decode attention at model size, captured in a real CUDA
graph while every request is short and replayed with other block tables and lengths up to
the longest (the grid is fixed at capture; only the work inside it follows the lengths).
Random shapes, dtypes and NaN in unread slots are covered against the reference by the
opsdb property test (tests/opsdb/test_opsdb.py, Triton's interpreter without a GPU)."""

from __future__ import annotations

import pytest
import torch

from graphcap.kv import PagedKVCache
from graphcap.opsdb.decode import decode_attention_reference
from tests.conftest import requires_cuda


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_step_replays_from_short_capture_to_the_longest_lengths(dtype):
    from graphcap.core import new_pool
    from graphcap.opsdb.decode import DECODE_ATTENTION
    from graphcap.opsdb.kv import KV_WRITE

    B, hq, hk, d = 8, 16, 8, 128  # Qwen3-0.6B's attention shape
    cache = PagedKVCache(1, hk, d, max_requests=B, max_len=4096, page_size=16,
                         dtype=dtype, device="cuda")
    for slot in range(B):
        cache.admit(slot, 4096)
    k_cache, v_cache = cache.layer(0)
    k_cache.normal_()
    v_cache.normal_()
    rows = torch.arange(B, device="cuda")
    positions = torch.zeros(B, dtype=torch.long, device="cuda")
    lens = torch.ones(B, dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(B, h, d, device="cuda", dtype=dtype) for h in (hq, hk, hk))
    out = torch.empty_like(q)

    assert KV_WRITE.select("cuda") == DECODE_ATTENTION.select("cuda") == "triton"

    def step():
        KV_WRITE(k, v, k_cache, v_cache, cache.cache_loc(rows, positions))
        DECODE_ATTENTION(q, k_cache, v_cache, cache.block_table, lens, out, d ** -0.5)

    pool = new_pool("cuda")
    with pool.warmup():
        step()
    graph = pool.graph()
    graph.capture(step)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for longest in (1, 17, 1000, 4096):
        new_lens = torch.randint(1, longest + 1, (B,), device="cuda", generator=gen)
        positions.copy_(new_lens - 1)
        lens.copy_(new_lens)
        for t in (q, k, v):
            t.normal_(generator=gen)
        graph.replay()
        want = torch.empty_like(q)
        decode_attention_reference(q, k_cache, v_cache, cache.block_table, lens, want,
                                   d ** -0.5)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
        written = k_cache.view(-1, hk, d)[cache.cache_loc(rows, positions)]
        assert torch.equal(written, k)
