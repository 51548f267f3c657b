"""graphcap.testing's replay check: the batches it draws (``prefill_batches``,
``full_batch``, ``bucket_batches``), and ``assert_replay_equivalent`` finding planted bugs
(padding rows leaking, one bucket wrong, integer outputs off, a forward writing its inputs),
reporting them shrunk, and refusing what it cannot check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from graphcap.testing import assert_replay_equivalent, full_batch, prefill_batches


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


@settings(max_examples=10, deadline=None)
@given(batch=prefill_batches(64, 3, 100, max_len=10))
def test_drawn_requests_are_no_longer_than_max_len(batch):
    _, _, lens = batch
    assert max(lens) <= 10 and sum(lens) <= 30


def test_the_full_batch_within_max_len_spreads_its_tokens_evenly():
    _, _, lens = full_batch(64, 4, 100, max_len=20)
    assert lens == [16, 16, 16, 16]
    with pytest.raises(ValueError, match="need requests of more than max_len 10"):
        full_batch(64, 4, 100, max_len=10)


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


def test_the_reported_fallbacks_are_every_runners_the_check_made(caplog):
    # The call sequences' runners get the batches past the buckets and the slots: their
    # fallbacks count too (the batches' runner alone never falls back for those). They
    # are drawn on purpose: reported, not each runner's warning (graphcap check printed
    # one a reason a runner, between the rows of its table).
    from graphcap.models import build_model

    with caplog.at_level("WARNING", logger="graphcap"):
        report = assert_replay_equivalent(build_model("tiny"), ["full"], examples=3,
                                          sequences=6)["full"]
    assert {"too_many_tokens", "too_many_requests"} <= report["fallbacks"].keys()
    told = [r.getMessage() for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert not told, told


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
