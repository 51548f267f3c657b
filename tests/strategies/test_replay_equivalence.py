"""Captured output equals eager, for every strategy and allowed attention backend, over
random batches and over arbitrary sequences of calls (nothing leaks between replays)."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.testing import assert_replay_equivalent
from tests.support.runner_helpers import (
    BUCKETS,
    DEVICE,
    SLOTS,
    batch,
    combos,
    eager,
    model,
    runner,
    tolerance,
)


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_replay_equals_eager_for_random_batches_and_call_sequences(strategy, attention):
    # Batches with 1..4 requests, zero-length ones among them, edge lengths; sequences of
    # calls with fallbacks (past the largest bucket, more requests than slots, padding).
    # A sequence captures a fresh runner; each of tc_piecewise's compiles the model: fewer.
    sequences = 4 if strategy == "tc_piecewise" else 8
    assert_replay_equivalent(model(), [strategy], buckets=BUCKETS, max_requests=SLOTS,
                             attention=attention, examples=15, sequences=sequences)


@pytest.mark.parametrize(("strategy", "attention"), [
    c for c in combos() if c.values[0] == "tc_piecewise"
    and (DEVICE == "cuda" or c.values[1] == "torch_masked")])
def test_inductor_pieces_replay_equal_eager_for_random_batches_and_call_sequences(strategy,
                                                                                  attention):
    assert_replay_equivalent(model(), [strategy], buckets=BUCKETS, max_requests=SLOTS,
                             attention=attention, examples=10, sequences=3,
                             compiler="inductor")


def assert_matches(strategy, attention, lens, seed):
    ids, pos = batch(lens, seed)
    got = runner(strategy, attention)(ids, pos, seq_lens=lens)
    atol, rtol = tolerance()
    torch.testing.assert_close(got, eager(attention, ids, pos, lens), atol=atol, rtol=rtol,
                               msg=lambda m: f"{strategy}/{attention} {lens}: {m}")


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_largest_first_then_alternating_small_and_large_buckets_stay_correct(strategy,
                                                                             attention):
    # The weak-reference hazard: later, smaller captures reuse freed pool blocks; a break
    # input held weakly then reads another bucket's data. Strong references prevent it.
    for step, lens in enumerate([[3], [60], [2, 1], [33, 30], [4], [64], [1, 1, 1, 1]] * 2):
        assert_matches(strategy, attention, lens, seed=step)


@pytest.mark.parametrize(("strategy", "attention"), combos())
def test_nan_in_padded_rows_never_reaches_real_rows(strategy, attention):

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



def test_the_default_backend_computes_the_options_the_models_layers_use(monkeypatch):
    """A model with sinks is checked on a backend computing sinks, where the best backend
    for no options computes none (flash_attn where only FlashAttention 2/3 is installed)."""
    import dataclasses

    from graphcap.models import PRESETS, Decoder
    from graphcap.opsdb.attention import BACKENDS, TorchMasked

    class PlainOnly(TorchMasked):
        name = "plain_only"
        options = frozenset()

    monkeypatch.setattr("graphcap.opsdb.attention.BACKENDS",
                        {"plain_only": PlainOnly, **BACKENDS})
    torch.manual_seed(0)
    m = Decoder(dataclasses.replace(PRESETS["tiny"], sinks=True)).to(DEVICE).eval()
    report = assert_replay_equivalent(m, "full", buckets=[8], max_requests=2, examples=2,
                                      sequences=1)["full"]
    assert report["attention"] != "plain_only"
