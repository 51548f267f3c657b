"""A draft model proposing on graphs of its own (:class:`graphcap.engine.draft.DraftModel`):
the target's greedy tokens whatever the draft, every draft step a replay of its decode
graph, its cache kept in step with the accepted tokens (rewound where a proposal was
refused, caught up where all were accepted, prefilled for a request new to a slot)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphcap import LLM, Sampling
from graphcap.engine.draft import DraftModel
from graphcap.models import PRESETS, Decoder
from tests.engine.test_generate import NEW, PROMPTS, model
from tests.engine.test_llm import truth
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
K = 3


def other_draft(**changes) -> Decoder:
    """A smaller model of the same token ids, other weights: a draft that is often wrong."""
    torch.manual_seed(1)
    args = dataclasses.replace(PRESETS["tiny"], layers=1, **changes)
    return Decoder(args).to(DEVICE).eval()


def with_draft(strategy: str, draft, **kw) -> LLM:
    return LLM(model(), strategy=strategy, max_batch=3, max_len=32, prefill_tokens=8,
               progress=False, speculative=DraftModel(draft, K, strategy=strategy), **kw)


# tc_piecewise: its verify path in test_speculative.py (two models compiled here cost 11 s)
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_the_target_as_its_own_draft_has_everything_accepted_on_graphs(strategy):
    llm = with_draft(strategy, model())
    done = llm.generate(PROMPTS, 12)  # 5 prompts, 3 slots: slots reused by new prompts
    assert [c.tokens for c in done] == [t[:12] for t in truth()]
    spec = llm.report()["speculative"]
    if DEVICE == "cpu":  # float32 on the CPU: a verify row's argmax is a decode step's
        assert spec["acceptance_rate"] == 1.0 and spec["mean_acceptance_length"] == K + 1
    else:  # other kernels at other row counts may part a near-tie
        assert spec["acceptance_rate"] > 0.9
    runners = spec["proposer"]["runners"]
    if strategy == "full":  # the k draft steps one replay; decode replays catch up only
        assert sum(runners["steps"]["replays"].values()) == spec["proposer"]["draft_steps"]
        assert sum(runners["decode"]["replays"].values()) == \
            spec["proposer"]["catch_up_calls"]
    else:
        assert sum(runners["decode"]["replays"].values()) == \
            K * spec["proposer"]["draft_steps"] + spec["proposer"]["catch_up_calls"]
    assert all(not r["fallbacks"] for r in runners.values())
    # no eager step in the loop: every verify and draft call replayed a graph
    assert spec["fallbacks"] == 0 and spec["replays"] == spec["verify_steps"] + sum(
        sum(r["replays"].values()) for r in runners.values())
    assert spec["proposer"]["prefills"] == len(PROMPTS)  # each prompt once, on graphs
    assert spec["proposer"]["catch_up_calls"] > 0  # all accepted: the last proposal's K/V


@pytest.mark.parametrize("k", [1, K])
def test_a_draft_windowed_on_every_layer_keeps_its_pages_for_rewinds_and_new_requests(k):
    # The draft's slots are rewound below tokens its window has passed (a refused
    # proposal; a new request in the slot, from 0): its cache frees no page behind it.
    draft = other_draft(window=4)
    llm = LLM(model(), strategy="full", max_batch=1, max_len=64, prefill_tokens=8,
              progress=False, speculative=DraftModel(draft, k))
    for prompt in ([1, 2, 3, 4, 5], [9, 8, 7]):  # the second reuses the first's slot
        plain = llm.generate([prompt], 40, speculate=False)[0].tokens
        assert llm.generate([prompt], 40)[0].tokens == plain


def test_a_call_interrupted_in_the_drafts_first_prefill_leaves_speculation_usable(
        monkeypatch):
    # Ctrl-C (or an out-of-memory error) after the draft admitted a slot, before it
    # prefilled it: the next call admits that slot again from scratch.
    draft = DraftModel(other_draft(), K)
    llm = LLM(model(), max_batch=3, max_len=32, prefill_tokens=8, progress=False,
              speculative=draft)
    real, calls = draft.engine.prefill, []

    def interrupted(slots):
        calls.append(slots)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(slots)

    monkeypatch.setattr(draft.engine, "prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:1], NEW)
    assert llm.cache.owned() == {}
    assert llm.generate(PROMPTS[:1], NEW)[0].tokens == truth()[0][:NEW]


def served_once() -> tuple[DraftModel, LLM]:
    """A draft and an LLM of one slot that served the first prompt."""
    draft = DraftModel(other_draft(), K)
    llm = LLM(model(), max_batch=1, max_len=32, prefill_tokens=8, progress=False,
              speculative=draft)
    llm.generate(PROMPTS[:1], NEW)
    return draft, llm


def test_a_call_interrupted_in_a_slots_new_prefill_keeps_none_of_its_old_tokens(
        monkeypatch):
    # The slot held the last request's tokens; its new prefill starts from 0 and raises
    # part-way: the draft holds nothing of the slot, so the next call prefills it anew.
    draft, llm = served_once()
    (slot,) = draft.held
    real = draft.engine.prefill

    def interrupted(slots):
        monkeypatch.setattr(draft.engine, "prefill", real)
        raise KeyboardInterrupt

    monkeypatch.setattr(draft.engine, "prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:2], NEW)
    assert draft.held[slot] == []
    assert llm.generate(PROMPTS[:1], NEW)[0].tokens == truth()[0][:NEW]


def test_a_call_interrupted_as_the_draft_rewinds_a_slot_leaves_speculation_usable(
        monkeypatch):
    # Ctrl-C landing just after the draft's cache let go of the slot's old tokens: what the
    # draft says it holds is never more than its cache has written.
    draft, llm = served_once()
    real = draft.cache.rewind

    def interrupted(slot, keep):
        monkeypatch.setattr(draft.cache, "rewind", real)
        real(slot, keep)
        raise KeyboardInterrupt

    monkeypatch.setattr(draft.cache, "rewind", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[1:2], NEW)
    assert llm.generate(PROMPTS[:1], NEW)[0].tokens == truth()[0][:NEW]


def test_a_draft_given_to_an_llm_that_failed_to_build_serves_the_next_one():
    draft = DraftModel(other_draft(), K)
    with pytest.raises(Exception, match="no attention backend 'nope'"):
        LLM(model(), max_batch=1, max_len=32, prefill_tokens=8, progress=False,
            speculative=draft, attention="nope")
    llm = LLM(model(), max_batch=1, max_len=32, prefill_tokens=8, progress=False,
              speculative=draft)
    assert llm.generate(PROMPTS[:1], NEW)[0].tokens == truth()[0][:NEW]


def test_graphcap_generate_hands_its_draft_back_for_the_next_call():
    import graphcap

    draft = DraftModel(other_draft(), K)
    for _ in range(2):  # the LLM each call builds binds the draft, then lets it go
        out = graphcap.generate(model(), PROMPTS[:1], NEW, max_batch=1, speculative=draft)
        assert out.tokens == [truth()[0][:NEW]]
        assert draft.engine is None and draft.cache is None


def test_a_draft_that_is_often_wrong_still_gives_the_targets_greedy_tokens():
    llm = with_draft("full", other_draft())
    for _ in range(2):  # the second call's prompts meet the first call's caches
        done = llm.generate(PROMPTS, NEW)
        assert [c.tokens for c in done] == [t[:NEW] for t in truth()]
    spec = llm.report()["speculative"]
    assert spec["accepted"] < spec["proposals"]


def test_sampled_requests_with_a_draft_draw_the_same_tokens_from_the_same_seeds():
    llm = with_draft("full", other_draft())
    sampling = [Sampling(temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    first = [c.tokens for c in llm.generate(PROMPTS, NEW, sampling=sampling)]
    assert [c.tokens for c in llm.generate(PROMPTS, NEW, sampling=sampling)] == first
    assert llm.report()["verify_sampled"]["replays"]


def test_a_draft_of_other_token_ids_or_serving_two_llms_is_refused():
    with pytest.raises(ValueError, match="a draft shares the target's tokenizer"):
        with_draft("eager", other_draft(vocab_size=PRESETS["tiny"].vocab_size + 1))
    draft = DraftModel(other_draft(), K)
    LLM(model(), max_batch=2, max_len=16, progress=False, speculative=draft)
    with pytest.raises(ValueError, match="already serves an LLM"):
        LLM(model(), max_batch=2, max_len=16, progress=False, speculative=draft)
    with pytest.raises(TypeError, match="propose_batch"):
        DraftModel(other_draft(), K).propose([1, 2])
    # Its own options, where it is made, naming it (the LLM's own may be fine).
    with pytest.raises(ValueError, match="the DraftModel's strategy='nope': unknown"):
        DraftModel(other_draft(), K, strategy="nope")
    with pytest.raises(ValueError, match="the DraftModel's page_size"):
        DraftModel(other_draft(), K, page_size=0)


def test_prompts_prefilled_in_chunks_speculate_as_short_ones_do():
    """Prompts past prefill_tokens prefill in chunks on the target's graphs and on the
    draft's; a request joins the verify steps once its last chunk is in."""
    llm = LLM(model(), max_batch=2, max_len=48, prefill_tokens=8, progress=False,
              speculative=DraftModel(model(), K, prefill_tokens=8))
    prompts = [list(range(1, 21)), [3, 4], list(range(30, 52))]
    plain = [c.tokens for c in llm.generate(prompts, 10, speculate=False)]
    assert [c.tokens for c in llm.generate(prompts, 10)] == plain
    spec = llm.report()["speculative"]
    assert spec["fallbacks"] == 0 and spec["accepted"] > 0
    assert sum(spec["proposer"]["runners"]["extend"]["replays"].values()) > 0


def test_a_draft_of_fewer_positions_names_the_max_len_that_leaves_its_proposals_room():
    # The draft caches max_len + k tokens a request: max_len = the draft's max_position
    # is refused, naming the max_len that fits (which builds), not only "a smaller" one.
    draft = DraftModel(other_draft(max_position=24), K, strategy="eager")
    with pytest.raises(ValueError, match=f"requests {24 + K} \\(max_len plus the k = {K} "
                                         f"proposals.*max_len at most {24 - K} "):
        LLM(model(), strategy="eager", max_batch=1, max_len=24, progress=False,
            speculative=draft)
    LLM(model(), strategy="eager", max_batch=1, max_len=24 - K, progress=False,
        speculative=draft)



def test_an_llm_without_max_len_takes_the_longest_its_draft_leaves_room_for():
    # The default max_len is the target's max_position at most; a draft of fewer positions
    # bounds it too (max_len + k within them), rather than refusing the default.
    assert model().args.max_position > 24
    llm = LLM(model(), strategy="eager", max_batch=1, progress=False,
              speculative=DraftModel(other_draft(max_position=24), K, strategy="eager"))
    assert llm.max_len == 24 - K
    assert len(llm.generate([[1, 2, 3]], max_new_tokens=24 - K - 3)[0].tokens) == 24 - K - 3
    # a call past it is not told to build a larger max_len, which the draft would refuse
    with pytest.raises(ValueError, match=r"max_len 21: generate at most 1 new token \(the "
                                         r"draft's max_position allows no larger max_len\)$"):
        llm.generate([[1] * 20], 3)

@pytest.mark.parametrize("k", [23, 30])
def test_a_k_that_leaves_no_request_room_under_the_drafts_positions_is_refused_naming_k(k):
    # No LLM max_len fits (max_len + k within the draft's 24 positions, max_len >= 2):
    # refused where the draft is made, naming the k that fits, not a max_len <= 0.
    with pytest.raises(ValueError, match=f"k = {k} leaves no room under the draft model's "
                                         "max_position 24 .* k at most 22$"):
        DraftModel(other_draft(max_position=24), k)
    LLM(model(), strategy="eager", max_batch=1, max_len=2, progress=False,
        speculative=DraftModel(other_draft(max_position=24), 22, strategy="eager"))
