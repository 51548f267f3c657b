"""Triton varlen causal prefill attention against the torch reference: random request-length
lists (sentinel slots, one-token requests, padding rows), GQA ratios, head dims, dtypes and
fused-qkv strides (Triton's interpreter without a GPU), and captured in a real CUDA graph
replayed over new batches where a GPU is present."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from graphcap.opsdb import reference as ref
from graphcap.opsdb.triton.attention import attention_varlen
from tests.conftest import requires_cuda

device = "cuda" if torch.cuda.is_available() else "cpu"
# On a CUDA machine every test here runs its kernels there, so the GPU suite runs them all.
pytestmark = [pytest.mark.gpu] if device == "cuda" else []

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}


def make_qkv(T: int, hq: int, hk: int, d: int, dtype, seed: int, fused: bool):
    """q [T, hq, d], k and v [T, hk, d]; with ``fused``, views of one [T, hq + 2 hk, d]
    buffer (row stride (hq + 2 hk) * d), as a fused qkv projection leaves them."""
    g = torch.Generator().manual_seed(seed)
    if fused:
        qkv = torch.randn(T, hq + 2 * hk, d, generator=g).to(dtype=dtype, device=device)
        return qkv[:, :hq], qkv[:, hq:hq + hk], qkv[:, hq + hk:]
    q = torch.randn(T, hq, d, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(T, hk, d, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(T, hk, d, generator=g).to(dtype=dtype, device=device)
    return q, k, v


def cu_of(lengths: list[int]) -> torch.Tensor:
    """cu_seqlens [R + 1] int32 on the device for these request lengths."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def poison_padding(q, k, v, used: int) -> None:
    """NaN and Inf in every row past the last request."""
    q[used:] = float("nan")
    k[used:] = float("inf")
    v[used:] = float("nan")


def check(out, q, k, v, cu, scale, causal, dtype, used):
    expected = ref.attention_varlen(q, k, v, cu, scale, causal)
    assert not out[:used].isnan().any(), "NaN in a real row"
    tol = TOL[dtype]
    torch.testing.assert_close(out[:used].float(), expected[:used].float(), rtol=tol, atol=tol)
    pad = out[used:]
    assert torch.equal(pad, torch.zeros_like(pad)), "padding rows must come out zero"


# Request lengths: sentinels (0), one-token requests and lengths around the interpreter's
# 32 x 16 tiles, plus anything up to 40.
lengths_st = st.lists(
    st.one_of(st.sampled_from([0, 1, 15, 16, 17, 31, 32, 33]), st.integers(0, 40)),
    min_size=1, max_size=4)
# (Hq, Hk): GQA ratios 1, 2 and 8 with few heads.
heads_st = st.sampled_from([(1, 1), (2, 2), (2, 1), (4, 2), (8, 1)])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=lengths_st, pad=st.integers(0, 6), extra=st.integers(0, 20), heads=heads_st,
       d=st.sampled_from([64, 128, 80, 96, 8]), dtype=st.sampled_from(DTYPES),
       causal=st.sampled_from([True, True, True, False]), fused=st.booleans(),
       nan_padding=st.booleans(), seed=st.integers(0, 2**31 - 1))
@example(lengths=[33, 0, 1, 17], pad=3, extra=0, heads=(8, 1), d=64, dtype=torch.float32,
         causal=True, fused=True, nan_padding=True, seed=0)
@example(lengths=[0, 40, 0], pad=0, extra=7, heads=(4, 2), d=128, dtype=torch.bfloat16,
         causal=True, fused=False, nan_padding=False, seed=1)
@example(lengths=[17, 0, 33], pad=2, extra=3, heads=(4, 2), d=80, dtype=torch.float16,
         causal=True, fused=True, nan_padding=True, seed=2)  # Phi's head dim: padded to 128
def test_matches_reference(lengths, pad, extra, heads, d, dtype, causal, fused, nan_padding,
                           seed):
    hq, hk = heads
    used = sum(lengths)
    T = max(used + pad, 1)
    q, k, v = make_qkv(T, hq, hk, d, dtype, seed, fused)
    if nan_padding:
        poison_padding(q, k, v, used)
    cu = cu_of(lengths)
    out = torch.full((T, hq, d), float("nan"), dtype=dtype, device=device)
    scale = 1.0 / math.sqrt(d)
    # max_seqlen is a bucket: any upper bound on the lengths.
    returned = attention_varlen(q, k, v, out, cu, max(lengths) + extra, scale, causal)
    assert returned is out
    check(out, q, k, v, cu, scale, causal, dtype, used)


def test_nan_padding_never_reaches_real_rows():
    lengths = [5, 0, 33, 1, 0]
    used, T, hq, hk, d = 39, 50, 4, 2, 64
    q, k, v = make_qkv(T, hq, hk, d, torch.float16, 7, fused=False)
    poison_padding(q, k, v, used)
    cu = cu_of(lengths)
    out = torch.full((T, hq, d), float("nan"), dtype=torch.float16, device=device)
    attention_varlen(q, k, v, out, cu, 40, d ** -0.5)
    assert not out.isnan().any()
    assert torch.equal(out[used:], torch.zeros_like(out[used:]))
    check(out, q, k, v, cu, d ** -0.5, True, torch.float16, used)


def test_only_sentinel_slots_give_all_zeros():
    T, hq, hk, d = 12, 2, 1, 64
    q, k, v = make_qkv(T, hq, hk, d, torch.float32, 3, fused=False)
    out = torch.full((T, hq, d), float("nan"), device=device)
    attention_varlen(q, k, v, out, cu_of([0, 0, 0]), 16, 0.125)
    assert torch.equal(out, torch.zeros_like(out))


def test_causal_mask_is_applied():
    """A future token with a huge value must not change earlier rows' outputs."""
    T, hq, hk, d = 20, 2, 2, 64
    q, k, v = make_qkv(T, hq, hk, d, torch.float32, 5, fused=False)
    cu = cu_of([T])
    out1 = torch.empty(T, hq, d, device=device)
    attention_varlen(q, k, v, out1, cu, T, 0.125)
    v2 = v.clone()
    v2[-1] = 1000.0
    out2 = torch.empty(T, hq, d, device=device)
    attention_varlen(q, k, v2, out2, cu, T, 0.125)
    torch.testing.assert_close(out1[:-1], out2[:-1])
    assert not torch.allclose(out1[-1], out2[-1])


@pytest.mark.parametrize("lengths", [[33], [30]], ids=["a request", "padding rows"])
def test_row_offsets_past_two_to_the_31_elements_do_not_wrap(lengths):
    """A row index times a row stride passes 2**31 elements in a long request of wide rows
    (a 256K-token prompt of 64 query heads of 128 from a fused projection): computed in
    int32, the offset wrapped and the kernel read q, k, v and wrote out 4 GiB before them
    (another tensor), leaving the row unwritten. Here q, k, v and out are column slices of
    rows 2**26 + 64 elements apart, so row 32's offset passes 2**31 (with lengths [30],
    row 32 is a padding row the kernel zeroes). They lie 2**31 elements into a buffer
    (lazily mapped on the CPU: only the touched pages cost memory) where sentinels wait
    at the wrapped addresses."""
    T, D, S, OFF = 33, 16, (1 << 26) + 64, 1 << 31
    try:
        big = torch.empty(OFF + T * S, dtype=torch.float16, device=device)
    except (RuntimeError, MemoryError):  # torch.OutOfMemoryError is a RuntimeError
        pytest.skip("no room for an 8.7 GB buffer (virtual, on the CPU)")
    view = big[OFF:].view(T, S)
    g = torch.Generator().manual_seed(0)
    view[:, :4 * D] = torch.randn(T, 4 * D, generator=g).half().to(device)
    q, k, v, out = (view[:, i * D:(i + 1) * D].view(T, 1, D) for i in range(4))
    out.fill_(float("nan"))
    wrapped = OFF + 32 * S - (1 << 32)  # row 32's elements, offset by -2**32
    big[wrapped:wrapped + 3 * D] = 1.0  # where row 32's q, k and v wrapped to
    sentinels = big[wrapped + 3 * D:wrapped + 4 * D]  # and its out
    sentinels.fill_(7.0)
    cu = cu_of(lengths)
    attention_varlen(q, k, v, out, cu, T, D ** -0.5)
    assert torch.equal(sentinels, torch.full_like(sentinels, 7.0)), "wrote out of bounds"
    check(out, q, k, v, cu, D ** -0.5, True, torch.float16, sum(lengths))
    del q, k, v, out, view, sentinels, big


def test_rejects_bad_arguments():
    q, k, v = make_qkv(4, 3, 2, 64, torch.float32, 0, fused=False)
    with pytest.raises(ValueError, match="multiple"):
        attention_varlen(q, k, v, torch.empty_like(q), cu_of([4]), 4, 0.125)
    q, k, v = make_qkv(4, 2, 1, 320, torch.float32, 0, fused=False)
    with pytest.raises(ValueError, match="head dim 320 must be in 1..256"):
        attention_varlen(q, k, v, torch.empty_like(q), cu_of([4]), 4, 0.125)


# ---- GPU: larger shapes and CUDA-graph capture -------------------------------------------


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,d", [((16, 8), 128), ((32, 4), 128), ((8, 8), 64),
                                     ((16, 2), 256)])
@pytest.mark.parametrize("lengths,T", [
    ([2048], 2048),
    ([1000, 0, 1048], 2048),
    ([511, 1, 0, 300, 129], 1024),
    ([64, 0, 0, 127], 256),
])
def test_large_shapes_match_reference(dtype, heads, d, lengths, T):
    hq, hk = heads
    used = sum(lengths)
    q, k, v = make_qkv(T, hq, hk, d, dtype, 11, fused=(hq == 16))
    poison_padding(q, k, v, used)
    out = torch.full((T, hq, d), float("nan"), dtype=dtype, device=device)
    cu = cu_of(lengths)
    attention_varlen(q, k, v, out, cu, T, d ** -0.5)
    check(out, q, k, v, cu, d ** -0.5, True, dtype, used)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replays_new_batches(dtype):
    from graphcap.core import new_pool

    T, slots, hq, hk, d = 256, 4, 16, 8, 128
    scale = d ** -0.5
    q = torch.zeros(T, hq, d, dtype=dtype, device=device)
    k = torch.zeros(T, hk, d, dtype=dtype, device=device)
    v = torch.zeros(T, hk, d, dtype=dtype, device=device)
    out = torch.zeros(T, hq, d, dtype=dtype, device=device)
    cu = cu_of([T, 0, 0, 0])

    def fn():
        return attention_varlen(q, k, v, out, cu, T, scale)

    pool = new_pool("cuda")
    g = pool.graph()
    with pool.warmup():
        fn()
    g.capture(fn)

    batches = [[100, 0, 37, 0], [256, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1], [0, 200, 0, 56],
               [17, 0, 0, 0]]
    for i, lengths in enumerate(batches):
        assert len(lengths) == slots
        used = sum(lengths)
        nq, nk, nv = make_qkv(T, hq, hk, d, dtype, 100 + i, fused=False)
        poison_padding(nq, nk, nv, used)
        q.copy_(nq)
        k.copy_(nk)
        v.copy_(nv)
        cu.copy_(cu_of(lengths))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(out, q, k, v, cu, scale, True, dtype, used)


@pytest.mark.parametrize("dtype, score", [(torch.float16, -20.0), (torch.bfloat16, -100.0),
                                          (torch.float32, -100.0)])
def test_a_small_window_keeps_every_row_exact_when_all_its_scores_are_low(dtype, score):
    # Rows past the first key block of a tile see no key in the first block they visit: a
    # stand-in running max of 0 there made later probabilities underflow in 16-bit.
    t, d = 160, 16  # past the first key block of a tile at every tile size
    q = torch.ones(t, 1, d, dtype=dtype, device=device)
    k = torch.full((t, 1, d), score / d ** 0.5, dtype=dtype, device=device)  # each: score
    v = torch.randn(t, 1, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    cu = torch.tensor([0, t], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    attention_varlen(q, k, v, out, cu, t, d ** -0.5, True, window=2)
    want = ref.attention_varlen(q, k, v, cu, d ** -0.5, True, 2)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
