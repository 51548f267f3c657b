"""Captured output equals eager, for every strategy and allowed attention backend, over
random batches and over arbitrary sequences of calls (nothing leaks between replays)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

import graphcap
from tests.runner_helpers import BUCKETS, SLOTS, batch, combos, eager, model, runner, tolerance

MAX = BUCKETS[-1]


@st.composite
def prefill_lens(draw, max_tokens=MAX, max_requests=SLOTS):
    n = draw(st.integers(1, max_requests))
    edge = st.sampled_from([0, 1, 2, 4, 7, 8, 15, 16, 31, 32, max_tokens])
    lens = [draw(st.one_of(edge, st.integers(0, max_tokens))) for _ in range(n)]
    while sum(lens) > max_tokens:
        lens[lens.index(max(lens))] //= 2
    if sum(lens) == 0:
        lens[0] = 1
    return lens  # zero-length requests among live ones included


def assert_matches(strategy, attention, lens, seed):
    ids, pos = batch(lens, seed)
    got = runner(strategy, attention)(ids, pos, seq_lens=lens)
    want = eager(attention, ids, pos, lens)
    atol, rtol = tolerance()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol,
                               msg=lambda m: f"{strategy}/{attention} {lens}: {m}")


@pytest.mark.parametrize(("strategy", "attention"), combos())
@settings(max_examples=15, deadline=None)
@given(lens=prefill_lens(), seed=st.integers(0, 2**16))
def test_replay_equals_eager_for_random_batches(strategy, attention, lens, seed):
    assert_matches(strategy, attention, lens, seed)


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_largest_first_then_alternating_small_and_large_buckets_stay_correct(strategy,
                                                                             attention):
    # The weak-reference hazard: later, smaller captures reuse freed pool blocks; a break
    # input held weakly then reads another bucket's data. Strong references prevent it.
    for step, lens in enumerate([[3], [60], [2, 1], [33, 30], [4], [64], [1, 1, 1, 1]] * 2):
        assert_matches(strategy, attention, lens, seed=step)


class CallSequence(RuleBasedStateMachine):
    """Arbitrary calls with varying batches, fallbacks included (past the largest bucket,
    more requests than slots, padding over twice the tokens), each checked against eager:
    stale padding, sentinel rows or metadata would show up as a mismatch."""

    strategy = attention = None

    def __init__(self):
        super().__init__()
        # A fresh runner per sequence, so a failure depends on this sequence alone.
        self.r = graphcap.capture(model(), self.strategy, buckets=[8, 16, MAX],
                                  max_requests=SLOTS, attention=self.attention)
        self.calls = self.replays = self.fallbacks = 0

    def check(self, lens, seed):
        ids, pos = batch(lens, seed)
        got = self.r(ids, pos, seq_lens=lens)
        atol, rtol = tolerance()
        torch.testing.assert_close(got, eager(self.attention, ids, pos, lens), atol=atol,
                                   rtol=rtol)

    @rule(lens=prefill_lens(), seed=st.integers(0, 2**16))
    def any_batch(self, lens, seed):
        self.check(lens, seed)

    @rule(lens=st.lists(st.integers(1, MAX // (SLOTS + 2)), min_size=SLOTS + 1,
                        max_size=SLOTS + 2),
          seed=st.integers(0, 2**16))
    def more_requests_than_slots(self, lens, seed):
        before = self.r.stats.fallbacks["too_many_requests"]
        self.check(lens, seed)
        assert self.r.stats.fallbacks["too_many_requests"] == before + 1

    @rule(extra=st.integers(1, 20), seed=st.integers(0, 2**16))
    def more_tokens_than_the_largest_bucket(self, extra, seed):
        before = self.r.stats.fallbacks["too_many_tokens"]
        self.check([MAX, extra], seed)
        assert self.r.stats.fallbacks["too_many_tokens"] == before + 1

    @invariant()
    def every_call_is_a_replay_or_a_counted_fallback(self):
        stats = self.r.stats
        assert (stats.calls - self.calls) == (
            sum(stats.replays.values()) - self.replays
            + sum(stats.fallbacks.values()) - self.fallbacks)


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_any_sequence_of_calls_matches_eager(strategy, attention):
    machine = type(f"Calls_{strategy}_{attention}", (CallSequence,),
                   {"strategy": strategy, "attention": attention})
    settings(max_examples=8, stateful_step_count=8, deadline=None)(machine)
    machine.TestCase().runTest()


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_nan_in_padded_rows_never_reaches_real_rows(strategy, attention):
    import graphcap

    m = model()
    with torch.no_grad():
        saved = m.embed.weight[0].clone()
        m.embed.weight[0] = float("nan")  # padding rows use token id 0: all NaN
    try:
        r = graphcap.capture(m, strategy, buckets=[16, 32], max_requests=SLOTS,
                             attention=attention)
        for seed, lens in enumerate([[5], [9, 0, 3], [17], [1, 1, 1]]):
            lens = [n for n in lens if n] or [1]
            ids, pos = batch(lens, seed, low=1)
            got = r(ids, pos, seq_lens=lens)
            assert torch.isfinite(got).all(), f"{lens}: NaN reached real rows"
            want = eager(attention, ids, pos, lens)
            atol, rtol = tolerance()
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    finally:
        with torch.no_grad():
            m.embed.weight[0] = saved
