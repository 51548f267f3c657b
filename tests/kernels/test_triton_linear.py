"""The fused few-row linear kernel (RMSNorm prologue, SwiGLU or residual epilogue, bias,
split K with an in-kernel reduction) against the torch references: every mode and split
in Triton's interpreter without a GPU, and at model size in a real CUDA graph where one
is present. The opsdb property test (tests/opsdb/test_opsdb.py) covers random shapes through
the ops' own input strategies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.opsdb import linear as ops
from graphcap.opsdb.triton import linear as kernel
from tests.conftest import requires_cuda

# On a CUDA machine these properties run on the GPU: the suite selects them.
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []

device = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def case(mode, m, n, k, dtype, seed):
    """(kernel call, reference call) for one mode: norm, swiglu, residual, bias, plain."""
    x = randn(m, k, dtype=dtype, seed=seed)
    w = randn(2 * n if mode == "swiglu" else n, k, dtype=dtype, seed=seed + 1,
              scale=k ** -0.5)
    g = randn(k, dtype=dtype, seed=seed + 2, scale=0.5) + 1
    if mode == "swiglu":
        return (dict(weight=w, norm_weight=g, swiglu=True),
                lambda: ops.rms_norm_swiglu_reference(x, g, 1e-6, w), x)
    if mode == "residual":
        res = randn(m, n, dtype=dtype, seed=seed + 3)
        return (dict(weight=w, residual=res),
                lambda: ops.linear_residual_reference(x, w, res), x)
    bias = randn(n, dtype=dtype, seed=seed + 4) if mode == "bias" else None
    norm = g if mode in ("norm", "bias") else None
    if norm is None:
        return dict(weight=w), lambda: ops._linear(x, w), x
    return (dict(weight=w, norm_weight=norm, bias=bias),
            lambda: ops.rms_norm_linear_reference(x, norm, 1e-6, w, bias), x)


MODES = ["plain", "norm", "bias", "swiglu", "residual"]


def config(mode, m, n, k, sms=1):
    return kernel.config(m, n, k, norm=mode in ("norm", "bias", "swiglu"),
                         swiglu=mode == "swiglu", sms=sms)


@settings(max_examples=25, deadline=None)
@given(mode=st.sampled_from(MODES), m=st.sampled_from([1, 5, 16, 33]),
       nk=st.sampled_from([(48, 320), (200, 96), (16, 16)]), split=st.sampled_from([1, 2, 3]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**20))
def test_every_mode_and_k_split_matches_the_reference(mode, m, nk, split, dtype, seed):
    n, k = nk
    args, want, x = case(mode, m, n, k, dtype, seed)
    tiles = dict(config(mode, m, n, k), BLOCK_K=32, SPLIT_K=split)
    got = kernel.skinny_linear(x, tiles=tiles, **args)
    torch.testing.assert_close(got, want(), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=12, deadline=None)
@given(mode=st.sampled_from(["norm", "bias", "swiglu"]), m=st.sampled_from([1, 5, 16, 33]),
       nk=st.sampled_from([(48, 320), (200, 96), (16, 16)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**20))
def test_the_norms_scale_applied_to_the_sums_matches_the_reference(mode, m, nk, dtype, seed):
    # NORM_LATE: no pass over x before the products; 1 / rms scales the float32 sums
    n, k = nk
    args, want, x = case(mode, m, n, k, dtype, seed)
    tiles = dict(config(mode, m, n, k), BLOCK_K=32, SPLIT_K=1, NORM_LATE=True)
    got = kernel.skinny_linear(x, tiles=tiles, **args)
    torch.testing.assert_close(got, want(), atol=TOL[dtype], rtol=TOL[dtype])


def test_the_norms_scale_on_the_sums_refuses_a_split_of_k():
    args, _, x = case("norm", 3, 48, 320, torch.float32, 0)
    tiles = dict(config("norm", 3, 48, 320), BLOCK_K=32, SPLIT_K=2, NORM_LATE=True)
    with pytest.raises(ValueError, match="NORM_LATE needs the whole of K"):
        kernel.skinny_linear(x, tiles=tiles, **args)


def test_the_norms_scale_on_the_sums_refuses_float16_rows():
    # x * g is rounded to x's dtype before 1 / rms scales it: float16 would overflow.
    args, _, x = case("norm", 3, 48, 64, torch.float16, 0)
    tiles = dict(config("norm", 3, 48, 64), SPLIT_K=1, NORM_LATE=True)
    with pytest.raises(ValueError, match="overflows float16"):
        kernel.skinny_linear(x * 2e4, tiles=tiles, **args)


@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("mode", ["norm", "swiglu", "residual"])
@pytest.mark.parametrize("element_size", [2, 4])
def test_every_tile_choice_fits_the_shared_memory_in_each_dtype(m, mode, element_size):
    # float32 halves what fits: 16-row SwiGLU tiles of bf16's size asked 259 KiB.
    for n, k in ((1024, 3072), (3072, 1024), (14336, 4096), (151936, 1024)):
        t = kernel.config(m, n, k, norm=mode != "residual", swiglu=mode == "swiglu",
                          sms=132, element_size=element_size)
        tiles = 2 if mode == "swiglu" else 1
        stage = element_size * t["BLOCK_K"] * (t["BLOCK_M"] + t["BLOCK_N"] * tiles)
        assert t["num_stages"] >= 2 and t["num_stages"] * stage <= kernel._SMEM_BUDGET


def test_a_split_k_launch_leaves_its_counters_zero_for_the_next():
    # One persistent counter buffer per stream: each launch's last program of a column
    # block sets its counter back to zero, so launch after launch needs no zeroing.
    from graphcap.opsdb.triton import counters

    buffers = set()
    for seed in range(3):
        args, want, x = case("swiglu", 7, 48, 320, torch.float32, seed)
        tiles = dict(config("swiglu", 7, 48, 320), SPLIT_K=4, BLOCK_K=32)
        torch.testing.assert_close(kernel.skinny_linear(x, tiles=tiles, **args), want(),
                                   atol=1e-4, rtol=1e-4)
        assert counters.check_zero() == []
        buffers.add(counters.persistent(x.device, 2).data_ptr())
    assert len(buffers) == 1


def test_counters_beyond_the_capacity_are_the_launchs_own(monkeypatch):
    from graphcap.opsdb.triton import counters

    monkeypatch.setattr(counters, "CAPACITY", 4)  # a small launch past it (interpreted here)
    blocks = counters.CAPACITY + 1
    assert counters.persistent(torch.device("cpu"), blocks) is None
    used, counts = [], counters.zeroed
    monkeypatch.setattr(counters, "zeroed", lambda *a: used.append(counts(*a)) or used[-1])
    args, want, x = case("residual", 3, 16 * blocks, 64, torch.float32, 0)
    tiles = dict(config("residual", 3, 16 * blocks, 64), BLOCK_N=16, BLOCK_K=16, SPLIT_K=2)
    torch.testing.assert_close(kernel.skinny_linear(x, tiles=tiles, **args), want(),
                               atol=1e-4, rtol=1e-4)
    assert len(used) == 1 and used[0].numel() == blocks  # a buffer of this launch's own
    assert all(used[0] is not b for b in counters._BUFFERS.values())


def test_ctrl_c_while_the_counters_are_made_is_raised_once_their_thread_is_done(monkeypatch):
    import os
    import signal
    import time

    from graphcap.opsdb.triton import counters

    finished, zeros = [], torch.zeros

    def slow_zeros(*args, **kwargs):  # the worker's allocation: Ctrl-C arrives during it
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.3)  # the GIL released: the main thread takes the signal meanwhile
        out = zeros(*args, **kwargs)
        finished.append(True)
        return out

    device = torch.device("meta")  # a key of its own: no buffer of another test's
    monkeypatch.setattr(counters.torch, "zeros", slow_zeros)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            counters.persistent(device, 1)
        seen = list(finished)  # at the moment it was raised
    finally:
        signal.signal(signal.SIGINT, previous)
    assert seen == [True]  # not while the worker still ran its torch call
    assert counters._where(device)[1] not in counters._BUFFERS  # nothing half made kept


def test_the_split_covers_the_sms_and_keeps_two_slices_per_program_one_at_16_rows():
    # qwen3-0.6b's projections on 132 SMs: 16 tokens, then 64.
    assert config("residual", 16, 1024, 2048, 132)["SPLIT_K"] == 8  # o: 32 column blocks
    assert config("residual", 16, 1024, 3072, 132)["SPLIT_K"] == 8  # down
    assert config("residual", 64, 1024, 2048, 132)["SPLIT_K"] == 4  # two slices each
    assert config("residual", 64, 1024, 3072, 132)["SPLIT_K"] == 4
    assert config("residual", 16, 1024, 64, 132)["SPLIT_K"] == 1  # too short to split
    # The norm needs all of K in one program: the normed projections never split.
    assert config("norm", 16, 4096, 1024, 132)["SPLIT_K"] == 1  # q/k/v
    assert config("swiglu", 16, 3072, 1024, 132)["SPLIT_K"] == 1  # gate/up
    assert config("norm", 1, 151936, 1024, 132)["BLOCK_N"] == 64  # the LM head: wide tiles


def test_the_ops_take_the_fused_kernel_only_where_it_was_measured_to_win():
    def rows(op, args):
        spec = getattr(ops, op)
        return [m for m in (1, 16, 17, 64, 65) if spec.kernels["triton"].declines(
            (torch.empty(m, 1024, dtype=args[0].dtype), *args)) is None]

    small = torch.empty(1024, 2048, dtype=torch.bfloat16)  # 4 MiB
    o = torch.empty(4096, 4096, dtype=torch.bfloat16)  # 32 MiB, llama3-8b's o
    large = torch.empty(6144, 4096, dtype=torch.bfloat16)  # 48 MiB, its q/k/v
    g = torch.empty(1024, dtype=torch.bfloat16)
    assert rows("LINEAR_RESIDUAL", (small, None)) == [1, 16, 17, 64]
    assert rows("LINEAR_RESIDUAL", (o, None)) == [1, 16]
    assert rows("LINEAR_RESIDUAL", (large, None)) == [1, 16]
    # Past the GEMV form's rows the norm prologue slowed the tensor-core matmul more than
    # the launch it saved, at every size.
    assert rows("RMS_NORM_LINEAR", (g, 1e-6, small, None)) == [1]  # the GEMV form
    assert rows("RMS_NORM_LINEAR", (g, 1e-6, o, None)) == [1]  # up to 32 MiB
    assert rows("RMS_NORM_LINEAR", (g, 1e-6, large, None)) == []
    gate_up = torch.empty(2048, 1024, dtype=torch.bfloat16)  # 4 MiB
    assert rows("RMS_NORM_SWIGLU", (g, 1e-6, gate_up)) == [1, 16]
    assert rows("RMS_NORM_SWIGLU", (g, 1e-6, large)) == []  # cuBLAS streams it faster


def test_more_rows_than_the_kernel_takes_are_refused_and_the_op_falls_back():
    x = randn(kernel.MAX_ROWS + 1, 16, dtype=torch.float32, seed=0)
    w = randn(8, 16, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="at most 64 rows"):
        kernel.skinny_linear(x, w)
    assert ops.LINEAR_RESIDUAL.kernels["triton"].declines((x, w, None))


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("m", [1, 16, 64])
def test_model_sized_projections_replay_in_a_cuda_graph(m):
    from graphcap.core import new_pool

    # qwen3-0.6b: q/k/v (norm), o and down (residual, split K), gate/up (SwiGLU), LM head.
    shapes = [("norm", 4096, 1024), ("residual", 1024, 2048), ("swiglu", 3072, 1024),
              ("residual", 1024, 3072), ("norm", 151936, 1024)]
    pool = new_pool("cuda")
    for mode, n, k in shapes:
        if n > 8192 and m > 1:
            continue  # the LM head runs on last tokens only
        args, want, x = case(mode, m, n, k, torch.bfloat16, 0)
        # split-K counters reset per replay
        replays_like_the_reference(pool, kernel.skinny_linear, args, want, x, (mode, n, k))


def replays_like_the_reference(pool, linear, args, want, x, label) -> None:
    """``linear(x, **args)`` captured in a graph of ``pool`` and replayed over two new
    inputs in the same buffers, each output against the reference ``want()``."""
    with pool.warmup():
        linear(x, **args)
    graph = pool.graph()
    y = graph.capture(lambda: linear(x, **args))
    for seed in (1, 2):
        x.copy_(randn(*x.shape, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want(), atol=2e-2, rtol=2e-2,
                                   msg=lambda msg: f"{label}: {msg}")


@pytest.mark.gpu
@requires_cuda
def test_counters_are_made_outside_the_pool_a_warm_up_allocates_to(monkeypatch):
    from graphcap.core import new_pool
    from graphcap.opsdb.triton import counters

    monkeypatch.setattr(counters, "_BUFFERS", {})  # none yet (earlier graphs keep theirs)
    pool = new_pool("cuda")
    with pool.warmup():  # before the pool's first capture: routed to the pool
        stream_key = torch.cuda.current_stream().cuda_stream
        buffer = counters.persistent(torch.device("cuda"), 32)
        inside = torch.empty(1 << 20, device="cuda")  # this one is the pool's
    in_pool = [(s["address"], s["address"] + s["total_size"]) for s in pool._segments()]
    assert any(lo <= inside.data_ptr() < hi for lo, hi in in_pool)
    assert not any(lo <= buffer.data_ptr() < hi for lo, hi in in_pool)
    assert counters._BUFFERS[(torch.cuda.current_device(), stream_key)] is buffer


@pytest.mark.gpu
@requires_cuda
def test_a_capture_makes_its_streams_counters_before_it_begins(monkeypatch):
    # Even when no split launch ran on the capture stream before (a runner whose largest
    # shape has too many rows for the fused kernel): made outside the pool, shared by
    # the pool's graphs, never zeroed inside a replay.
    from graphcap.core import new_pool
    from graphcap.opsdb.triton import counters

    args, want, x = case("residual", 16, 1024, 2048, torch.bfloat16, 0)
    kernel.skinny_linear(x, **args)  # compiled, on another stream
    pool = new_pool("cuda")
    key = (torch.cuda.current_device(), pool.stream.cuda_stream)
    monkeypatch.setattr(counters, "_BUFFERS", {})  # none yet (earlier graphs keep theirs)
    graphs = [pool.graph(), pool.graph()]
    outs = [g.capture(lambda: kernel.skinny_linear(x, **args)) for g in graphs]
    buffer = counters._BUFFERS[key]
    in_pool = [(s["address"], s["address"] + s["total_size"]) for s in pool._segments()]
    assert not any(lo <= buffer.data_ptr() < hi for lo, hi in in_pool)
    for seed in (1, 2, 3):
        x.copy_(randn(16, 2048, dtype=torch.bfloat16, seed=seed))
        for g, out in zip(graphs, outs, strict=True):  # each read before the other's replay
            g.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, want(), atol=2e-2, rtol=2e-2)
    assert counters.check_zero() == []


@pytest.mark.gpu
@requires_cuda
def test_a_capture_by_other_means_on_a_stream_without_counters_brings_its_own(monkeypatch):
    from graphcap.opsdb.triton import counters

    args, want, x = case("residual", 16, 1024, 2048, torch.bfloat16, 0)
    kernel.skinny_linear(x, **args)  # compiled, on another stream
    monkeypatch.setattr(counters, "_BUFFERS", {})
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        y = kernel.skinny_linear(x, **args)
    assert (torch.cuda.current_device(), stream.cuda_stream) not in counters._BUFFERS
    for seed in (1, 2, 3):  # its own counters, zeroed inside each replay
        x.copy_(randn(16, 2048, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(y, want(), atol=2e-2, rtol=2e-2)


def test_a_gpu_with_more_shared_memory_than_the_budget_keeps_the_measured_tiles():
    # The H200 (227 KB a program) gets the tiles its sweeps chose; a GPU of 99 KB fewer
    # stages or shorter slices, never more than it has (compiled for sm_89:
    # tests/kernels/test_triton_compiles_for_sm90.py).
    from graphcap.opsdb.triton.attention import _config
    from graphcap.opsdb.triton.linear import config

    for m, n, k, norm, swiglu in ((1, 4096, 1024, True, False), (16, 3072, 1024, True, True),
                                  (64, 1024, 2048, False, False),
                                  (64, 14336, 4096, True, True)):
        h200 = config(m, n, k, norm=norm, swiglu=swiglu, sms=132, shared=227 * 1024)
        assert h200 == config(m, n, k, norm=norm, swiglu=swiglu, sms=132)
        small = config(m, n, k, norm=norm, swiglu=swiglu, sms=128, shared=99 * 1024)
        per_stage = 2 * small["BLOCK_K"] * (small["BLOCK_M"]
                                            + small["BLOCK_N"] * (2 if swiglu else 1))
        assert small["num_stages"] >= 2 and per_stage * small["num_stages"] <= 91 * 1024
    for d, length in ((256, 512), (128, 2048), (64, 16)):
        assert _config(d, torch.bfloat16, 10_000, 132, False, length, 227 * 1024) == \
            _config(d, torch.bfloat16, 10_000, 132, False, length)


@pytest.mark.parametrize("form", ["skinny", "gemv"])
def test_an_up_half_past_two_to_the_31_elements_is_read_where_it_lies(form):
    # Two gate rows and their up rows, the row stride 2**30 (an int32 each, N = 2): the
    # kernels took the up half's offset as N * stride_wn in int32, which wrapped to 2**31
    # elements before the gate rows. The weight sits 2**31 elements into a 10 GB buffer
    # (empty, so lazily mapped on the CPU: only the pages touched cost memory; zeros
    # would write all 10 GB), so the wrapped read lands in it, on rows of zeros, and the
    # output shows it.
    from graphcap.opsdb.triton.gemv import gemv_linear

    k, n, stride = 16, 2, 1 << 30
    off = 1 << 31
    try:
        big = torch.empty(off + (2 * n - 1) * stride + k, dtype=torch.bfloat16,
                          device=device)
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        pytest.skip("no room for a 10 GB buffer (virtual, on the CPU)")
    big[:off].as_strided((n, k), (stride, 1)).zero_()  # where the up rows wrapped to
    w = big[off:].as_strided((2 * n, k), (stride, 1))
    for row in range(2 * n):
        w[row] = randn(k, dtype=torch.bfloat16, seed=row, scale=k ** -0.5)
    x = randn(1, k, dtype=torch.bfloat16, seed=9)
    g = randn(k, dtype=torch.bfloat16, seed=10, scale=0.5) + 1
    run = gemv_linear if form == "gemv" else kernel.skinny_linear
    got = run(x, w, norm_weight=g, eps=1e-6, swiglu=True)
    want = ops.rms_norm_swiglu_reference(x, g, 1e-6, w.contiguous())
    assert want.abs().min() > 1e-3
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    del w, big
