"""Attention backends: metadata outside the graph, replay with different sentinel batches."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.core.context import forward_context
from graphcap.errors import BackendUnavailable, GraphcapError, UnsupportedStrategy
from graphcap.opsdb import OpInputError
from graphcap.opsdb.attention import BACKENDS, get_backend
from graphcap.opsdb.reference import attention_varlen
from graphcap.testing import default_tolerance

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CAPTURABLE = [n for n, cls in BACKENDS.items() if cls.static_metadata]


def available(device, names=tuple(BACKENDS)):
    return [n for n in names if BACKENDS[n]().unavailable(device) is None]


def params(names):
    """On a GPU machine these run under -m gpu; on CPU, in the default run."""
    marks = [pytest.mark.gpu] if DEVICE == "cuda" else []
    return [pytest.param(n, marks=marks) for n in names]


def qkv(lens_total, tokens, hq, hk, d, dtype, device, seed=0, poison=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(tokens, h, d, generator=gen).to(device, dtype)
               for h in (hq, hk, hk))
    if poison and tokens > lens_total:  # padding rows must not leak into real rows
        for t in (q, k, v):
            t[lens_total:] = float("nan")
    return q, k, v


def run_attention(meta, q, k, v, scale):
    out = torch.full_like(q, float("nan"))
    with forward_context(attention=meta):
        torch.ops.graphcap.attention(q, k, v, out, scale)
    return out


def expect(q, k, v, meta, scale):
    return attention_varlen(torch.nan_to_num(q), torch.nan_to_num(k), torch.nan_to_num(v),
                            meta.cu_seqlens_host, scale)


batches = st.lists(st.integers(0, 24), min_size=1, max_size=4)


@pytest.mark.parametrize("name", params(available(DEVICE)))
@settings(max_examples=12, deadline=None)
@given(lens=batches, pad=st.integers(0, 5), group=st.sampled_from([1, 2, 8]),
       d=st.sampled_from([64, 128]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
def test_each_backend_matches_the_reference_with_sentinels_and_padding(name, lens, pad, group,
                                                                       d, dtype):
    tokens = max(sum(lens) + pad, 1)
    if dtype not in BACKENDS[name].dtypes:
        return
    if name == "flashinfer" and dtype != torch.bfloat16:
        # Each FlashInfer dtype x head dim is its own JIT build, 80-95 s on the GPU
        # machine: bf16 (what the models and benchmarks run) at both head dims only.
        return
    meta = get_backend(name, DEVICE).metadata(tokens, 4, DEVICE).update(lens)
    q, k, v = qkv(sum(lens), tokens, group, 1, d, dtype, DEVICE, seed=len(lens) + pad)
    scale = 1 / math.sqrt(d)
    out = run_attention(meta, q, k, v, scale)
    tol = 2 * default_tolerance(dtype)
    torch.testing.assert_close(out, expect(q, k, v, meta, scale), atol=tol, rtol=tol)
    assert not out[sum(lens):].any()


@pytest.mark.parametrize("name", CAPTURABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_capturable_backends_replay_batches_with_different_sentinel_slots(pool, name, dtype):
    why = BACKENDS[name]().unavailable(pool.device)
    if why or dtype not in BACKENDS[name].dtypes:
        pytest.skip(why or f"{name} does not run {dtype}")
    tokens, slots, hq, hk, d = 64, 4, 4, 2, 64
    scale = 1 / math.sqrt(d)
    backend = get_backend(name, pool.device, strategy="full")
    meta = backend.metadata(tokens, slots, pool.device).update([tokens])
    q, k, v = qkv(tokens, tokens, hq, hk, d, dtype, pool.device)
    out = torch.zeros_like(q)

    def forward():
        with forward_context(attention=meta):
            torch.ops.graphcap.attention(q, k, v, out, scale)
        return out

    with pool.warmup():
        forward()
    graph = pool.graph()
    graph.capture(forward)
    for seed, lens in enumerate([[30, 0, 17, 0], [1, 1, 1, 1], [0, 0, 5, 0], [64], [20, 3]]):
        meta.update(lens)
        fresh = qkv(sum(lens), tokens, hq, hk, d, dtype, pool.device, seed=seed)
        for static, new in zip((q, k, v), fresh, strict=True):
            static.copy_(new)
        graph.replay()
        tol = 2 * default_tolerance(dtype)
        torch.testing.assert_close(out, expect(q, k, v, meta, scale), atol=tol, rtol=tol,
                                   msg=lambda m, b=lens: f"{name} {b}: {m}")
        assert not out[sum(lens):].any(), f"{name}: padding rows not zero for {lens}"


def test_torch_varlen_refuses_full_capture_and_says_what_to_use():
    with pytest.raises(UnsupportedStrategy, match="torch_varlen.*full.*breakable"):
        get_backend("torch_varlen", "cpu", strategy="full")


def test_the_best_backend_for_full_capture_is_a_capturable_one():
    assert get_backend(None, DEVICE, strategy="full").static_metadata


def test_an_unknown_or_unavailable_backend_says_why():
    with pytest.raises(GraphcapError, match="no attention backend 'sdpa'"):
        get_backend("sdpa")
    with pytest.raises(GraphcapError, match="flashinfer"):
        get_backend("flashinfer", "cpu")


BAD_LENS = {
    "negative": ([3, -1], "non-negative"),
    "too many requests": ([1, 1, 1, 1, 1], "5 requests do not fit 4"),
    "more tokens than rows": ([10, 10], "sum to 20"),
    "empty": ([], "empty"),
}


@pytest.mark.parametrize("case", sorted(BAD_LENS))
def test_bad_lengths_are_rejected_and_the_metadata_stays_usable(case):
    lens, needle = BAD_LENS[case]
    meta = get_backend("torch_masked").metadata(16, 4, "cpu").update([16])
    with pytest.raises(OpInputError, match=needle):
        meta.update(lens)
    assert meta.seq_lens == [16]
    meta.update([4, 4])
    assert meta.cu_seqlens.tolist() == [0, 4, 8, 8, 8]


def test_a_token_count_other_than_the_metadata_is_rejected():
    meta = get_backend("torch_masked").metadata(16, 2, "cpu").update([8])
    q = torch.randn(8, 2, 16)
    with pytest.raises(OpInputError, match="prepared for 16"):
        run_attention(meta, q, q, q, 0.25)


def test_heads_that_do_not_divide_are_rejected():
    meta = get_backend("torch_masked").metadata(8, 1, "cpu").update([8])
    q, kv = torch.randn(8, 3, 16), torch.randn(8, 2, 16)
    with pytest.raises(OpInputError, match="not a multiple"):
        run_attention(meta, q, kv, kv, 0.25)


def test_attention_outside_a_forward_context_explains_what_to_do():
    q = torch.randn(4, 2, 16)
    with pytest.raises(GraphcapError, match=r"graphcap\.packed\(seq_lens"):
        torch.ops.graphcap.attention(q, q, q, torch.empty_like(q), 0.25)


def test_the_attention_op_passes_opcheck_inside_a_forward_context():
    meta = get_backend("torch_masked").metadata(12, 3, "cpu").update([5, 0, 6])
    q, k, v = qkv(11, 12, 4, 2, 16, torch.float32, "cpu", poison=False)
    with forward_context(attention=meta):
        torch.library.opcheck(torch.ops.graphcap.attention.default,
                              (q, k, v, torch.zeros_like(q), 0.25))


def test_a_backend_refuses_a_dtype_it_cannot_run():
    meta = get_backend("torch_masked").metadata(8, 1, "cpu").update([8])
    meta.backend.dtypes = (torch.bfloat16,)
    q = torch.randn(8, 2, 16)
    with pytest.raises(OpInputError, match="runs on bfloat16, not float32"):
        run_attention(meta, q, q, q, 0.25)


def test_last_token_rows_come_from_the_static_offsets_sentinels_included():
    meta = get_backend("torch_masked").metadata(12, 4, "cpu").update([5, 0, 6])
    out = torch.full((4,), -1, dtype=torch.long)
    meta.last_token_rows(out=out)
    # slot 1 (empty) and the unused slot 3 point at real rows, never out of range
    assert out.tolist() == [4, 4, 10, 10] == meta.last_token_rows().tolist()


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
def test_updates_far_ahead_of_the_device_never_rewrite_offsets_before_their_copy():
    # The host writes each update into the next of a round of pinned buffers and waits
    # once a round: with the stream held back, every copy still delivers its own batch.
    from graphcap.opsdb.attention.base import HOST_BUFFERS

    meta = get_backend("triton", "cuda").metadata(64, 3, torch.device("cuda"))
    batches = [[n % 7, (3 * n) % 11, n % 5] for n in range(3 * HOST_BUFFERS + 2)]
    seen = []
    torch.cuda._sleep(50_000_000)  # tens of ms: the updates below run far ahead
    for lens in batches:
        meta.update(lens, derive=False)
        seen.append(meta.cu_seqlens.clone())  # in stream order, after this copy
    torch.cuda.synchronize()
    for lens, got in zip(batches, seen, strict=True):
        want = [0, lens[0], lens[0] + lens[1], sum(lens)]
        assert got.tolist() == want, lens


def test_packed_without_a_dtype_picks_a_backend_that_runs_every_dtype(monkeypatch):
    """graphcap.packed does not know the forward's dtype: a half-precision-only backend
    (FlashAttention-4 where it is installed) first in line is passed over for one that
    runs float32 too; given a half dtype, it is picked."""
    import graphcap
    from graphcap.opsdb.attention import TorchVarlen

    class HalfOnly(TorchVarlen):
        name = "half_only"
        dtypes = (torch.float16, torch.bfloat16)

    monkeypatch.setattr("graphcap.opsdb.attention.BACKENDS",
                        {"half_only": HalfOnly, **BACKENDS})
    q, k, v = qkv(3, 3, 2, 2, 8, torch.float32, "cpu")
    with graphcap.packed([3], "cpu") as meta:
        out = torch.empty_like(q)
        torch.ops.graphcap.attention(q, k, v, out, 0.5)
    assert meta.backend.name != "half_only"
    torch.testing.assert_close(out, expect(q, k, v, meta, 0.5))
    with graphcap.packed([3], "cpu", dtype=torch.bfloat16) as meta:
        assert meta.backend.name == "half_only"
        torch.ops.graphcap.attention(*(t.bfloat16() for t in (q, k, v)), out.bfloat16(), 0.5)


def test_a_dtype_no_backend_takes_is_refused_naming_those_they_take():
    with pytest.raises(BackendUnavailable, match="for torch.float64; the backends take "
                       "bfloat16, float16, float32: build the model in one of them"):
        get_backend(None, "cpu", strategy="full", dtype=torch.float64)
    assert get_backend(None, "cpu", strategy="full", dtype=torch.float32).name


def test_an_option_name_no_backend_knows_is_refused_naming_those_there_are():
    from graphcap.opsdb.attention import check_serves

    with pytest.raises(ValueError, match=r"attention options \['sink'\], which are none of "):
        check_serves(BACKENDS["torch_masked"](), ("window", "sink"), device="cpu")


FA2_OF_2_8_3 = '''
from graphcap.opsdb.reference import attention_varlen


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0):
    # FA2's one-query path: at max_seqlen_q 1, no window and grouped heads it folds the
    # groups into one row per request, [batch, heads_k, groups, d] (mha_varlen_fwd).
    if max_seqlen_q == 1 and q.shape[1] > k.shape[1] and window_size[0] < 0 \
            and q.shape[-1] % 8 == 0:
        q.reshape(len(cu_seqlens_q) - 1, k.shape[1], q.shape[1] // k.shape[1], q.shape[-1])
    window = window_size[0] + 1 if window_size[0] >= 0 else 0
    return attention_varlen(q, k, v, cu_seqlens_q, softmax_scale, causal, window, softcap)
'''


@pytest.fixture
def flash_attn_2_8_3(tmp_path, monkeypatch):
    """flash-attn 2.8.3 as its wheel installs it: FA2's varlen function (here the
    reference, with FA2's signature), and FA4's sources as flash_attn/cute, whose import
    needs the CuTe DSL (cutlass, cuda.bindings) the wheel does not bring."""
    from graphcap.opsdb.attention import flash_attn_backend

    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "__init__.py").write_text(FA2_OF_2_8_3)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text(
        "import cuda.bindings.driver\nimport cutlass\n")
    ours = {n: m for n, m in sys.modules.items() if n.split(".")[0] == "flash_attn"}
    for name in ours:
        del sys.modules[name]
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, "cutlass", None)  # not installed, whatever is here
    monkeypatch.setattr(flash_attn_backend.FlashAttention, "devices", ("cuda", "cpu"))
    caches = [f for f in vars(flash_attn_backend).values() if hasattr(f, "cache_clear")]
    for cached in caches:
        cached.cache_clear()
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "flash_attn"]:
        del sys.modules[name]
    sys.modules.update(ours)
    for cached in caches:
        cached.cache_clear()


def test_flash_attn_runs_fa2_where_flash_attn_cute_comes_without_its_dsl(flash_attn_2_8_3):
    import graphcap
    from graphcap.opsdb.attention.flash_attn_backend import FlashAttention

    assert FlashAttention().options == {"window", "softcap"}  # FA2's: no sinks
    lens, dtype = [5, 0, 3], torch.bfloat16
    q, k, v = qkv(8, 8, 4, 2, 16, dtype, "cpu", poison=False)
    with graphcap.packed(lens, "cpu", attention="flash_attn", dtype=dtype) as meta:
        out = torch.empty_like(q)
        torch.ops.graphcap.attention(q, k, v, out, 0.25, 3, 0.0, None)
        with pytest.raises(OpInputError, match="does not compute attention sinks"):
            torch.ops.graphcap.attention(q, k, v, out, 0.25, 0, 0.0, torch.zeros(4))
    want = attention_varlen(q, k, v, meta.cu_seqlens_host, 0.25, True, 3)
    torch.testing.assert_close(out, want)


def test_flash_attn_fa2_serves_a_one_token_bucket_beside_empty_requests(flash_attn_2_8_3):
    """A bucket of one token with request slots to spare (zero-length sentinels) must not
    take FA2's one-query path, which reads one query row per request."""
    import graphcap

    lens, dtype = [1, 0, 0], torch.bfloat16
    q, k, v = qkv(1, 1, 4, 2, 16, dtype, "cpu")
    with graphcap.packed(lens, "cpu", attention="flash_attn", dtype=dtype) as meta:
        out = torch.empty_like(q)
        torch.ops.graphcap.attention(q, k, v, out, 0.25, 0, 0.0, None)
    torch.testing.assert_close(out, attention_varlen(q, k, v, meta.cu_seqlens_host, 0.25, True))


@pytest.mark.parametrize("case", ["head dim", "strided q", "strided out"])
def test_the_triton_backend_refuses_what_its_kernel_cannot_take_as_the_op_refuses(case):
    # The launcher's bare ValueError ("head dim 300 must be in 1..256") named no op.
    if BACKENDS["triton"]().unavailable(DEVICE) is not None:
        pytest.skip("the Triton kernel: on a GPU or under Triton's interpreter")
    meta = get_backend("triton", DEVICE).metadata(4, 1, DEVICE).update([4])
    d = 300 if case == "head dim" else 16
    q, k, v = qkv(4, 4, 2, 1, d, torch.float32, DEVICE, poison=False)
    out = torch.zeros_like(q)
    if case == "strided q":
        q = torch.randn(4, 2, 2 * d, device=DEVICE)[..., ::2]
    if case == "strided out":
        out = torch.zeros(4, 2, 2 * d, device=DEVICE)[..., ::2]
    with forward_context(attention=meta), pytest.raises(
            OpInputError, match="attention: backend 'triton' takes"):
        torch.ops.graphcap.attention(q, k, v, out, 0.25)
