"""The GEMV-form linear of decode steps (one to GEMV_ROWS rows; RMSNorm prologue,
SwiGLU or residual epilogue, bias) against the torch references in Triton's interpreter
without a GPU and at model size in a CUDA graph where one is present; each row's result
does not depend on how many rows share the launch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.opsdb import linear as ops
from graphcap.opsdb.triton import gemv
from graphcap.opsdb.triton import linear as kernel
from tests.conftest import requires_cuda
from tests.kernels.test_triton_linear import (
    MODES,
    TOL,
    case,
    device,
    randn,
    replays_like_the_reference,
)

# On a CUDA machine these properties run on the GPU: the suite selects them.
pytestmark = [pytest.mark.gpu] if torch.cuda.is_available() else []


@settings(max_examples=15, deadline=None)
@given(mode=st.sampled_from(MODES), m=st.integers(1, gemv.GEMV_ROWS),
       nk=st.sampled_from([(12, 320), (7, 96), (16, 16), (3, 40)]),
       block=st.sampled_from([(1, 32), (2, 32), (4, 64), (2, 512)]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**20),
       norm_late=st.booleans(), w_cache=st.sampled_from(["", ".cg"]), ahead=st.booleans())
def test_every_mode_matches_the_reference_over_one_slice_of_k_or_many(mode, m, nk, block,
                                                                     dtype, seed, norm_late,
                                                                     w_cache, ahead):
    # NORM_LATE: the norm's scale applied to the sums, not to x (no pass over x first);
    # AHEAD: the next weight slice loaded before this one's products
    n, k = nk
    args, want, x = case(mode, m, n, k, dtype, seed)
    tiles = {"BLOCK_N": block[0], "BLOCK_K": block[1], "num_warps": 4,
             "NORM_LATE": norm_late, "W_CACHE": w_cache, "AHEAD": ahead}
    got = gemv.gemv_linear(x, tiles=tiles, **args)
    torch.testing.assert_close(got, want(), atol=TOL[dtype], rtol=TOL[dtype])


@settings(max_examples=6, deadline=None)
@given(mode=st.sampled_from(MODES), m=st.integers(2, gemv.GEMV_ROWS),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**20))
def test_a_row_comes_out_bitwise_the_same_whatever_rows_share_its_launch(mode, m, dtype,
                                                                       seed):
    # A decode step (one row a request) and a verify step (1 + k) agree on each row.
    args, _, x = case(mode, m, 6, 160, dtype, seed)
    tiles = {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 4}  # three slices of K
    together = gemv.gemv_linear(x, tiles=tiles, **args)
    for row in range(m):
        alone = {key: (v[row:row + 1] if key == "residual" else v) for key, v in args.items()}
        assert torch.equal(gemv.gemv_linear(x[row:row + 1], tiles=tiles, **alone),
                           together[row:row + 1])


def test_the_tiles_keep_a_programs_slice_in_registers():
    assert gemv.gemv_config(1024) == {"BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4}
    assert gemv.gemv_config(14336)["BLOCK_K"] == 2048  # 32 elements a thread
    assert gemv.gemv_config(96)["BLOCK_K"] == 128
    # normed, K up to 1024: four columns over all of K, the norm's scale on the sums
    assert gemv.gemv_config(1024, norm=True) == {"BLOCK_N": 4, "BLOCK_K": 1024,
                                                 "num_warps": 4, "NORM_LATE": True}
    assert gemv.gemv_config(4096, norm=True) == gemv.gemv_config(4096)


def test_a_tuned_device_keeps_two_slices_of_a_normed_projection_past_1024_in_flight():
    assert gemv.gemv_config(4096, norm=True, ahead=True) == {  # q/k/v: slices of 1024
        "BLOCK_N": 2, "BLOCK_K": 1024, "num_warps": 4, "AHEAD": True}
    assert gemv.gemv_config(4096, norm=True, swiglu=True, ahead=True) == {
        "BLOCK_N": 2, "BLOCK_K": 2048, "num_warps": 4, "AHEAD": True}
    # K up to 1024, or no norm (o, down): as on any device
    assert gemv.gemv_config(1024, norm=True, ahead=True) == gemv.gemv_config(1024, norm=True)
    assert gemv.gemv_config(14336, ahead=True) == gemv.gemv_config(14336)


def test_the_dispatch_follows_the_devices_tuning_by_its_name(monkeypatch):
    default = {"dispatch_bytes": gemv.DISPATCH_BYTES, "ahead": False}
    assert gemv.tuning(torch.device("cpu")) == default
    names = {0: "NVIDIA H100 80GB HBM3", 1: "NVIDIA H200"}
    monkeypatch.setattr(gemv, "_device_name", names.__getitem__)
    assert gemv.tuning(torch.device("cuda", 0)) == gemv.TUNED["NVIDIA H100 80GB HBM3"]
    assert gemv.tuning(torch.device("cuda", 1)) == default
    # llama3-8b's gate/up (235 MB) takes the form on the tuned device alone; an LM head
    # (qwen3-0.6b's, 311 MB) on neither
    for shape, tuned in (((28672, 4096), True), ((151936, 1024), False)):
        w = torch.empty(shape, dtype=torch.bfloat16, device="meta")
        for entry, rows in ((gemv.TUNED["NVIDIA H100 80GB HBM3"], int(tuned)), (default, 0)):
            monkeypatch.setattr(gemv, "tuning", lambda device, entry=entry: entry)
            assert gemv.gemv_rows(w) == rows, (shape, entry)


def test_the_dispatch_takes_the_gemv_form_at_one_row_and_small_weights_only():
    w = randn(8, 16, dtype=torch.float32, seed=1)
    assert gemv.dispatches(randn(1, 16, dtype=torch.float32, seed=0), w)
    assert not gemv.dispatches(randn(2, 16, dtype=torch.float32, seed=0), w)
    assert not gemv.dispatches(w[:1], torch.empty(4096, 4097, dtype=torch.bfloat16))
    x = randn(gemv.GEMV_ROWS + 1, 16, dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match=f"at most {gemv.GEMV_ROWS} rows"):
        gemv.gemv_linear(x, w)
    torch.testing.assert_close(kernel.fused_linear(x, w), x @ w.T, atol=1e-4, rtol=1e-4)


def test_only_a_modules_parameters_are_read_before_the_pdl_wait():
    w = randn(8, 16, dtype=torch.float32, seed=1)
    assert gemv.preloads(torch.nn.Parameter(w, requires_grad=False))
    assert not gemv.preloads(w)  # may be the output of the kernel before
    assert not gemv.preloads(torch.nn.Parameter(w)[:4])  # a view is a plain tensor
    seen = []

    @torch.library.custom_op("graphcap_test::weight_kind", mutates_args=())
    def weight_kind(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        seen.append(gemv.preloads(weight))
        return x.clone()

    linear = torch.nn.Linear(16, 8)
    weight_kind(w, linear.weight)  # a custom op hands the kernel the parameter itself
    assert seen == [True]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("parameter", [False, True])
@pytest.mark.parametrize("m", [1, 5, 8])
def test_model_sized_projections_replay_in_a_cuda_graph(m, parameter):
    from graphcap.core import new_pool

    # qwen3-0.6b q/k/v, o, gate/up, down, LM head; llama3-8b's q/k/v, gate/up and down
    # (K past one slice; the first two at AHEAD tiles on a TUNED device).
    shapes = [("norm", 4096, 1024), ("residual", 1024, 2048), ("swiglu", 3072, 1024),
              ("residual", 1024, 3072), ("norm", 151936, 1024), ("norm", 6144, 4096),
              ("swiglu", 14336, 4096), ("residual", 4096, 14336)]
    pool = new_pool("cuda")
    for mode, n, k in shapes:
        args, want, x = case(mode, m, n, k, torch.bfloat16, 0)
        if parameter:  # read before the PDL wait
            args["weight"] = torch.nn.Parameter(args["weight"], requires_grad=False)
        replays_like_the_reference(pool, gemv.gemv_linear, args, want, x, (mode, n, k))


@pytest.mark.gpu
@requires_cuda
def test_a_weight_the_kernel_before_wrote_is_read_after_it_finished():
    # Under PDL a launch starts while the one before runs; a weight that launch writes
    # (here the first product, viewed as the second's [2, 2048] weight) is read after
    # the wait, in every replay.
    from graphcap.core import new_pool

    x1 = randn(1, 1024, dtype=torch.bfloat16, seed=0)
    w1 = randn(4096, 1024, dtype=torch.bfloat16, seed=1, scale=1 / 32)
    x2 = randn(1, 2048, dtype=torch.bfloat16, seed=2)

    def chain():
        return gemv.gemv_linear(x2, gemv.gemv_linear(x1, w1).view(2, 2048))

    pool = new_pool("cuda")
    with pool.warmup():
        chain()
    graph = pool.graph()
    y = graph.capture(chain)
    for seed in range(3, 13):
        x1.copy_(randn(1, 1024, dtype=torch.bfloat16, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        w2 = gemv.gemv_linear(x1, w1).view(2, 2048)
        assert torch.equal(y, gemv.gemv_linear(x2, w2)), seed


@pytest.mark.parametrize("late", [False, True])
@pytest.mark.parametrize("mode", ["norm", "bias", "swiglu"])
def test_a_normed_projection_of_no_inputs_gives_the_references_values(mode, late):
    # K = 0: no sums of squares at all; the norm's scale on the (zero) sums stays finite.
    m, n = 2, 6
    x = torch.empty(m, 0, device=device)
    w = torch.empty(2 * n if mode == "swiglu" else n, 0, device=device)
    g = torch.empty(0, device=device)
    bias = torch.arange(n, dtype=torch.float32, device=device) if mode == "bias" else None
    if mode == "swiglu":
        args, want = dict(swiglu=True), ops.rms_norm_swiglu_reference(x, g, 1e-6, w)
    else:
        args, want = dict(bias=bias), ops.rms_norm_linear_reference(x, g, 1e-6, w, bias)
    got = gemv.gemv_linear(x, w, norm_weight=g, tiles={"BLOCK_N": 2, "BLOCK_K": 32,
                                                       "num_warps": 4, "NORM_LATE": late},
                           **args)
    skinny = kernel.skinny_linear(x, w, norm_weight=g, tiles=dict(
        kernel.config(m, n, 0, norm=True, swiglu=mode == "swiglu", sms=1), SPLIT_K=1,
        NORM_LATE=late), **args)
    assert not want.isnan().any()
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    torch.testing.assert_close(skinny, want, atol=0, rtol=0)


@pytest.mark.parametrize("fn", [gemv.gemv_linear, kernel.skinny_linear],
                         ids=["gemv", "few-row"])
@pytest.mark.parametrize("extra", ["residual", "bias"])
def test_swiglu_beside_a_residual_or_bias_is_refused_not_left_out(fn, extra):
    """SwiGLU's epilogue adds neither a residual nor a bias: given one, the kernels
    returned silu(gate) * up without it (a bias on the gate half only)."""
    x, w = randn(2, 32, dtype=torch.float32, seed=0), randn(16, 32, dtype=torch.float32, seed=1)
    given = {"residual": randn(2, 8, dtype=torch.float32, seed=2),
             "bias": randn(16, dtype=torch.float32, seed=3)}[extra]
    with pytest.raises(ValueError, match="swiglu=True takes no residual or bias"):
        fn(x, w, swiglu=True, **{extra: given})
