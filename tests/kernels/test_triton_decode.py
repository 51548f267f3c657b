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


ROPE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.gpu if ROPE_DEVICE == "cuda" else (lambda test: test)
@pytest.mark.parametrize("hq,hk,d,rot,norm,splits", [
    (4, 2, 128, 128, True, 3), (4, 2, 64, 32, False, 1), (2, 1, 128, 128, False, 2)],
    ids=["qwen3-like, qk-norm, 3 splits", "partial rotary, no norm", "llama-like, 2 splits"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_rotating_the_projections_rows_equals_the_qkv_kernel_then_attention(
        hq, hk, d, rot, norm, splits, dtype):
    """A decode step handed the projection's rows (views, not copies) with positions and
    the rotary cache normalises and rotates q and the own key in the attention kernel:
    the output and the key it writes are those of ``graphcap::qkv_norm_rope``'s kernel
    followed by the attention kernel, and of the reference (on the CPU, Triton's
    interpreter)."""
    from graphcap.opsdb.qkv import heads_of
    from graphcap.opsdb.reference import rope_cache
    from graphcap.opsdb.triton.decode import decode_attention
    from graphcap.opsdb.triton.qkv import qkv_norm_rope

    dev, page, width, B = ROPE_DEVICE, 16, 4, 3
    g = torch.Generator().manual_seed(hq * d + rot + splits)
    lens = torch.tensor([1, 17, width * page], dtype=torch.int32)  # a page's edge, the end
    table = (torch.randperm(B * width, generator=g) + 1).view(B, width).to(torch.int32)
    last = lens.long() - 1
    loc = table.long().gather(1, (last // page)[:, None])[:, 0] * page + last % page
    caches = [torch.randn(B * width + 1, page, hk, d, generator=g).to(dev, dtype)
              for _ in range(2)]
    qkv = torch.randn(B, (hq + 2 * hk) * d + 8, generator=g).to(dev, dtype)[:, :-8]
    weights = [torch.rand(d, generator=g).to(dev, dtype) + 0.5 for _ in range(2)] if norm \
        else [None, None]
    cos_sin = rope_cache(rot, 4096, 1e6).to(dev)
    positions = (last + 1000).to(dev)  # any position the cache holds
    table, lens, loc = table.to(dev), lens.to(dev), loc.to(dev)
    scale = d ** -0.5

    unfused = [t.clone() for t in caches]
    q, k, v = qkv_norm_rope(qkv, positions, *weights, cos_sin, hq, hk, d, 1e-6)
    want = torch.empty(B, hq, d, device=dev, dtype=dtype)
    decode_attention(q, *unfused, table, lens, want, scale, k=k, v=v, cache_loc=loc,
                     num_splits=splits)

    q_rows, k_rows, v_rows = heads_of(qkv, hq, hk, d)
    for late in (False, True):  # the own key's work before or after the loop
        fused = [t.clone() for t in caches]
        out = torch.empty_like(want)
        decode_attention(q_rows, *fused, table, lens, out, scale, k=k_rows, v=v_rows,
                         cache_loc=loc, positions=positions, q_weight=weights[0],
                         k_weight=weights[1], cos_sin_cache=cos_sin, num_splits=splits,
                         tiles={"KEY_LATE": late})
        torch.testing.assert_close(fused, unfused)
        torch.testing.assert_close(out, want)

    reference = [t.clone() for t in caches]
    ref = torch.empty_like(want)
    decode_attention_reference(q_rows, *reference, table, lens, ref, scale, k=k_rows,
                               v=v_rows, cache_loc=loc, positions=positions,
                               q_weight=weights[0], k_weight=weights[1],
                               cos_sin_cache=cos_sin)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # the reference's own roundings
    torch.testing.assert_close(fused, reference, atol=tol, rtol=tol)
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows,max_len,want", [
    (1, 1025, ({"BLOCK_N": 128, "num_stages": 5}, 9)),  # qwen3-0.6b batch 1, context 1024
    (1, 4096, ({"BLOCK_N": 128, "num_stages": 5}, 16)),  # one wave of 8 x 16 programs
    (8, 1025, ({"BLOCK_N": 128, "num_stages": 5}, 2)),  # 128 programs, one an SM
    (16, 1025, ({"BLOCK_N": 128, "num_stages": 5}, 1)),  # 128 programs: no room to split
    (64, 1025, ({"BLOCK_N": 64, "num_stages": 2}, 1)),  # 512 programs fill the SMs
])
def test_the_tiles_follow_how_much_of_the_gpu_the_rows_fill(rows, max_len, want):
    # The H200's 132 SMs and 227 KB a program; 8 key/value heads in GQA groups of 2.
    from graphcap.opsdb.triton.decode_grid import deep_bytes, programs_of, tiles_for

    programs = programs_of(rows, 16, 8)
    cfg, splits = tiles_for(programs, max_len, 132, 227 * 1024)
    assert ({k: cfg[k] for k in want[0]}, splits) == want
    assert programs * splits <= 132 or cfg["num_stages"] < 5  # deep tiles: one wave
    # Where a program cannot have the deep tiles' shared memory (a smaller GPU; head dim
    # 256 in bf16 or a float32 cache on the H200), the 3-stage tiles instead.
    for shared, row_bytes in ((99 * 1024, 256), (227 * 1024, 512)):
        cfg, _ = tiles_for(programs, max_len, 132, shared, row_bytes)
        assert cfg["num_stages"] < 5
    assert deep_bytes(256) <= 227 * 1024 < deep_bytes(512)


@pytest.mark.parametrize("rows,max_len", [(1, 1025), (1, 4096), (8, 1025), (16, 1025),
                                          (64, 1025), (2, 300)])
@pytest.mark.parametrize("shared", [227 * 1024, 99 * 1024])
def test_tiles_given_by_hand_split_as_the_chosen_tiles_do(rows, max_len, shared):
    # A benchmark's tiles= that names the tiles tiles_for would pick gets its split count
    # too: one wave of programs for the deep tiles (a program an SM), two otherwise.
    from graphcap.opsdb.triton.decode_grid import DEEP, programs_of, splits_of_tiles, tiles_for

    programs = programs_of(rows, 16, 8)
    cfg, splits = tiles_for(programs, max_len, 132, shared)
    assert splits_of_tiles(cfg, programs, max_len, 132) == splits
    forced = splits_of_tiles(DEEP, programs, max_len, 132)  # where tiles_for would not
    assert programs * forced <= 132 or forced == 1


def test_a_kernel_too_large_for_the_gpus_shared_memory_is_refused_naming_what_serves(
        monkeypatch):
    # Triton refuses the launch on the host, before anything runs (a float32 cache at head
    # dim 256 for 64 query heads a key/value head, on a GPU of 99 KB a program, asks
    # 102,720 B): the op says what would serve instead.
    from triton.runtime.errors import OutOfResources

    from graphcap.errors import KernelUnavailable
    from graphcap.opsdb.triton import decode

    class TooLarge:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(102720, 101376, "shared memory")
            return launch

    monkeypatch.setattr(decode, "_decode_kernel", TooLarge())
    B, page, hk, d = 1, 16, 1, 16
    k_cache, v_cache = (torch.zeros(2, page, hk, d) for _ in range(2))
    q, out = torch.zeros(B, 4, d), torch.empty(B, 4, d)
    table, lens = torch.ones(B, 1, dtype=torch.int32), torch.ones(B, dtype=torch.int32)
    with pytest.raises(KernelUnavailable, match=r"102720 B of shared memory.*gives 101376"
                                                r".*bfloat16.*attention='flashinfer'"):
        decode.decode_attention(q, k_cache, v_cache, table, lens, out, d ** -0.5)


@pytest.mark.gpu if ROPE_DEVICE == "cuda" else (lambda test: test)
def test_more_rows_than_a_split_launch_merges_run_in_one_split(monkeypatch):
    """Past ``counters.CAPACITY`` (1024) (row, head block)s a launch cannot merge splits:
    the kernel's own choice is one split there, on the GPU and under Triton's interpreter
    alike. The interpreter takes tens of ms a program: there 1025 rows' launch is
    recorded, not run, and the kernel runs past a capacity of 8 instead."""
    import graphcap.env
    from graphcap.opsdb.triton import counters, decode

    if not torch.cuda.is_available() and not graphcap.env.settings().triton_interpret:
        pytest.skip("the Triton kernel on CPU tensors: Triton's interpreter only")
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    page = 16

    def attend(rows):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(rows, 1, 16, generator=g).to(dev)
        caches = [torch.randn(3, page, 1, 16, generator=g).to(dev) for _ in range(2)]
        table = torch.randint(1, 3, (rows, 2), generator=g, dtype=torch.int32).to(dev)
        lens = torch.randint(1, 2 * page + 1, (rows,), generator=g, dtype=torch.int32).to(dev)
        out, want = torch.empty_like(q), torch.empty_like(q)
        decode.decode_attention(q, *caches, table, lens, out, 0.25)
        decode_attention_reference(q, *caches, table, lens, want, 0.25)
        return out, want

    rows = counters.CAPACITY + 1
    if dev == "cpu":
        launches = []

        class Recorded:  # the grid and split count the op launches, nothing run
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((grid, kwargs["SPLITS"]))

        with monkeypatch.context() as patch:
            patch.setattr(decode, "_decode_kernel", Recorded())
            attend(rows)
        assert launches == [((rows, 1, 1), 1)]
        monkeypatch.setattr(counters, "CAPACITY", 8)
        rows = 9
    out, want = attend(rows)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu if ROPE_DEVICE == "cuda" else (lambda test: test)
@pytest.mark.parametrize("window,sinks", [(0, False), (5, True)])
@pytest.mark.parametrize("tiles", [{}, {"SPLIT_QUANTUM": 4}],
                         ids=["in whole blocks", "in 4 tokens"])
def test_splits_of_each_rows_own_length_give_the_splits_of_the_tables_width_result(
        window, sinks, tiles):
    """Rows far shorter than their table, each split an equal share of the row's own
    tokens (of its window's; the kernel's default) instead of the table's width over the
    splits (``SPLIT_OF_LENGTH`` off): the same output, and the reference's, in a launch of
    four splits."""
    from graphcap.opsdb.triton.decode import decode_attention

    dev, page, width, B, hq, hk, d = ROPE_DEVICE, 16, 8, 5, 4, 2, 64
    g = torch.Generator().manual_seed(window + len(tiles))
    lens = torch.tensor([1, 7, 16, 23, 70], dtype=torch.int32).to(dev)  # of 128 a table
    table = (torch.randperm(B * width, generator=g) + 1).view(B, width).to(torch.int32)
    caches = [torch.randn(B * width + 1, page, hk, d, generator=g).to(dev)
              for _ in range(2)]
    q = torch.randn(B, hq, d, generator=g).to(dev)
    sink = torch.randn(hq, generator=g).to(dev) if sinks else None
    options = {"window": window, "sinks": sink}
    table = table.to(dev)
    want, out, ref = (torch.empty_like(q) for _ in range(3))
    decode_attention(q, *caches, table, lens, want, d ** -0.5, num_splits=4,
                     tiles={"SPLIT_OF_LENGTH": False}, **options)
    decode_attention(q, *caches, table, lens, out, d ** -0.5, num_splits=4, tiles=tiles,
                     **options)
    decode_attention_reference(q, *caches, table, lens, ref, d ** -0.5, **options)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu if ROPE_DEVICE == "cuda" else (lambda test: test)
@pytest.mark.parametrize("hq,hk,dtype", [(4, 4, torch.bfloat16), (4, 2, torch.float32),
                                         (16, 2, torch.bfloat16)])
def test_products_on_cuda_cores_give_the_tensor_core_products_result(hq, hk, dtype):
    """``CUDA_CORES``: scores and weighted values summed in registers for the group's
    heads only (groups of 1, 2 and 8 query heads a key/value head): the tensor-core kernel's
    output, and the reference's, with a window, sinks and soft-capping: in one split, each
    program's rows walked in several blocks with the next block's keys and values asked for
    ahead (``AHEAD``), and in four splits without."""
    from graphcap.opsdb.triton.decode import decode_attention

    dev, page, width, B, d = ROPE_DEVICE, 16, 6, 3, 64
    g = torch.Generator().manual_seed(hq * 10 + hk)
    lens = torch.tensor([1, 40, 96], dtype=torch.int32).to(dev)
    table = (torch.randperm(B * width, generator=g) + 1).view(B, width).to(torch.int32)
    caches = [torch.randn(B * width + 1, page, hk, d, generator=g).to(dev, dtype)
              for _ in range(2)]
    q = torch.randn(B, hq, d, generator=g).to(dev, dtype)
    options = {"window": 50, "sinks": torch.randn(hq, generator=g).to(dev),
               "softcap": 30.0}
    table = table.to(dev)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ref = torch.empty_like(q)
    decode_attention_reference(q, *caches, table, lens, ref, d ** -0.5, **options)
    for splits, ahead in ((1, True), (4, False)):
        want, out = torch.empty_like(q), torch.empty_like(q)
        decode_attention(q, *caches, table, lens, want, d ** -0.5, num_splits=splits,
                         **options)
        decode_attention(q, *caches, table, lens, out, d ** -0.5, num_splits=splits,
                         tiles={"CUDA_CORES": True, "AHEAD": ahead}, **options)
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
