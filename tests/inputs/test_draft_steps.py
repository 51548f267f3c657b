"""k greedy decode steps in one replay (:class:`graphcap.inputs.draft_steps.DraftStepsInputs`):
the tokens and the cache of k decode steps one at a time, under full and eagerly; refused
where eager segments would read an unswitched cache view; a call that would pass what a
slot was admitted for is refused before anything runs."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.engine.eager import decode_step
from graphcap.errors import BadBatch, UnsupportedStrategy
from graphcap.inputs.draft_steps import DraftStepsInputs
from tests.support.runner_helpers import DEVICE, prefilled_tiny

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = {0: [5, 9, 2, 7, 1], 2: [3], 3: [8, 8, 4, 11, 6, 2, 9]}
K = 4


def one_at_a_time(m, cache, tokens, slots):
    """K eager decode steps, each fed the argmax of the one before."""
    out = []
    for _ in range(K):
        positions = torch.tensor([cache.written(s) for s in slots])
        tokens = decode_step(m, cache, tokens, positions, slots).argmax(-1)
        out.append(tokens)
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("strategy", ["eager", "full"])
def test_k_steps_in_one_call_are_k_decode_steps(strategy):
    m, cache, logits = prefilled_tiny(PROMPTS, 2 * K, max_len=24)
    slots = sorted(PROMPTS)
    first = logits.argmax(-1)
    want = one_at_a_time(m, cache, first, slots)
    written = {s: cache.written(s) for s in slots}
    _, cache2, _ = prefilled_tiny(PROMPTS, 2 * K, max_len=24)
    runner = graphcap.capture(m, strategy, buckets=[1, 2, 4],
                              inputs=DraftStepsInputs(cache2, K))
    got = runner(first, positions=[cache2.written(s) for s in slots], slots=slots)
    assert torch.equal(got, want)
    assert {s: cache2.written(s) for s in slots} == written
    # a second call from where the first left off, on two of the requests (a padded bucket)
    again = one_at_a_time(m, cache, want[:2, -1], slots[:2])
    got = runner(got[:2, -1], positions=[cache2.written(s) for s in slots[:2]],
                 slots=slots[:2])
    assert torch.equal(got, again)
    if strategy == "full":
        assert not runner.report()["fallbacks"] and sum(runner.report()["replays"].values()) == 2


def test_a_graph_with_eager_segments_is_refused_naming_why():
    m, cache, _ = prefilled_tiny(PROMPTS, 2 * K, max_len=24)
    for strategy in ("breakable", "tc_piecewise"):
        with pytest.raises(UnsupportedStrategy, match="once per step there"):
            graphcap.capture(m, strategy, buckets=[4], inputs=DraftStepsInputs(cache, K))


def test_steps_past_what_a_slot_was_admitted_for_are_refused_before_anything_runs():
    m, cache, logits = prefilled_tiny(PROMPTS, 2, max_len=24)  # room for 2 more tokens
    runner = graphcap.capture(m, "full", buckets=[4], inputs=DraftStepsInputs(cache, K))
    slots = sorted(PROMPTS)
    before = [cache.written(s) for s in slots]
    with pytest.raises(BadBatch, match="admit requests for the draft's steps too"):
        runner(logits.argmax(-1), positions=before, slots=slots)
    assert [cache.written(s) for s in slots] == before
