"""Speculative decoding in ``graphcap.LLM`` and ``graphcap.generate``: with any proposer
the greedy tokens are plain greedy decoding's (every sequence recomputed) under every
strategy, and sampled tokens are distributed as plain sampling's; every verify step
replays a graph; the report counts proposals and acceptances; bad proposers are refused
and leave the LLM usable."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

import graphcap
from graphcap import LLM, Sampling
from graphcap.api import GRAPHED
from graphcap.engine.proposers import NgramProposer
from graphcap.models import PRESETS, Decoder
from tests.engine.test_generate import NEW, PROMPTS, model
from tests.engine.test_llm import cut, truth
from tests.inputs.test_sampled_accept import critical
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
K = 3


class Oracle:
    """Proposals from the answer (each request's greedy continuation), every third one
    spoiled: steps that accept some and refuse the rest."""

    def __init__(self, k: int):
        self.k = k

    def propose(self, tokens):
        for prompt, answer in zip(PROMPTS, truth(), strict=True):
            if tokens[:len(prompt)] == prompt:
                done = len(tokens) - len(prompt)
                ahead = (answer[done:] + [0] * self.k)[:self.k]
                return [0 if (done + i) % 3 == 2 else t for i, t in enumerate(ahead)]
        raise AssertionError(f"no prompt begins {tokens}")


class RandomProposer:
    """Proposals that are almost never right: the cost of speculation without its gain."""

    def __init__(self, k: int, vocab: int):
        self.k, self.vocab, self.rng = k, vocab, random.Random(0)

    def propose(self, tokens):
        return [self.rng.randrange(self.vocab) for _ in range(self.k)]


def speculative_llm(strategy: str, proposer, **kw) -> LLM:
    return LLM(model(), strategy=strategy, max_batch=3, max_len=32, prefill_tokens=8,
               progress=False, speculative=proposer, **kw)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_speculative_greedy_tokens_are_plain_greedy_decodings_and_every_step_replays(
        strategy):
    oracle = speculative_llm(strategy, Oracle(K))  # some proposals right, some wrong
    for _ in range(2):  # a second call captures nothing and gives the same tokens
        done = oracle.generate(PROMPTS, 12)
        assert [c.tokens for c in done] == [t[:12] for t in truth()]
    report = oracle.report()
    spec, verify = report["speculative"], report["verify"]
    assert 0 < spec["accepted"] < spec["proposals"]
    assert spec["mean_acceptance_length"] > 1.5
    assert sum(verify["replays"].values()) == spec["verify_steps"]
    assert not verify["fallbacks"] and verify["recaptures"] == 0
    assert sum(report["decode"]["replays"].values()) == 0  # no plain decode step


def test_proposals_that_are_never_right_still_give_plain_greedy_tokens():
    wrong = speculative_llm("full", RandomProposer(K, model().args.vocab_size))
    assert [c.tokens for c in wrong.generate(PROMPTS, NEW)] == [t[:NEW] for t in truth()]
    assert wrong.report()["speculative"]["accepted"] == 0


def test_a_model_windowed_on_every_layer_speculates_past_the_pages_freed_behind_it():
    # Pages behind every layer's window are freed as tokens are written; verify steps
    # whose proposals are refused rewind to their first tokens, whose windows' pages must
    # all be there still, page after page.
    torch.manual_seed(0)
    windowed = Decoder(dataclasses.replace(PRESETS["tiny"], window=8)).to(DEVICE).eval()
    llm = LLM(windowed, strategy="full", max_batch=2, max_len=96, progress=False,
              speculative=RandomProposer(K, windowed.args.vocab_size))
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8] * 3, [9, 10, 11]]
    plain = [c.tokens for c in llm.generate(prompts, 48, speculate=False)]
    assert [c.tokens for c in llm.generate(prompts, 48)] == plain
    assert llm.report()["speculative"]["verify_steps"] >= 48 // (K + 1)


def test_a_stop_token_in_the_middle_of_a_steps_gained_tokens_ends_the_request_there():
    lookup = speculative_llm("full", NgramProposer(K))
    want = truth()
    stops = {want[0][4], want[2][2]}
    done = lookup.generate(PROMPTS, 12, stop=sorted(stops))
    assert [c.tokens for c in done] == [cut(t, stops, 12) for t in want]
    assert [c.finish_reason for c in done] == \
        ["stop" if set(t[:12]) & stops else "length" for t in want]


def test_generate_takes_a_proposer_and_reports_what_it_did():
    out = graphcap.generate(model(), PROMPTS, NEW, max_batch=2,
                            speculative=NgramProposer(K))
    assert out.tokens == [t[:NEW] for t in truth()]
    assert out.report["verify_steps"] == sum(out.report["verify_replays"].values()) > 0
    assert out.report["proposals"] == K * out.report["verify_steps"] or \
        out.report["proposals"] > out.report["verify_steps"]
    assert out.report["decode_steps"] == 0 and not out.report["verify_fallbacks"]


def test_sampled_tokens_are_distributed_as_plain_samplings():
    """One prompt, 960 seeds, the tokens after the first: the counts of the second and
    third token under speculation (proposals from the greedy answer: some accepted, some
    refused) and under plain decoding, compared by a two-sample chi-square (seeded: the
    same verdict every run). 32 requests a step: each request's draws follow its seed
    alone, the same tokens as 8 a step gave, in a quarter of the steps."""
    prompt, seeds = [[5, 9, 2, 7, 1]], range(960)
    sampling = [Sampling(temperature=0.6, top_k=3, seed=s) for s in seeds]
    runs = {}
    for name, proposer in (("plain", None), ("speculative", Oracle(K))):
        llm = LLM(model(), strategy="eager", max_batch=32, max_len=16, progress=False,
                  speculative=proposer)
        done = llm.generate(prompt * len(seeds), 3, sampling=sampling)
        runs[name] = torch.tensor([c.tokens for c in done])
    report = llm.report()
    spec = report["speculative"]
    assert 0 < spec["accepted"] < spec["proposals"]
    # sampled requests verify on the sampled runner (eager here: its calls counted)
    assert report["verify_sampled"]["calls"] == spec["verify_steps"]
    assert report["verify"]["calls"] == 0
    for j in (1, 2):
        a, b = (torch.bincount(runs[n][:, j], minlength=model().args.vocab_size).double()
                for n in ("plain", "speculative"))
        stat, dof = two_sample(a, b)
        assert dof >= 3 and stat < critical(dof), (j, stat, dof)


def two_sample(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of two samples' counts ``a`` and ``b`` drawn from one law, over
    the tokens drawn at least 10 times in all (the rest pooled in one cell), and its
    degrees of freedom."""
    common = (a + b) >= 10
    a = torch.cat([a[common], a[~common].sum()[None]])
    b = torch.cat([b[common], b[~common].sum()[None]])
    seen = (a + b) > 0
    a, b = a[seen], b[seen]
    share = a.sum() / (a.sum() + b.sum())
    expect_a, expect_b = (a + b) * share, (a + b) * (1 - share)
    stat = ((a - expect_a) ** 2 / expect_a + (b - expect_b) ** 2 / expect_b).sum()
    return stat.item(), int(seen.sum()) - 1


class Wrong:
    def __init__(self, k, proposal):
        self.k, self.proposal = k, proposal

    def propose(self, tokens):
        return self.proposal


@pytest.mark.parametrize(("proposer", "match"), [
    (object(), "a proposer needs k"),
    (Wrong(0, []), "k must be a positive int"),
])
def test_what_is_no_proposer_is_refused_when_the_llm_is_built(proposer, match):
    with pytest.raises(ValueError, match=match):
        speculative_llm("eager", proposer)


def test_bad_proposals_are_refused_and_leave_the_llm_usable():
    proposer = Wrong(2, [1])
    llm = speculative_llm("full", proposer)
    with pytest.raises(ValueError, match="must give k = 2 ints"):
        llm.generate(PROMPTS, NEW)
    proposer.proposal = [1, 10**6]
    with pytest.raises(ValueError, match="token ids must be in"):
        llm.generate(PROMPTS, NEW)
    proposer.proposal = [1, 2.0]
    with pytest.raises(ValueError, match="must give k = 2 ints"):
        llm.generate(PROMPTS, NEW)
    # ints as a list, a numpy array, a tensor, or numpy ints in a list: the same tokens
    for proposal in ([1, 2], np.array([1, 2]), torch.tensor([1, 2]), [np.int32(1), 2]):
        proposer.proposal = proposal
        assert [c.tokens for c in llm.generate(PROMPTS, NEW)] == [t[:NEW] for t in truth()]


def test_room_for_the_proposals_past_max_position_is_refused():
    with pytest.raises(ValueError, match="plus the proposer's k = 3 passes"):
        LLM(model(), max_len=model().args.max_position, speculative=NgramProposer(K),
            progress=False)


def test_a_max_len_past_max_position_is_refused_naming_the_max_len_that_fits():
    bound = model().args.max_position
    with pytest.raises(ValueError, match=f"max_len {bound + 1} passes the model's "
                                         f"max_position {bound}: build the LLM with "
                                         f"max_len at most {bound}$"):
        LLM(model(), max_len=bound + 1, progress=False)
    with pytest.raises(ValueError, match=f"with max_len at most {bound - K}$"):
        LLM(model(), max_len=bound + 1, speculative=NgramProposer(K), progress=False)


def test_a_proposer_whose_k_leaves_no_room_under_max_position_is_refused_naming_k():
    m = model()
    with pytest.raises(ValueError, match=f"k = {m.args.max_position} leaves no room"):
        LLM(m, speculative=NgramProposer(m.args.max_position), progress=False)


def test_the_default_max_len_leaves_the_proposals_room_below_max_position():
    m = model()  # eager: the bound is set before anything captures
    llm = LLM(m, strategy="eager", max_batch=1, speculative=NgramProposer(K), progress=False)
    assert llm.max_len == min(m.args.max_position - K, 4096)
    assert llm.cache.max_len == llm.max_len + K


def test_generate_says_the_proposals_need_room_past_the_prompt_and_its_new_tokens():
    m = model()
    prompt = [[1] * (m.args.max_position - 6)]
    with pytest.raises(ValueError, match="and the 3 proposals a verify step writes past"):
        graphcap.generate(m, prompt, max_new_tokens=6, speculative=NgramProposer(K))


def test_with_a_tokenizer_a_stop_string_ends_a_speculative_request_where_plain_ends_it():
    from tests.support.tokenizers import byte_tokenizer

    tok = byte_tokenizer()
    llm = LLM(model(), tok, max_batch=2, max_len=48, prefill_tokens=16, progress=False,
              speculative=NgramProposer(K))
    prompts = ["graphs! graphs!", "hi"]
    plain = llm.generate(prompts, 12, speculate=False)
    assert [c.tokens for c in llm.generate(prompts, 12)] == [c.tokens for c in plain]
    stop = plain[0].text[4:6]
    want = llm.generate(prompts[:1], 12, stop=[stop], speculate=False)[0]
    got = llm.generate(prompts[:1], 12, stop=[stop])[0]
    assert (got.tokens, got.text, got.finish_reason) == \
        (want.tokens, want.text, "stop_string")
    assert "".join(d.text for d in llm.stream(prompts[:1], 12, stop=[stop])) == want.text


def test_a_streamed_verify_step_brings_its_tokens_in_one_delta():
    llm = speculative_llm("full", Oracle(K))
    deltas = list(llm.stream(PROMPTS[:1], 12))
    assert max(len(d.tokens) for d in deltas) > 1  # accepted proposals and the next token
    assert sum((d.tokens for d in deltas), []) == truth()[0][:12]
    assert [d.finish_reason for d in deltas][-1] == "length"


def test_generate_refuses_a_proposer_that_is_none_by_name_before_anything_runs():
    class NotOne:
        k = "x"

    with pytest.raises(ValueError, match="a proposer needs k"):
        graphcap.generate(model(), [[1, 2]], 2, speculative=NotOne())
