"""Per-layer attention variants (a sliding window, soft-capped scores, sink logits): the
torch references against transformers' own eager attention of the models that use them
(gpt-oss, Gemma 2), the Triton prefill and decode kernels against the references (Triton's
interpreter without a GPU), decode against prefill's last row, the backends through the
ops, and what a backend that cannot compute an option says."""

from __future__ import annotations

import itertools
import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import graphcap
from graphcap.core.context import forward_context
from graphcap.errors import BackendUnavailable
from graphcap.opsdb import OpInputError
from graphcap.opsdb import reference as ref
from graphcap.opsdb.attention import BACKENDS, get_backend
from graphcap.opsdb.attention.torch_backends import TorchMasked
from graphcap.opsdb.decode import decode_attention_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []  # the kernels on CUDA there
transformers = pytest.importorskip("transformers")


def cu_of(lengths) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def qkv(T, hq, hk, d, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(T, h, d, generator=g).to(device) for h in (hq, hk, hk))


def transformers_mask(n: int, window: int) -> torch.Tensor:
    """transformers' causal (sliding-window) mask for one request of ``n`` tokens, as the
    additive [1, 1, n, n] mask its eager attention takes."""
    from transformers.masking_utils import (
        and_masks,
        causal_mask_function,
        sliding_window_overlay,
    )

    fn = causal_mask_function if not window else \
        and_masks(causal_mask_function, sliding_window_overlay(window))
    zero, idx = torch.tensor(0), torch.arange(n)
    seen = torch.stack([torch.stack([fn(zero, zero, i, j) for j in idx]) for i in idx])
    return torch.zeros(n, n).masked_fill(~seen, float("-inf"))[None, None]


def as_transformers(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1)[None]  # [T, H, D] -> [1, H, T, D]


@pytest.mark.parametrize("window", [0, 1, 4, 64])
def test_sinks_and_a_window_are_gpt_oss_attention(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    n, hq, hk, d = 11, 4, 2, 16
    q, k, v = qkv(n, hq, hk, d, seed=window)
    sinks = torch.randn(hq) * 2
    module = SimpleNamespace(num_key_value_groups=hq // hk, training=False, sinks=sinks)
    want, _ = eager_attention_forward(module, as_transformers(q), as_transformers(k),
                                      as_transformers(v), transformers_mask(n, window), 0.25)
    got = ref.attention_varlen(q, k, v, cu_of([n]), 0.25, True, window, 0.0, sinks)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
def test_soft_capped_scores_and_a_window_are_gemma_2_attention(window):
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    n, hq, hk, d = 9, 2, 1, 16
    q, k, v = (t * 4 for t in qkv(n, hq, hk, d, seed=1))  # scores past the cap
    module = SimpleNamespace(num_key_value_groups=hq // hk, training=False, head_dim=d)
    want, _ = eager_attention_forward(module, as_transformers(q), as_transformers(k),
                                      as_transformers(v), transformers_mask(n, window),
                                      scaling=0.25, softcap=5.0)
    got = ref.attention_varlen(q, k, v, cu_of([n]), 0.25, True, window, 5.0)
    torch.testing.assert_close(got, want[0], rtol=1e-5, atol=1e-5)


variants = st.tuples(st.sampled_from([0, 1, 2, 5, 16, 17, 40, 1000]),
                     st.sampled_from([0.0, 0.7, 30.0]), st.booleans())


@settings(max_examples=25, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 2, 15, 16, 17, 33, 50]), min_size=1,
                        max_size=3),
       pad=st.integers(0, 3), group=st.sampled_from([1, 2]), variant=variants,
       seed=st.integers(0, 2**16))
def test_the_triton_prefill_kernel_computes_every_variant_as_the_reference(
        lengths, pad, group, variant, seed):
    """Windows shorter and longer than the requests and at the kernel's block edges,
    sentinel requests, padding rows (NaN: they never reach a real row)."""
    from graphcap.opsdb.triton.attention import attention_varlen

    window, softcap, with_sinks = variant
    used = sum(lengths)
    T, hk, d = used + pad, 1, 16
    q, k, v = qkv(max(T, 1), hk * group, hk, d, seed, DEVICE)
    for t in (q, k, v):
        t[used:] = float("nan")
    sinks = torch.randn(hk * group, generator=torch.Generator().manual_seed(seed),
                        device="cpu").to(DEVICE) if with_sinks else None
    cu = cu_of(lengths).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    attention_varlen(q, k, v, out, cu, max(lengths + [1]), 0.3, True, window, softcap, sinks)
    want = ref.attention_varlen(torch.nan_to_num(q), k.nan_to_num(), v.nan_to_num(), cu,
                                0.3, True, window, softcap, sinks)
    torch.testing.assert_close(out[:used], want[:used], rtol=2e-4, atol=2e-4)
    assert torch.equal(out[used:], torch.zeros_like(out[used:]))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 40), page=st.sampled_from([1, 4, 16]), variant=variants,
       seed=st.integers(0, 2**16), kernel=st.sampled_from(["torch", "triton"]))
def test_decode_is_the_last_row_of_prefill_over_the_same_tokens(n, page, variant, seed,
                                                                kernel):
    """A token decoded over its request's cached tokens (scattered over shuffled pages,
    every slot it must not read, before its window included, NaN) comes out as the last
    row of prefill attention over the whole request."""
    from graphcap.opsdb.decode import DECODE_ATTENTION

    window, softcap, with_sinks = variant
    hq, hk, d = 4, 2, 16
    q, k, v = qkv(n, hq, hk, d, seed)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) \
        if with_sinks else None
    want = ref.attention_varlen(q, k, v, cu_of([n]), 0.3, True, window, softcap, sinks)[-1]
    width = -(-n // page)
    pages = width + 3
    order = torch.randperm(pages, generator=torch.Generator().manual_seed(seed))
    table = order[:width].to(torch.int32)[None]
    k_cache = torch.full((pages, page, hk, d), float("nan"))
    v_cache = torch.full((pages, page, hk, d), float("nan"))
    first = max(0, n - window) if window else 0  # what the window lets the token see
    for t in range(first, n):
        k_cache[table[0, t // page], t % page] = k[t]
        v_cache[table[0, t // page], t % page] = v[t]
    out = torch.empty(1, hq, d)
    args = [x.to(DEVICE) for x in (q[-1:], k_cache, v_cache, table,
                                   torch.tensor([n], dtype=torch.int32), out)]
    DECODE_ATTENTION(*args, 0.3, window, softcap, None if sinks is None else sinks.to(DEVICE),
                     kernel=kernel if kernel == "torch" or DEVICE == "cpu" else "triton")
    torch.testing.assert_close(args[-1][0].cpu(), want, rtol=2e-4, atol=2e-4)


def test_a_row_with_sinks_and_no_token_comes_out_zero():
    q = torch.randn(2, 2, 16)
    cache = torch.randn(1, 4, 1, 16)
    out = torch.full_like(q, float("nan"))
    decode_attention_reference(q, cache, cache, torch.zeros(2, 1, dtype=torch.int32),
                               torch.tensor([0, 3], dtype=torch.int32), out, 0.25, 2, 0.0,
                               torch.tensor([1.0, -1.0]))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and out[1].isfinite().all()


VARIANTS = (dict(window=3), dict(softcap=2.0), dict(sinks=True),
            dict(window=3, softcap=2.0, sinks=True))


def served(options: frozenset[str]) -> list[dict]:
    """Each of ``VARIANTS`` a backend computing ``options`` can run, cut to those options
    (the three together become the ones it computes together), without repeats."""
    cut = [{o: v for o, v in x.items() if o in options} for x in VARIANTS]
    return [x for i, x in enumerate(cut) if x and x not in cut[:i]]


@pytest.mark.parametrize("name,variant", [
    (n, v) for n, cls in BACKENDS.items() if cls.options and cls().unavailable(DEVICE) is None
    for v in served(cls.options)])
def test_every_backend_that_says_so_computes_every_variant_through_the_op(name, variant):
    """Each option alone and all it computes together, against the reference, in float32
    or, for a backend without it (FlashAttention, FlashInfer), bf16 (the reference
    computes from the same bf16 values)."""
    backend = BACKENDS[name]
    dtype = torch.float32 if torch.float32 in backend.dtypes else torch.bfloat16
    lengths = [7, 0, 5]
    q, k, v = (t.to(dtype) for t in qkv(12, 4, 2, 64, seed=3, device=DEVICE))
    window, softcap = variant.get("window", 0), variant.get("softcap", 0.0)
    sinks = torch.randn(4).to(DEVICE) if variant.get("sinks") else None
    with graphcap.packed(lengths, DEVICE, attention=name, dtype=dtype):
        out = torch.empty_like(q)
        torch.ops.graphcap.attention(q, k, v, out, 0.125, window, softcap, sinks)
    want = ref.attention_varlen(q.float(), k.float(), v.float(), cu_of(lengths).to(DEVICE),
                                0.125, True, window, softcap, sinks)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), want, rtol=tol, atol=tol)


def test_a_backend_that_cannot_compute_an_option_is_refused_naming_those_that_can():
    class PlainOnly(TorchMasked):
        name = "plain_only"
        options = frozenset()

    q, k, v = qkv(5, 2, 2, 16)
    meta = PlainOnly().prepare([5], "cpu")
    out = torch.empty_like(q)
    with forward_context(attention=meta):
        torch.ops.graphcap.attention(q, k, v, out, 0.25, 1000)  # cannot bind: plain
        with pytest.raises(OpInputError, match=r"'plain_only' does not compute attention "
                                               r"sinks; pick one that does: .*torch_masked"):
            torch.ops.graphcap.attention(q, k, v, out, 0.25, 0, 0.0, torch.zeros(2))
        with pytest.raises(OpInputError, match="a sliding window and soft-capped scores"):
            torch.ops.graphcap.attention(q, k, v, out, 0.25, 2, 1.0)


def test_bad_options_are_refused_by_name():
    q, k, v = qkv(5, 2, 2, 16)
    out = torch.empty_like(q)
    with graphcap.packed([5], "cpu"):
        for args, match in (((-1,), "window must be an int >= 0"),
                            ((0, float("nan")), "softcap must be a finite float"),
                            ((0, 0.0, torch.zeros(3)), "the head count")):
            with pytest.raises(OpInputError, match=match):
                torch.ops.graphcap.attention(q, k, v, out, 0.25, *args)


def test_the_automatic_choice_passes_over_backends_without_the_options(monkeypatch):
    class PlainOnly(TorchMasked):
        name = "plain_only"
        options = frozenset()

    monkeypatch.setattr("graphcap.opsdb.attention.BACKENDS",
                        {"plain_only": PlainOnly, **BACKENDS})
    assert get_backend(None, "cpu").name == "plain_only"
    assert get_backend(None, "cpu", options=("window", "sinks")).name != "plain_only"
    monkeypatch.setattr("graphcap.opsdb.attention.BACKENDS", {"plain_only": PlainOnly})
    with pytest.raises(BackendUnavailable, match="computing sinks"):
        get_backend(None, "cpu", options=("sinks",))


def test_a_named_backend_is_refused_for_options_it_does_not_compute_before_any_call(
        monkeypatch):
    class PlainOnly(TorchMasked):
        name = "plain_only"
        options = frozenset({"window"})

    monkeypatch.setitem(BACKENDS, "plain_only", PlainOnly)
    assert get_backend("plain_only", "cpu", options=("window",)).name == "plain_only"
    with pytest.raises(BackendUnavailable, match=r"the model's layers use soft-capped scores "
                       r"and attention sinks \('softcap', 'sinks'\), which prefill attention "
                       r"backend 'plain_only' does not compute; pick one that does: "
                       r".*torch_masked"):
        get_backend("plain_only", "cpu", options=("sinks", "window", "softcap"))
    with pytest.raises(BackendUnavailable, match="'plain_only' does not compute"):
        with graphcap.packed([3], "cpu", attention="plain_only", options=("sinks",)):
            pass


def test_flash_attn_says_it_computes_sinks_only_where_fa4_is_installed(monkeypatch):
    from graphcap.opsdb.attention import flash_attn_backend, serving
    from graphcap.opsdb.attention.variant import Variant
    from graphcap.opsdb.listing import attention_backends

    monkeypatch.setattr(flash_attn_backend, "_fa2_or_fa3_only", lambda: True)
    monkeypatch.setattr(flash_attn_backend.FlashAttention, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(flash_attn_backend.FlashAttention, "requires", ())
    assert flash_attn_backend.FlashAttention().options == {"window", "softcap"}
    sinks = Variant(0, 0.0, torch.zeros(2))
    assert "flash_attn" not in serving(sinks.used, torch.device("cpu"))
    assert "flash_attn" in serving(Variant(4, 0.0, None).used, torch.device("cpu"))
    row = next(r for r in attention_backends("cpu") if r["backend"] == "flash_attn")
    assert row["options"] == ["window", "softcap"]


def test_flashinfer_decode_refuses_a_layer_of_another_scale_than_it_planned_with():
    # It plans the first run's heads and scale for every layer (no GPU needed to refuse).
    from graphcap.opsdb.attention.flashinfer_decode import FlashInferDecode

    backend = FlashInferDecode()
    backend.heads = (4, 0.125)
    q = torch.zeros(2, 4, 16)
    with pytest.raises(OpInputError, match="planned its kernels for 4 query heads at "
                                           "softmax scale 0.125, and this layer has 4 at 0.25"):
        backend.forward(q, None, None, SimpleNamespace(plan=None), torch.empty_like(q), 0.25)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(0, 3), min_size=1, max_size=9),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
       seed=st.integers(0, 2**16))
def test_flashinfer_decode_zeroes_each_pad_rows_output_and_leaves_the_others_as_they_are(
        lens, dtype, seed):
    """A row of length 0 (a pad, planned over the null page) comes out all zeros whatever
    FlashInfer wrote there, NaN included; every other row bit for bit as it was."""
    from graphcap.opsdb.attention.flashinfer_decode import zero_pads

    g = torch.Generator().manual_seed(seed)
    out = torch.randn(len(lens), 3, 8, generator=g)
    out[torch.rand(out.shape, generator=g) < 0.2] = float("nan")
    out = out.to(DEVICE, dtype)
    before = out.clone()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    zero_pads(out, seq_lens)
    pads = seq_lens == 0
    assert torch.equal(out[pads], torch.zeros_like(out[pads]))
    torch.testing.assert_close(out[~pads], before[~pads], rtol=0, atol=0, equal_nan=True)


def test_flashinfer_prefill_refuses_a_layer_of_another_scale_than_it_planned_with():
    """FlashInfer fixes the softmax scale when it plans (from the first layer it runs):
    a layer asking for another is refused, never run at the planned one."""
    from graphcap.opsdb.attention.flashinfer_backend import FlashInferAttention

    q, k, v = qkv(4, 2, 2, 16)
    backend = FlashInferAttention(heads=(2, 2, 16), dtype=torch.float16, scale=0.125)
    planned = SimpleNamespace(planned=(2, 2, 16, torch.float16))
    with pytest.raises(OpInputError, match=r"planned its kernels with softmax scale 0\.125 "
                                           r"and this layer asks for 0\.2"):
        backend.forward(q, k, v, torch.empty_like(q), planned, 0.2)
    default = FlashInferAttention(heads=(2, 2, 16), dtype=torch.float16)
    with pytest.raises(OpInputError, match=r"scale 0\.25 and this layer asks for 0\.125"):
        default.forward(q, k, v, torch.empty_like(q), planned, 0.125)


def test_flashinfer_prefill_refuses_a_layer_of_other_heads_than_it_planned_for():
    """FlashInfer's plan lists its work per query head and tile of the head dim it was
    given: a layer of more heads would leave the others unwritten, never computed."""
    from graphcap.opsdb.attention.flashinfer_backend import FlashInferAttention

    backend = FlashInferAttention(heads=(2, 2, 16), dtype=torch.float16)
    planned = SimpleNamespace(planned=(2, 2, 16, torch.float16))
    for hq, hk, d in ((4, 2, 16), (2, 1, 16), (2, 2, 8)):
        q, k, v = qkv(4, hq, hk, d)
        with pytest.raises(OpInputError, match=rf"planned its kernels for \(query heads, "
                           rf"key/value heads, head dim\) \(2, 2, 16\) and this layer has "
                           rf"\({hq}, {hk}, {d}\)"):
            backend.forward(q, k, v, torch.empty_like(q), planned, d ** -0.5)


@pytest.mark.parametrize("window,seed", [(0, 1), (3, 2), (0, 3)])
def test_sinks_folded_into_an_output_by_its_rows_log_sum_exp_are_the_references(window,
                                                                                seed):
    """What FlashInfer's prefill and decode do for a layer with sinks: the kernel's
    output without them and each row's base-2 log-sum-exp, then add_sinks."""
    from graphcap.opsdb.attention.variant import add_sinks

    n, hq, hk, scale = 9, 4, 2, 0.3
    q, k, v = qkv(n, hq, hk, 16, seed=seed)
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2
    scores = torch.einsum("ihd,jhd->hij", q, k.repeat_interleave(hq // hk, dim=1)) * scale
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    seen = (j <= i) & ((j > i - window) if window else True)
    lse2 = torch.logsumexp(scores.masked_fill(~seen, float("-inf")), dim=-1).T / math.log(2)
    out = ref.attention_varlen(q, k, v, cu_of([n]), scale, True, window, 0.0, None)
    add_sinks(out, lse2, sinks)
    want = ref.attention_varlen(q, k, v, cu_of([n]), scale, True, window, 0.0, sinks)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    empty = torch.randn(1, hq, 16).to(torch.bfloat16)  # a row without keys: zero
    add_sinks(empty, torch.full((1, hq), float("-inf")), sinks)
    assert torch.equal(empty, torch.zeros_like(empty))


@pytest.mark.parametrize("options, needle", [
    ({"dtype": "float32"}, "dtype must be a torch.dtype"),
    ({"kv": 3}, "kv must be a graphcap.kv.CacheBatch"),
    ({"options": "window"}, "options must be a list of the variant options")])
def test_packed_names_an_argument_of_the_wrong_kind(options, needle):
    with pytest.raises(TypeError, match=needle), graphcap.packed([3], "cpu", **options):
        pass


@settings(max_examples=15, deadline=None)
@given(exponent=st.floats(0, 9), n=st.integers(1, 20), seed=st.integers(0, 2**16))
def test_the_triton_kernels_soft_cap_as_the_reference_whatever_the_cap(exponent, n, seed):
    """A cap far above the scores (``softcap * tanh(s / softcap)`` is then ``s``) leaves
    them as they are: tanh computed as ``1 - 2 / (e^2x + 1)`` cancels to 0 there, which made
    every score 0 (uniform attention) from a cap of about 1e8, and wrong from 1e4."""
    from graphcap.opsdb.decode import DECODE_ATTENTION
    from graphcap.opsdb.triton.attention import attention_varlen

    softcap, d = 10.0 ** exponent, 16
    q, k, v = qkv(n, 2, 1, d, seed, DEVICE)
    want = ref.attention_varlen(q, k, v, cu_of([n]).to(DEVICE), 0.3, True, 0, softcap)
    out = torch.empty_like(q)
    attention_varlen(q, k, v, out, cu_of([n]).to(DEVICE), n, 0.3, True, 0, softcap)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)
    step = torch.empty_like(q[-1:])
    DECODE_ATTENTION(q[-1:], k[None], v[None], torch.zeros(1, 1, dtype=torch.int32,
                     device=DEVICE), torch.tensor([n], dtype=torch.int32, device=DEVICE),
                     step, 0.3, 0, softcap, kernel="triton")
    torch.testing.assert_close(step, want[-1:], rtol=2e-5, atol=2e-5)


SIXTEEN_BIT = {torch.float16: 2e-2, torch.bfloat16: 3e-2}
# Gemma 3's head dim (256), Phi's (80: padded in registers), GQA groups of 1, 3 and 8.
wide_heads = st.sampled_from([(8, 1, 256), (6, 2, 80), (4, 4, 256), (8, 1, 80)])


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.sampled_from([0, 1, 16, 17, 33, 40]), min_size=1, max_size=3),
       heads=wide_heads, dtype=st.sampled_from(sorted(SIXTEEN_BIT, key=str)),
       variant=st.tuples(st.sampled_from([1, 2, 16, 17, 33]), st.sampled_from([0.0, 1.0]),
                         st.booleans()),
       seed=st.integers(0, 2**16))
def test_the_triton_prefill_kernel_computes_the_variants_in_16_bit_at_wide_heads(
        lengths, heads, dtype, variant, seed):
    """Windows of one token, at the kernel's block edges and across a packed request's
    start, soft-capped, with sinks, in float16 and bfloat16 at head dims 256 and 80 and
    GQA groups up to 8: within 16-bit rounding of the float32 reference over the same
    16-bit values."""
    from graphcap.opsdb.triton.attention import attention_varlen

    (hq, hk, d), (window, softcap, with_sinks) = heads, variant
    used = sum(lengths)
    q, k, v = (t.to(dtype) for t in qkv(max(used, 1), hq, hk, d, seed, DEVICE))
    sinks = torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(DEVICE) * 2 \
        if with_sinks else None
    cu = cu_of(lengths).to(DEVICE)
    out = torch.full_like(q, float("nan"))
    attention_varlen(q, k, v, out, cu, max(lengths + [1]), d ** -0.5, True, window,
                     softcap, sinks)
    want = ref.attention_varlen(q.float(), k.float(), v.float(), cu, d ** -0.5, True, window,
                                softcap, sinks)
    tol = SIXTEEN_BIT[dtype]
    torch.testing.assert_close(out[:used].float(), want[:used], rtol=tol, atol=tol)


@settings(max_examples=10, deadline=None)
@given(n=st.sampled_from([1, 4, 5, 9, 17, 31, 50]), page=st.sampled_from([1, 4, 8]),
       heads=wide_heads, dtype=st.sampled_from([torch.float32, *sorted(SIXTEEN_BIT, key=str)]),
       variant=st.tuples(st.sampled_from([1, 2, 3, 4, 5, 8, 9, 20, 33]),
                         st.sampled_from([0.0, 1.0]), st.booleans()),
       splits=st.sampled_from([1, 2, 3, 8]), seed=st.integers(0, 2**16))
@example(n=50, page=4, heads=(6, 2, 80), dtype=torch.bfloat16, variant=(33, 1.0, True),
         splits=3, seed=0)  # three splits of 16 tokens over 33, the first page cut
def test_the_triton_decode_kernel_reads_a_window_across_pages_in_any_splits(
        n, page, heads, dtype, variant, splits, seed):
    """A window that starts inside a page, ends on a page's edge or spans one token; the
    splits cover the window only, some of them empty (more splits than its blocks); every
    slot outside the window NaN (one read there would show); at head dims 256 and 80, GQA
    groups up to 8, in float32 and 16 bits."""
    from graphcap.opsdb.triton.decode import decode_attention

    (hq, hk, d), (window, softcap, with_sinks) = heads, variant
    g = torch.Generator().manual_seed(seed)
    width = -(-n // page) + 1  # a page past the row's tokens: the table is wider
    pages = width + 2
    table = (torch.randperm(pages - 1, generator=g)[:width] + 1).to(torch.int32)[None]
    k_cache, v_cache = (torch.full((pages, page, hk, d), float("nan")) for _ in range(2))
    for t in range(max(0, n - window), n):
        k_cache[table[0, t // page], t % page] = torch.randn(hk, d, generator=g)
        v_cache[table[0, t // page], t % page] = torch.randn(hk, d, generator=g)
    q = torch.randn(1, hq, d, generator=g)
    sinks = torch.randn(hq, generator=g) * 2 if with_sinks else None
    q, k_cache, v_cache = (t.to(DEVICE, dtype) for t in (q, k_cache, v_cache))
    table, lens = table.to(DEVICE), torch.tensor([n], dtype=torch.int32, device=DEVICE)
    sinks = None if sinks is None else sinks.to(DEVICE)
    out, want = torch.empty_like(q), torch.empty_like(q)
    decode_attention(q, k_cache, v_cache, table, lens, out, d ** -0.5, window, softcap,
                     sinks, num_splits=splits)
    decode_attention_reference(q, k_cache, v_cache, table, lens, want, d ** -0.5, window,
                               softcap, sinks)
    tol = SIXTEEN_BIT.get(dtype, 2e-5)
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
