"""graphcap.testing: the public helpers our own suites are built on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from graphcap.testing import (
    assert_replay_equivalent,
    check_op,
    full_batch,
    op_inputs,
    prefill_batches,
)


@settings(max_examples=10, deadline=None)
@given(batch=prefill_batches(32, 3, 100))
def test_prefill_batches_are_valid_packed_requests(batch):
    ids, pos, lens = batch
    assert 1 <= len(lens) <= 3 and sum(lens) == ids.shape[0] <= 32 and sum(lens) >= 1
    assert all(n >= 0 for n in lens) and int(ids.min()) >= 1 and int(ids.max()) < 100
    start = 0
    for n in lens:
        assert pos[start:start + n].tolist() == list(range(n))
        start += n


@settings(max_examples=10, deadline=None)
@given(batch=prefill_batches(2, 4, 10, min_len=1))
def test_requests_of_min_len_tokens_each_are_only_as_many_as_fit(batch):
    # 4 request slots, 2 tokens, a token each at least: at most 2 requests (the draw
    # had halved lengths forever).
    _, _, lens = batch
    assert 1 <= len(lens) <= 2 and min(lens) >= 1 and sum(lens) <= 2


@pytest.mark.parametrize("max_tokens,max_requests,min_len,want", [
    (64, 4, 0, 4), (64, 4, 1, 4), (3, 4, 1, 3), (3, 4, 0, 3), (10, 4, 3, 3), (1, 4, 0, 1)])
def test_the_full_batch_packs_as_many_unequal_requests_as_fit(max_tokens, max_requests,
                                                             min_len, want):
    ids, pos, lens = full_batch(max_tokens, max_requests, 100, min_len=min_len)
    assert len(lens) == want and sum(lens) == max_tokens == ids.shape[0]
    assert min(lens) >= max(min_len, 1) and int(ids.min()) >= 1 and int(ids.max()) < 100
    assert pos.tolist() == [p for n in lens for p in range(n)]
    if max_tokens >= 2 * want * max(min_len, 1):  # room to spare: no two alike
        assert len(set(lens)) == want


def test_a_full_batch_that_cannot_hold_one_request_is_refused():
    with pytest.raises(ValueError, match="max_tokens 4 holds no request of min_len 5"):
        full_batch(4, 2, 10, min_len=5)


def test_a_check_of_one_drawn_example_still_runs_the_fullest_batch():
    """Hypothesis draws its simplest batch (one short request) first: a check of few
    examples would never pack requests. The fullest batch comes after the drawn ones, so
    that a failure they find is shrunk."""
    from graphcap.models import build_model

    seen = []
    model = build_model("tiny")
    model.register_forward_pre_hook(lambda _, args: seen.append(args[1].clone()))
    assert_replay_equivalent(model, ("full",), buckets=[8, 16], max_requests=3,
                             attention="torch_masked", examples=1, sequences=1)
    assert any(p.shape[0] == 16 and int((p == 0).sum()) == 3 for p in seen)


def test_a_failure_on_every_batch_is_reported_shrunk_not_as_the_fullest_batch():
    from tests.support.check_models import counting

    with pytest.raises(AssertionError, match=r"full/torch_masked \[\d+\], [^:]*: captured"):
        assert_replay_equivalent(counting(), ("full",), buckets=[8, 16], max_requests=3,
                                 attention="torch_masked", examples=5, sequences=1)


def test_requests_longer_than_every_batch_are_refused():
    with pytest.raises(ValueError, match="min_len 5 exceeds max_tokens 4"):
        prefill_batches(4, 2, 10, min_len=5)


@settings(max_examples=10, deadline=None)
@given(args=op_inputs("rms_norm", dtype=torch.float16, max_tokens=5))
def test_op_inputs_follow_the_constraints(args):
    x, w, eps = args
    assert x.dtype == torch.float16 and x.shape[0] <= 5 and w.shape == x.shape[1:]


def test_an_op_without_an_input_strategy_says_how_to_add_one():
    import graphcap.opsdb as opsdb

    if "graphcap_test::no_inputs" not in opsdb.REGISTRY:
        opsdb.register_op("graphcap_test::no_inputs", "(Tensor x) -> Tensor",
                          reference=lambda x: x + 1)
    with pytest.raises(ValueError, match="inputs="):
        op_inputs("graphcap_test::no_inputs")


def test_the_plugin_gives_the_device_to_test_on(graphcap_device):
    assert graphcap_device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def _buggy_double(x):
    out = x * 2
    if x.shape[0] % 16:  # the planted bug: wrong whenever T is not a multiple of 16
        out[-1] += 1
    return out


def test_check_op_finds_and_shrinks_a_kernel_wrong_off_multiples_of_16():
    import graphcap.opsdb as opsdb
    from graphcap.opsdb import Kernel

    def inputs(device, dtype, max_tokens=64):
        from hypothesis import strategies as st

        return st.integers(0, max_tokens).map(
            lambda t: (torch.ones(t, 8, device=device, dtype=dtype),))

    name = "graphcap_test::buggy_double"
    if name not in opsdb.REGISTRY:
        opsdb.register_op(name, "(Tensor x) -> Tensor", reference=lambda x: x * 2,
                          kernels={"buggy": Kernel(_buggy_double, devices=("cpu", "cuda"))},
                          inputs=inputs)
    with pytest.raises(AssertionError) as info:
        check_op(name, kernel="buggy", dtypes=(torch.float32,), examples=50,
                 opcheck=False)
    text = str(info.value)
    assert "graphcap_test::buggy_double[buggy]" in text
    # hypothesis shrinks to the smallest failing token count: one row
    assert "inputs (Tensor(float32, (1, 8)))" in text and "max error 1" in text, text


class LeakyDecoder(torch.nn.Module):
    """A planted bug: every row gets the mean over all rows, padding rows included."""

    def __init__(self):
        super().__init__()
        from graphcap.models import build_model

        self.inner = build_model("tiny")
        self.args = self.inner.args

    def forward(self, input_ids, positions):
        logits = self.inner(input_ids, positions)
        return logits + logits.mean(dim=0, keepdim=True)


def test_assert_replay_equivalent_finds_padding_rows_leaking_into_real_rows():
    with pytest.raises(AssertionError) as info:
        assert_replay_equivalent(LeakyDecoder(), ("full",), buckets=[4, 8, 16],
                                 max_requests=2, attention="torch_masked", examples=30,
                                 sequences=1)
    # The message names the strategy and the shrunk batch (its request lengths).
    text = str(info.value)
    assert "full/torch_masked [" in text and "captured output differs" in text, text


def _register_once(name, schema, **kw):
    import graphcap.opsdb as opsdb

    if name not in opsdb.REGISTRY:
        opsdb.register_op(name, schema, **kw)
    return name


def _rows(device, dtype, max_tokens=16):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t, h = d(st.integers(0, max_tokens)), d(st.sampled_from([1, 3, 8]))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        return (torch.randn(t, h, generator=gen).to(device, dtype),)

    return draw()


def _zeros(device, dtype):
    from hypothesis import strategies as st

    return st.integers(1, 8).map(lambda n: (torch.zeros(n, 4, device=device, dtype=dtype),))


def _negates_in_place(x):
    x.neg_()  # 0.0 becomes -0.0: equal in value, another bit pattern in memory
    return x * 2


def test_check_op_compares_an_undeclared_argument_bit_for_bit():
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::signs", "(Tensor x) -> Tensor", reference=lambda x: x * 6,
        kernels={"signs": Kernel(_negates_in_place, devices=("cpu", "cuda"))},
        inputs=_zeros)
    with pytest.raises(AssertionError, match="does not declare written"):
        check_op(name, dtypes=(torch.float32,), examples=3, opcheck=False)


def test_check_op_fails_on_a_fake_that_returns_the_wrong_shape():
    # Right on the minimal example (a 1 x 1 or empty input), wrong on any other.
    name = _register_once("graphcap_test::bad_fake", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, fake=lambda x: x.new_empty(x.shape[::-1]),
                          inputs=_rows)
    with pytest.raises(AssertionError, match="its fake returns"):
        check_op(name, dtypes=(torch.float32,), examples=10, opcheck=False)


def _scales_in_place(x):
    x.mul_(3)  # writes its input, which the schema below does not declare
    return x * 2


def test_check_op_fails_on_a_kernel_that_writes_an_undeclared_argument():
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::sneaky", "(Tensor x) -> Tensor", reference=lambda x: x * 6,
        kernels={"sneaky": Kernel(_scales_in_place, devices=("cpu", "cuda"))}, inputs=_rows)
    with pytest.raises(AssertionError, match="does not declare written"):
        check_op(name, kernel="sneaky", dtypes=(torch.float32,), examples=10, opcheck=False)


def _column_major_double(x):
    return (x * 2).t().contiguous().t()  # the right values, column-major


def test_check_op_fails_on_a_kernel_or_fake_whose_strides_are_not_the_references():
    # Inductor asserts the strides the fake gave (assert_size_stride), so a kernel that
    # returns the right values column-major fails a compiled model: check_op says so.
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::column_major", "(Tensor x) -> Tensor", reference=lambda x: x * 2,
        kernels={"colmajor": Kernel(_column_major_double, devices=("cpu", "cuda"))},
        inputs=_rows)
    with pytest.raises(AssertionError, match=r"strides \(1, "):
        check_op(name, kernel="colmajor", dtypes=(torch.float32,), examples=10,
                 opcheck=False)
    name = _register_once(
        "graphcap_test::column_major_fake", "(Tensor x) -> Tensor",
        reference=lambda x: x * 2, fake=lambda x: x.new_empty(x.shape[::-1]).t(),
        inputs=_rows)
    with pytest.raises(AssertionError, match="its fake returns"):
        check_op(name, dtypes=(torch.float32,), examples=10, opcheck=False)


def _rows_nan_when_long(device, dtype):
    """Rows of 2 to 8 tokens; from 6 tokens on (the largest examples) one value NaN."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t = d(st.integers(2, 8))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        x = torch.randn(t, 4, generator=gen)
        if t >= 6:
            x[-1, -1] = float("nan")
        return (x.to(device, dtype),)

    return draw()


def test_opcheck_prefers_examples_whose_outputs_hold_no_nan():
    # opcheck compares the traced op's outputs with eager's by assert_close, NaN unequal
    # to NaN: an op that passes NaN on (moe_topk_softmax on a NaN logit) must not fail
    # check_op for it when finite examples were drawn too.
    name = _register_once("graphcap_test::nan_through", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, inputs=_rows_nan_when_long)
    report = check_op(name, kernel="torch", dtypes=(torch.float32,), examples=20)
    assert report.opchecked == 3


def test_opcheck_runs_on_several_non_degenerate_examples():
    calls = []
    import graphcap.testing.ops as ops

    real = torch.library.opcheck
    try:
        torch.library.opcheck = lambda op, args, **kw: calls.append(args) or real(op, args, **kw)
        report = ops.check_op("rms_norm", kernel="torch", dtypes=(torch.float32,),
                              examples=12)
    finally:
        torch.library.opcheck = real
    assert report.opchecked == 3 == len(calls)
    assert all(min(args[0].shape) >= 2 for args in calls)


def test_check_op_says_which_kernels_it_compared_and_which_it_skipped_and_why():
    report = check_op("rms_norm", device="cpu", dtypes=(torch.float16,), examples=3,
                      opcheck=False)
    assert "flashinfer" in report.skipped and "cuda" in report.skipped["flashinfer"]
    text = str(report)
    assert "skipped flashinfer" in text and "3 examples" in text
    if report.get("triton") is not None:  # the interpreter (TRITON_INTERPRET=1)
        assert "compared triton" in text


@torch.library.custom_op("graphcap_test::shifted_square", mutates_args=())
def shifted_square(x: torch.Tensor, shift: float) -> torch.Tensor:
    return (x + shift) ** 2


@shifted_square.register_fake
def _(x, shift):
    return torch.empty_like(x)


@torch.library.custom_op("graphcap_test::wrong_square", mutates_args=())
def wrong_square(x: torch.Tensor, shift: float) -> torch.Tensor:
    return (x + shift) ** 2 + (x.shape[0] > 2)  # the planted bug: off by one past 2 rows


@wrong_square.register_fake
def _(x, shift):
    return torch.empty_like(x)


def _square_reference(x, shift):
    return (x + shift) ** 2


def _rows_and_shift(device, dtype):
    from hypothesis import strategies as st

    return st.tuples(_rows(device, dtype), st.sampled_from([0.0, 0.5, -2.0])).map(
        lambda both: (*both[0], both[1]))


@pytest.mark.parametrize("form", ["CustomOpDef", "OpOverloadPacket", "OpOverload", "name"])
def test_check_op_checks_an_op_defined_with_torch_library_custom_op(form):
    op = {"CustomOpDef": shifted_square, "OpOverloadPacket": torch.ops.graphcap_test.shifted_square,
          "OpOverload": torch.ops.graphcap_test.shifted_square.default,
          "name": "graphcap_test::shifted_square"}[form]
    report = check_op(op, reference=_square_reference, inputs=_rows_and_shift,
                      dtypes=(torch.float32,), examples=8, opchecks=1)
    assert report.qualname == "graphcap_test::shifted_square"
    assert report == {"op": 0.0} and report.examples == 8 and report.opchecked == 1


def test_check_op_finds_a_custom_op_that_differs_from_the_reference_given():
    with pytest.raises(AssertionError) as info:
        check_op(wrong_square, reference=_square_reference, inputs=_rows_and_shift,
                 dtypes=(torch.float32,), examples=30, opcheck=False)
    text = str(info.value)
    assert "graphcap_test::wrong_square[op]" in text and "(3, " in text, text  # shrunk: 3 rows


def test_check_op_on_an_op_outside_opsdb_says_it_needs_a_reference_and_inputs():
    with pytest.raises(ValueError, match=r"not registered in opsdb.*reference=.*inputs="):
        check_op(shifted_square, inputs=_rows_and_shift)
    with pytest.raises(ValueError, match="inputs="):
        check_op(shifted_square, reference=_square_reference)


def test_check_op_on_a_name_no_library_defines_says_so():
    with pytest.raises(ValueError, match="'graphcap_test::nowhere' is not in opsdb; no op "
                                         "'graphcap_test::nowhere' in torch.ops"):
        check_op("graphcap_test::nowhere", reference=_square_reference)


def test_check_op_takes_an_opsdb_op_by_its_overload_with_its_registered_reference():
    report = check_op(torch.ops.graphcap.rms_norm.default, kernel="torch",
                      dtypes=(torch.float32,), examples=2, opcheck=False)
    assert report.qualname == "graphcap::rms_norm" and report == {"torch": 0.0}
    with pytest.raises(ValueError, match="registered with; reference= is for ops"):
        check_op(torch.ops.graphcap.rms_norm, reference=lambda x, w, eps: x)


def test_check_op_takes_inputs_for_an_opsdb_op_registered_without_them():
    import graphcap.opsdb as opsdb

    if "graphcap_test::no_inputs" not in opsdb.REGISTRY:
        opsdb.register_op("graphcap_test::no_inputs", "(Tensor x) -> Tensor",
                          reference=lambda x: x + 1)
    report = check_op("graphcap_test::no_inputs", kernel="torch", inputs=_rows,
                      dtypes=(torch.float32,), examples=3, opchecks=1)
    assert report == {"torch": 0.0} and report.opchecked == 1


def test_check_op_refuses_to_check_nothing_or_on_a_gpu_it_does_not_have():
    with pytest.raises(ValueError, match="dtypes is empty"):
        check_op("rms_norm", dtypes=())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
            check_op("rms_norm", device="cuda")


def test_check_op_refuses_to_pass_a_kernel_it_was_asked_for_and_never_ran():
    from graphcap.opsdb import Kernel

    name = _register_once("graphcap_test::cuda_only_double", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, inputs=_rows,
                          kernels={"mine": Kernel(lambda x: x * 3, devices=("cuda",))})
    with pytest.raises(ValueError, match="kernel 'mine' of .* was not checked: it runs on"):
        check_op(name, kernel="mine", device="cpu", dtypes=(torch.float32,), examples=3,
                 opcheck=False)


def test_check_op_takes_a_fake_right_where_an_optional_written_argument_is_none():
    from hypothesis import strategies as st

    def twice(x, out=None):
        if out is not None:
            out.copy_(x * 2)
        return x * 2

    name = _register_once(
        "graphcap_test::twice_maybe_out", "(Tensor x, Tensor(a!)? out) -> Tensor",
        reference=twice,
        inputs=lambda device, dtype: st.tuples(_rows(device, dtype), st.just(None)).map(
            lambda both: (*both[0], both[1])))
    report = check_op(name, dtypes=(torch.float32,), examples=3, opcheck=False)
    assert report.examples == 3


class TwoOutputs(LeakyDecoder):
    """The tiny decoder returning (logits, hidden): an output of several tensors."""

    def forward(self, input_ids, positions):
        return self.inner(input_ids, positions, hidden=True)


def test_assert_replay_equivalent_compares_each_tensor_of_a_nested_output():
    got = assert_replay_equivalent(TwoOutputs(), "full", buckets=[8, 16], max_requests=2,
                                   attention="torch_masked", examples=3, sequences=1)
    assert set(got) == {"full"}  # one strategy named as a string


def test_assert_replay_equivalent_draws_up_to_the_largest_bucket_given_in_any_order():
    from graphcap.models import build_model

    got = assert_replay_equivalent(build_model("tiny"), ("full",), buckets=[32, 8, 16],
                                   max_requests=2, attention="torch_masked", examples=30,
                                   sequences=1)["full"]
    assert got["replays"].get(32), got["replays"]


def test_assert_replay_equivalent_takes_a_model_without_parameters():
    class Buffers(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("table", torch.randn(50, 8))

        def forward(self, input_ids, positions):
            return self.table[input_ids] * (positions[:, None] + 1)

    assert assert_replay_equivalent(Buffers(), ("full",), buckets=[8], max_requests=1,
                                    vocab=50, examples=3, sequences=1)["full"]["replays"]


def test_the_plugin_skips_by_the_gpu_marker_not_by_a_directory_named_gpu(pytester):
    pytester.makepyfile(**{"gpu/test_plain": "def test_math():\n    assert 1 + 1 == 2\n"})
    result = pytester.runpytest()  # the plugin, loaded by its entry point
    result.assert_outcomes(passed=1)


def test_assert_replay_equivalent_draws_token_ids_over_the_embedding_without_a_vocab_size(
        monkeypatch):
    import graphcap.testing.replay as replay

    vocabs = []

    def spy(max_tokens, max_requests, vocab, **kw):
        vocabs.append(vocab)
        return prefill_batches(max_tokens, max_requests, vocab, **kw)

    monkeypatch.setattr(replay, "prefill_batches", spy)
    embeds = torch.nn.Embedding(40, 8)  # a model of token ids with no vocab_size
    assert_replay_equivalent(lambda: _Embeds(embeds), ("full",), buckets=[8],
                             max_requests=1, examples=3, sequences=1)
    assert vocabs and set(vocabs) == {40}  # not ids of 1 alone


class _Embeds(torch.nn.Module):
    def __init__(self, embed):
        super().__init__()
        self.embed = embed

    def forward(self, input_ids, positions):
        return self.embed(input_ids)


def test_the_reported_fallbacks_are_every_runners_the_check_made():
    # The call sequences' runners get the batches past the buckets and the slots: their
    # fallbacks count too (the batches' runner alone never falls back for those).
    from graphcap.models import build_model

    report = assert_replay_equivalent(build_model("tiny"), ["full"], examples=3,
                                      sequences=6)["full"]
    assert {"too_many_tokens", "too_many_requests"} <= report["fallbacks"].keys()


class _Bucket28(LeakyDecoder):
    """Wrong only where 25 to 27 tokens replay the 28-token graph: a path picked for
    M == 28 that reads across rows (padding rows included)."""

    def forward(self, input_ids, positions):
        logits = self.inner(input_ids, positions)
        if input_ids.shape[0] == 28:
            logits = logits + logits.mean(0, keepdim=True)
        return logits


def test_a_bug_of_one_bucket_fails_every_run_not_only_when_hypothesis_draws_it():
    # Drawn batches replay the 28 bucket in about a fifth of runs of 10 examples.
    for _ in range(3):
        with pytest.raises(AssertionError, match=r"replayed the 28-token graph: captured"):
            assert_replay_equivalent(_Bucket28(), ("full",), max_tokens=64,
                                     attention="torch_masked", examples=2, sequences=1)


def test_every_bucket_replays_padded_and_full():
    from graphcap.core.buckets import pick_bucket, prefill_ladder
    from graphcap.testing import bucket_batches

    ladder = prefill_ladder(64)
    got = [sum(lens) for _, _, lens in bucket_batches(ladder, 4, 50)]
    assert {pick_bucket(t, ladder)[0] for t in got} == set(ladder)
    assert got[:6] == [2, 4, 5, 8, 9, 12] and got[-4:] == [33, 48, 49, 64]


def test_a_check_in_which_nothing_replays_fails_instead_of_passing():
    # Every batch given is padded more than twice over: all run eagerly, and a model
    # whose padding rows leak into real ones would pass unseen.
    with pytest.raises(AssertionError, match="no call replayed a graph"):
        assert_replay_equivalent(LeakyDecoder(), ("full",), buckets=[64, 128],
                                 max_requests=2, attention="torch_masked",
                                 batches=prefill_batches(24, 2, 100), examples=5,
                                 sequences=1)


class _NextToken(torch.nn.Module):
    """A next-token id of a 150k vocabulary, off by one on every padded replay."""

    graphcap_inputs = "prefill"
    vocab_size = 151_936

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Embedding(64, 8)

    def forward(self, input_ids, positions):
        ids = torch.full_like(input_ids, 150_000) + (input_ids.shape[0] % 4 != 0)
        return self.head(positions % 64), ids


def test_integer_outputs_are_compared_exactly_not_within_a_float_tolerance():
    with pytest.raises(AssertionError, match="captured output differs"):
        assert_replay_equivalent(_NextToken(), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=5, sequences=1)


def test_each_float_output_is_compared_within_its_own_dtype_s_tolerance():
    from graphcap.testing.replay import _close

    want = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    got = torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)  # an ulp of bfloat16 at 2
    worst = [0.0]
    # A float32 model's bfloat16 output: bfloat16's tolerance, not float32's 1e-5.
    _close((got,), (want,), "bf16 out", None, worst, base=1e-5)
    with pytest.raises(AssertionError, match="captured output differs"):
        _close((got,), (want,), "atol given", 1e-5, worst, base=1e-5)
    with pytest.raises(AssertionError, match="captured output differs"):  # float32 out
        _close((got.float() + 1e-3,), (want.float(),), "f32 out", None, worst, base=1e-5)


class _NaNRows(torch.nn.Module):
    graphcap_inputs = "prefill"
    vocab_size = 50

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)

    def forward(self, input_ids, positions):
        return torch.where((input_ids % 2 == 0)[:, None], float("nan"), self.emb(input_ids))


def test_nan_where_eager_has_nan_is_equal():
    report = assert_replay_equivalent(_NaNRows(), ("full", "breakable"), buckets=[4, 8, 16],
                                      max_requests=1, examples=5, sequences=2)
    assert all(r["max_error"] == 0.0 for r in report.values())


def test_eager_is_a_copy_of_the_model_from_before_capture_not_the_captured_one():
    from tests.support.check_models import calibrated

    with pytest.raises(AssertionError, match="captured output differs"):
        assert_replay_equivalent(calibrated(), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=3, sequences=1)


class _WritesIds(_NaNRows):
    def forward(self, input_ids, positions):
        input_ids.clamp_(max=10)  # eager writes the caller's ids; a replay does not
        return self.emb(input_ids)


def test_a_forward_that_writes_its_inputs_fails():
    with pytest.raises(AssertionError, match="writes its input_ids in place"):
        assert_replay_equivalent(_WritesIds(), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=5, sequences=1)


def test_a_model_without_graphcap_attention_passes_with_one_request_a_call():
    # The call sequences drew more requests than slots, which such a model refuses: it
    # failed whatever max_requests, and graphcap check told it to use --max-requests 1.
    from tests.support.check_models import sdpa

    assert assert_replay_equivalent(sdpa(), ("full",), buckets=[4, 8, 16], max_requests=1,
                                    examples=3, sequences=6)["full"]["replays"]


class _EverySeventh(_NaNRows):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, positions):
        self.calls += 1
        return self.emb(input_ids) * (2 if self.calls % 7 == 0 else 1)


def test_a_mismatch_that_does_not_recur_is_an_assertion_that_says_so():
    with pytest.raises(AssertionError, match="on some calls only"):
        assert_replay_equivalent(_EverySeventh(), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=10, sequences=2)


@pytest.mark.parametrize("strategies", [(), ("eager",)])
def test_checking_no_graphed_strategy_is_refused(strategies):
    from graphcap.models import build_model

    with pytest.raises(ValueError, match="name one or more of"):
        assert_replay_equivalent(build_model("tiny"), strategies)


class _Lazy(_NaNRows):
    """Weights drawn on the first forward (a runner's: its warm-up's)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.LazyLinear(8)

    def forward(self, input_ids, positions):
        return self.proj(self.emb(input_ids))


def test_a_lazy_module_is_checked_on_its_own_weights_not_a_copy_s_other_ones():
    # A copy of a lazy module draws other weights on its first call: every batch differed.
    with pytest.warns(UserWarning, match="lazy module proj has no weights yet"):
        report = assert_replay_equivalent(_Lazy(), ("full",), buckets=[4, 8, 16],
                                          max_requests=1, examples=3, sequences=1)
    assert report["full"]["max_error"] < 1e-5


class _RaisesOnce(_NaNRows):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, input_ids, positions):
        self.calls += 1
        if self.calls == 7:
            raise RuntimeError("a transient kernel failure")
        return self.emb(input_ids)


def test_a_forward_that_raises_on_some_calls_only_is_not_called_a_mismatch():
    from hypothesis.errors import Flaky

    with pytest.raises(Flaky) as info:
        assert_replay_equivalent(_RaisesOnce(), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=10, sequences=1)
    assert any("transient kernel failure" in str(e) for e in info.value.exceptions)


def test_a_factory_that_returns_no_module_is_named_not_an_attribute_error():
    with pytest.raises(TypeError, match=r"model_or_factory returned a tuple, not a "
                                        r"torch.nn.Module"):
        assert_replay_equivalent(lambda: (torch.nn.Linear(2, 2), "tokenizer"), ("full",))


def test_the_plugin_reads_the_variables_a_conftest_sets_after_graphcap_was_imported(
        pytester, environ):
    environ.set("GRAPHCAP_PDL", "1")  # the plugin imported graphcap, which read this
    pytester.makeconftest("import os\nos.environ['GRAPHCAP_PDL'] = '0'\n")
    pytester.makepyfile(test_pdl="import graphcap.env\n\ndef test_pdl_is_off():\n"
                                 "    assert graphcap.env.settings().pdl is False\n")
    pytester.runpytest().assert_outcomes(passed=1)  # a conftest setting TRITON_INTERPRET too
