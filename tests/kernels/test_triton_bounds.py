"""Indices the Triton kernels cannot check on the host (that would need a sync): K/V
places, rotary positions, block-table pages. A kernel reads a table's row as the
reference's torch indexing does (a negative index from the end) and never reads or writes
the memory around a tensor. Each tensor here lies inside a larger buffer of sentinels, so
a stray access shows."""

from __future__ import annotations

import pytest
import torch

from graphcap.errors import OpInputError
from graphcap.opsdb import get_op, reference

device = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if device == "cuda" else []
P, S, HK, D = 3, 2, 1, 16


@pytest.fixture(autouse=True)
def _triton_runs_here():
    if get_op("kv_write").available(device)["triton"] is not None:
        pytest.skip("the Triton kernels: on a GPU or under Triton's interpreter")


def inside(shape, fill: float, *, dtype=torch.float32):
    """(buffer, view): a contiguous ``shape`` in the middle of a buffer of ``fill``."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((3 * n,), fill, dtype=dtype, device=device)
    return buf, buf[n:2 * n].view(shape)


def around(buf: torch.Tensor) -> torch.Tensor:
    n = buf.numel() // 3
    return torch.cat([buf[:n], buf[2 * n:]])


@pytest.mark.parametrize("slot", [-1, P * S, 2 * P * S - 1])
def test_kv_write_to_a_slot_outside_the_cache_writes_nothing_around_it(slot):
    # The reference refuses the slot (index_copy_); the kernel wrote before or past the
    # cache tensor: on a GPU, whatever tensor lies there.
    kbuf, k_cache = inside((P, S, HK, D), 0.0)
    vbuf, v_cache = inside((P, S, HK, D), 0.0)
    k = torch.ones(2, HK, D, device=device)
    get_op("kv_write")(k, 2 * k, k_cache, v_cache, torch.tensor([slot, 1], device=device),
                       kernel="triton")
    assert (around(kbuf) == 0).all() and (around(vbuf) == 0).all()
    assert (k_cache.view(P * S, HK, D)[1] == 1).all()  # the slot inside: written
    assert (v_cache.view(P * S, HK, D)[1] == 2).all()
    assert int((k_cache != 0).sum()) == HK * D


def test_kv_write_of_no_kv_heads_or_no_head_dim_writes_nothing_as_the_reference():
    # The launch took tl.arange(0, 0) and failed.
    for heads, dim in ((0, D), (HK, 0)):
        k = torch.ones(2, heads, dim, device=device)
        caches = [torch.zeros(P, S, heads, dim, device=device) for _ in range(2)]
        get_op("kv_write")(k, k, *caches, torch.tensor([0, 1], device=device),
                           kernel="triton")


def test_decode_attentions_own_write_to_a_slot_outside_the_cache_writes_nothing_around_it():
    kbuf, k_cache = inside((P, S, HK, D), 0.0)
    vbuf, v_cache = inside((P, S, HK, D), 0.0)
    q = torch.randn(1, 2, D, device=device)
    new = torch.ones(1, HK, D, device=device)
    out = torch.empty_like(q)
    get_op("decode_attention")(q, k_cache, v_cache,
                               torch.tensor([[1]], dtype=torch.int32, device=device),
                               torch.tensor([1], dtype=torch.int32, device=device), out,
                               0.25, 0, 0.0, None, new, new,
                               torch.tensor([-1], device=device), kernel="triton")
    assert (around(kbuf) == 0).all() and (around(vbuf) == 0).all()
    assert (k_cache == 0).all() and (v_cache == 0).all()


def test_decode_attention_reads_a_negative_page_as_the_reference_indexes_it():
    # k_cache[pages] counts -1 from the end; the kernel read the page before the cache.
    g = torch.Generator().manual_seed(0)
    outs = {}
    for kernel in ("torch", "triton"):
        caches = []
        for _ in range(2):
            _, cache = inside((P, S, HK, D), 50.0)
            cache.copy_(torch.randn(P, S, HK, D, generator=g.manual_seed(1)))
            caches.append(cache)
        q = torch.randn(2, 2, D, generator=g.manual_seed(2)).to(device)
        table = torch.tensor([[0, -1], [-3, 1]], dtype=torch.int32, device=device)
        out = torch.empty_like(q)
        get_op("decode_attention")(q, *caches, table,
                                   torch.tensor([4, 3], dtype=torch.int32, device=device),
                                   out, 0.25, kernel=kernel)
        outs[kernel] = out
    torch.testing.assert_close(outs["triton"], outs["torch"])


def rope_table(rows: int, rot: int) -> torch.Tensor:
    """The neox cos/sin table in a buffer of 7s."""
    _, table = inside((rows, rot), 7.0)
    table.copy_(reference.rope_cache(rot, rows, 1e4))
    return table


def test_rotary_and_qkv_norm_rope_read_a_negative_position_from_the_tables_end():
    cache = rope_table(8, 16)
    positions = torch.tensor([2, -1, -8], device=device)
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(3, n, generator=g).to(device) for n in (32, 16))
    rotated = {}
    for kernel in ("torch", "triton"):
        qq, kk = q.clone(), k.clone()
        get_op("rotary_embedding")(positions, qq, kk, cache, 16, kernel=kernel)
        rotated[kernel] = (qq, kk)
    torch.testing.assert_close(rotated["triton"], rotated["torch"])
    qkv = torch.randn(3, 64, generator=g).to(device)
    w = torch.rand(16, generator=g).to(device) + 0.5
    outs = {kernel: get_op("qkv_norm_rope")(qkv, positions, w, w, cache, 2, 1, 16, 1e-6,
                                            kernel=kernel) for kernel in ("torch", "triton")}
    torch.testing.assert_close(outs["triton"], outs["torch"])


def test_rotary_reads_no_row_outside_its_table_at_a_position_the_reference_refuses():
    # Past the table (or before its start): the nearest row, not the buffer's 7s.
    cache = rope_table(8, 16)
    q, k = torch.ones(2, 16, device=device), torch.ones(2, 16, device=device)
    get_op("rotary_embedding")(torch.tensor([8, -9], device=device), q, k, cache, 16,
                               kernel="triton")
    want_q, want_k = torch.ones(2, 16, device=device), torch.ones(2, 16, device=device)
    reference.rotary_embedding(torch.tensor([7, 0], device=device), want_q, want_k, cache,
                               16)
    torch.testing.assert_close((q, k), (want_q, want_k))


def test_decode_attentions_rotary_reads_a_negative_position_from_the_tables_end():
    cache = rope_table(8, D)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, D, generator=g).to(device)
    new = torch.randn(1, HK, D, generator=g).to(device)
    base = torch.randn(P, S, HK, D, generator=g).to(device)
    outs = {}
    for kernel in ("torch", "triton"):
        kc, vc, out = base.clone(), base.clone(), torch.empty_like(q)
        get_op("decode_attention")(q, kc, vc,
                                   torch.tensor([[1, 2]], dtype=torch.int32, device=device),
                                   torch.tensor([3], dtype=torch.int32, device=device), out,
                                   0.25, 0, 0.0, None, new, new,
                                   torch.tensor([4], device=device),
                                   torch.tensor([-1], device=device), None, None, cache,
                                   kernel=kernel)
        outs[kernel] = (out, kc)
    torch.testing.assert_close(outs["triton"], outs["torch"])


def test_tables_of_no_rows_are_refused_at_the_checks():
    # The references raised IndexError; the kernels would read before the table.
    pos = torch.zeros(2, dtype=torch.long)
    empty = torch.zeros(0, 16)
    with pytest.raises(OpInputError, match="cos_sin_cache has no rows"):
        get_op("rotary_embedding")(pos, torch.ones(2, 16), torch.ones(2, 16), empty, 16)
    with pytest.raises(OpInputError, match="cos_sin_cache has no rows"):
        get_op("qkv_norm_rope")(torch.ones(2, 48), pos, None, None, empty, 1, 1, 16, 1e-6)
    with pytest.raises(OpInputError, match="k_cache has no pages"):
        get_op("decode_attention")(torch.ones(1, 1, 16), torch.ones(0, 4, 1, 16),
                                   torch.ones(0, 4, 1, 16),
                                   torch.zeros(1, 1, dtype=torch.int32),
                                   torch.ones(1, dtype=torch.int32), torch.empty(1, 1, 16),
                                   0.25)
