"""Triton rms_norm, fused_add_rms_norm, silu_and_mul and rotary_embedding against the torch
reference, over random shapes, dtypes and strides (Triton's interpreter without a GPU),
and captured in a real CUDA graph where one is present."""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphcap.opsdb import reference as ref
from graphcap.opsdb.triton import activation, norm, rotary
from tests.conftest import requires_cuda

device = "cuda" if torch.cuda.is_available() else "cpu"
# On a CUDA machine every test here runs its kernels there, so the GPU suite runs them all.
pytestmark = [pytest.mark.gpu] if device == "cuda" else []

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# Token counts: empty, single, and around the block sizes.
tokens = st.one_of(st.sampled_from([0, 1, 2, 3, 7, 16, 17]), st.integers(0, 40))
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**31 - 1)


def randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=device)


def close(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


def rows_view(t: torch.Tensor, pad: int) -> torch.Tensor:
    """The same values as ``t`` [T, H] in a buffer whose rows are ``pad`` wider."""
    if pad == 0:
        return t.clone()
    buf = torch.full((t.shape[0], t.shape[1] + pad), float("nan"), dtype=t.dtype,
                     device=t.device)
    buf[:, :t.shape[1]] = t
    return buf[:, :t.shape[1]]


norm_configs = st.sampled_from([
    None,  # the launcher's own: whole row in registers at these widths
    (32, 16),  # force the streamed two-pass path: (_MAX_FUSED_H, _LOOP_BLOCK_H)
    (64, 64),
])


def patched_norm(config):
    if config is None:
        return contextlib.nullcontext()
    fused, loop = config
    return mock.patch.multiple(norm, _MAX_FUSED_H=fused, _LOOP_BLOCK_H=loop)


@settings(max_examples=15, deadline=None)
@example(T=5, H=40, dtype=torch.float32, pad=5, w_dtype="same", eps=0.1, give_out=False,
         config=None, seed=0)
@example(T=3, H=77, dtype=torch.bfloat16, pad=0, w_dtype="float32", eps=1e-6, give_out=True,
         config=(32, 16), seed=1)
@given(T=tokens, H=st.integers(8, 256), dtype=dtypes, pad=st.sampled_from([0, 0, 5, 64]),
       w_dtype=st.sampled_from(["same", "float32"]), eps=st.sampled_from([1e-6, 1e-5, 0.1]),
       give_out=st.booleans(), config=norm_configs, seed=seeds)
def test_rms_norm_matches_reference(T, H, dtype, pad, w_dtype, eps, give_out, config, seed):
    x = rows_view(randn(T, H, dtype=dtype, seed=seed), pad)
    weight = randn(H, dtype=dtype if w_dtype == "same" else torch.float32, seed=seed + 1)
    x_before = x.clone()
    out = torch.empty(T, H, dtype=dtype, device=device) if give_out else None
    with patched_norm(config):
        got = norm.rms_norm(x, weight, eps, out=out)
    if give_out:
        assert got is out
    assert got.shape == (T, H) and got.dtype == dtype
    close(got, ref.rms_norm(x_before, weight, eps), dtype)
    torch.testing.assert_close(x, x_before, rtol=0, atol=0)  # input untouched


@settings(max_examples=15, deadline=None)
@example(T=5, H=40, dtype=torch.float32, pad_x=3, pad_r=8, eps=0.1, config=None, seed=0)
@example(T=3, H=77, dtype=torch.float16, pad_x=0, pad_r=0, eps=1e-6, config=(32, 16), seed=1)
@given(T=tokens, H=st.integers(8, 256), dtype=dtypes, pad_x=st.sampled_from([0, 3, 32]),
       pad_r=st.sampled_from([0, 8]), eps=st.sampled_from([1e-6, 1e-5, 0.1]), config=norm_configs,
       seed=seeds)
def test_fused_add_rms_norm_matches_reference(T, H, dtype, pad_x, pad_r, eps, config, seed):
    x = rows_view(randn(T, H, dtype=dtype, seed=seed), pad_x)
    residual = rows_view(randn(T, H, dtype=dtype, seed=seed + 1, scale=3.0), pad_r)
    weight = randn(H, dtype=dtype, seed=seed + 2)
    x_ref, r_ref = x.clone(), residual.clone()
    ref.fused_add_rms_norm(x_ref, r_ref, weight, eps)
    with patched_norm(config):
        assert norm.fused_add_rms_norm(x, residual, weight, eps) is None
    close(residual, r_ref, dtype)
    close(x, x_ref, dtype)
    if pad_x:  # the padding columns of the row-strided buffer stay untouched
        assert torch.isnan(x.as_strided((T, pad_x), (x.stride(0), 1), H)).all()


def test_rms_norm_long_rows_stream_through_the_loop():
    # H > 8192 takes the two-pass path with the launcher's real block size.
    H = 3 * 4096 + 17
    x = randn(3, H, dtype=torch.float16, seed=0)
    weight = randn(H, dtype=torch.float16, seed=1)
    close(norm.rms_norm(x, weight, 1e-6), ref.rms_norm(x, weight, 1e-6), torch.float16)
    residual = randn(3, H, dtype=torch.float16, seed=2)
    x_ref, r_ref = x.clone(), residual.clone()
    ref.fused_add_rms_norm(x_ref, r_ref, weight, 1e-6)
    norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    close(residual, r_ref, torch.float16)
    close(x, x_ref, torch.float16)


@settings(max_examples=15, deadline=None)
@example(T=9, inter=40, dtype=torch.float32, pad=6, give_out=False,
         tiling=(264, 256, 1024, 4096), seed=0)
@example(T=11, inter=37, dtype=torch.bfloat16, pad=0, give_out=True, tiling=(1, 1, 16, 64),
         seed=1)
@given(T=st.one_of(tokens, st.integers(41, 70)), inter=st.integers(1, 160), dtype=dtypes,
       pad=st.sampled_from([0, 0, 6]), give_out=st.booleans(),
       tiling=st.sampled_from([(264, 256, 1024, 4096), (1, 1, 1024, 4096), (1, 1, 16, 64),
                               (1, 1, 32, 32), (10**9, 16, 1024, 4096)]),
       seed=seeds)
def test_silu_and_mul_matches_reference(T, inter, dtype, pad, give_out, tiling, seed):
    # tiling = (_MIN_PROGRAMS, _MIN_BLOCK_I, _MAX_BLOCK_I, _MAX_TILE): the launcher's own,
    # then ones that force several rows per tile, several column blocks per row, or the
    # narrowest tiles.
    min_programs, min_block_i, max_block_i, max_tile = tiling
    x = rows_view(randn(T, 2 * inter, dtype=dtype, seed=seed, scale=3.0), pad)
    out = torch.empty(T, inter, dtype=dtype, device=device) if give_out else None
    with mock.patch.multiple(activation, _MIN_PROGRAMS=min_programs, _MIN_BLOCK_I=min_block_i,
                             _MAX_BLOCK_I=max_block_i, _MAX_TILE=max_tile):
        got = activation.silu_and_mul(x, out=out)
    if give_out:
        assert got is out
    assert got.shape == (T, inter) and got.dtype == dtype
    close(got, ref.silu_and_mul(x), dtype)


def make_rotary(T, n_k, group, head_size, rot, dtype, cache_dtype, pos_dtype, seed,
                max_pos=50):
    """A packed qkv buffer with query and key as row-strided views of it, like a fused
    QKV projection's output."""
    n_q = n_k * group
    qkv = randn(T, (n_q + 2 * n_k) * head_size, dtype=dtype, seed=seed)
    query = qkv[:, :n_q * head_size]
    key = qkv[:, n_q * head_size:(n_q + n_k) * head_size]
    angles = randn(max_pos, rot // 2, dtype=torch.float32, seed=seed + 1, scale=3.0)
    cache = torch.cat((angles.cos(), angles.sin()), dim=-1).to(cache_dtype)
    g = torch.Generator().manual_seed(seed + 2)
    positions = torch.randint(0, max_pos, (T,), generator=g).to(pos_dtype).to(device)
    return qkv, query, key, cache, positions


@settings(max_examples=15, deadline=None)
@example(T=6, n_k=2, group=4, head_size=64, rot_frac=2, dtype=torch.float32,
         cache_same_dtype=False, pos_dtype=torch.int32, max_tile=8, seed=0)
@example(T=3, n_k=1, group=3, head_size=32, rot_frac=0, dtype=torch.bfloat16,
         cache_same_dtype=True, pos_dtype=torch.int64, max_tile=2048, seed=1)
@given(T=tokens, n_k=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 4, 8]),
       head_size=st.sampled_from([8, 16, 32, 64, 128]), rot_frac=st.sampled_from([1, 2, 4, 0]),
       dtype=dtypes, cache_same_dtype=st.booleans(),
       pos_dtype=st.sampled_from([torch.int64, torch.int32]), max_tile=st.sampled_from([2048, 8]),
       seed=seeds)
def test_rotary_embedding_matches_reference(T, n_k, group, head_size, rot_frac, dtype,
                                            cache_same_dtype, pos_dtype, max_tile, seed):
    # rot_frac 0 picks an odd-looking partial rot_dim (a non-power-of-two half).
    rot = head_size // rot_frac if rot_frac else max(2, (head_size * 3 // 8) // 2 * 2)
    cache_dtype = dtype if cache_same_dtype else torch.float32
    qkv, query, key, cache, positions = make_rotary(
        T, n_k, group, head_size, rot, dtype, cache_dtype, pos_dtype, seed)
    expected = qkv.clone()
    n_q = n_k * group
    ref.rotary_embedding(positions, expected[:, :n_q * head_size],
                         expected[:, n_q * head_size:(n_q + n_k) * head_size], cache,
                         head_size)
    with mock.patch.object(rotary, "_MAX_TILE", max_tile):  # 8: loop over head blocks
        assert rotary.rotary_embedding(positions, query, key, cache, head_size) is None
    # Rotated dims match; unrotated dims and the value heads are bit-identical.
    close(qkv, expected, dtype)
    n_heads = n_q + 2 * n_k
    heads = qkv.view(T, n_heads, head_size)
    torch.testing.assert_close(heads[..., rot:],
                               expected.view(T, n_heads, head_size)[..., rot:], rtol=0, atol=0)
    torch.testing.assert_close(qkv[:, (n_q + n_k) * head_size:],
                               expected[:, (n_q + n_k) * head_size:], rtol=0, atol=0)


def test_rotary_accepts_3d_views_and_no_key():
    qkv, query, key, cache, positions = make_rotary(
        5, 2, 2, 16, 16, torch.float32, torch.float32, torch.int64, seed=3)
    q3 = query.view(5, 4, 16)
    expected_q = query.clone()
    ref.rotary_embedding(positions, expected_q, key.clone(), cache, 16)
    rotary.rotary_embedding(positions, q3, None, cache, 16)
    close(query, expected_q, torch.float32)


def test_misuse_is_rejected_before_launch():
    x = randn(4, 16, dtype=torch.float32, seed=0)
    w = randn(16, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="contiguous last dim"):
        norm.rms_norm(x.t().contiguous().t(), w, 1e-6)
    with pytest.raises(ValueError, match="weight"):
        norm.rms_norm(x, w[:8], 1e-6)
    with pytest.raises(ValueError, match=r"\[T, 2\*I\]"):
        activation.silu_and_mul(randn(4, 7, dtype=torch.float32, seed=2))
    qkv, query, key, cache, positions = make_rotary(
        4, 1, 1, 16, 16, torch.float32, torch.float32, torch.int64, seed=4)
    with pytest.raises(ValueError, match="rot_dim"):
        rotary.rotary_embedding(positions, query, key, torch.cat((cache, cache), 1), 16)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_launchers_replay_in_a_cuda_graph(dtype):
    from graphcap.core import new_pool

    pool = new_pool("cuda")
    T, H, eps = 37, 1024, 1e-6

    def captured(fn, *args):
        with pool.warmup():
            fn(*args)
        g = pool.graph()
        return g, g.capture(fn, *args)

    # rms_norm: out allocated inside the capture.
    x = randn(T, H, dtype=dtype, seed=0)
    w = randn(H, dtype=dtype, seed=1)
    g, out = captured(norm.rms_norm, x, w, eps)
    new_x = randn(T, H, dtype=dtype, seed=2)
    x.copy_(new_x)
    g.replay()
    torch.cuda.synchronize()
    close(out, ref.rms_norm(new_x, w, eps), dtype)

    # fused_add_rms_norm: in place.
    x, res = randn(T, H, dtype=dtype, seed=3), randn(T, H, dtype=dtype, seed=4)
    g, _ = captured(norm.fused_add_rms_norm, x, res, w, eps)
    new_x, new_res = randn(T, H, dtype=dtype, seed=5), randn(T, H, dtype=dtype, seed=6)
    x.copy_(new_x)
    res.copy_(new_res)
    g.replay()
    torch.cuda.synchronize()
    ref.fused_add_rms_norm(new_x, new_res, w, eps)
    close(res, new_res, dtype)
    close(x, new_x, dtype)

    # silu_and_mul: out allocated inside the capture.
    xa = randn(T, 2 * H, dtype=dtype, seed=7)
    g, out = captured(activation.silu_and_mul, xa)
    new_xa = randn(T, 2 * H, dtype=dtype, seed=8)
    xa.copy_(new_xa)
    g.replay()
    torch.cuda.synchronize()
    close(out, ref.silu_and_mul(new_xa), dtype)

    # rotary_embedding: in place, GQA, partial rotary, int32 positions.
    qkv, query, key, cache, positions = make_rotary(
        T, 2, 4, 128, 64, dtype, torch.float32, torch.int32, seed=9, max_pos=4096)
    g, _ = captured(rotary.rotary_embedding, positions, query, key, cache, 128)
    new_qkv, _, _, _, new_pos = make_rotary(
        T, 2, 4, 128, 64, dtype, torch.float32, torch.int32, seed=10, max_pos=4096)
    qkv.copy_(new_qkv)
    positions.copy_(new_pos)
    g.replay()
    torch.cuda.synchronize()
    expected = new_qkv.clone()
    ref.rotary_embedding(new_pos, expected[:, :8 * 128], expected[:, 8 * 128:10 * 128],
                         cache, 128)
    close(qkv, expected, dtype)
