"""A verify step on the decode runner (speculative decoding's target side): ``1 + k``
tokens per request, greedy acceptance computed in the graph, and the cache rewound to the
accepted tokens, so the K/V of rejected proposals are never read and the next step writes
over them. Whatever is proposed, the tokens are plain greedy decoding's, under every
graphed strategy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.engine.eager import decode_step
from graphcap.engine.proposers import NgramProposer
from graphcap.inputs import PagedInputs
from graphcap.inputs.accept import greedy_accept
from graphcap.models import PRESETS, Decoder
from tests.support.runner_helpers import DEVICE, prefilled_tiny

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = {0: [5, 9, 2, 7, 1], 2: [3], 3: [8, 8, 4, 11, 6, 2, 9]}
K = 3  # proposals per request
NEW = 12


def setup():
    m, cache, logits = prefilled_tiny(PROMPTS, NEW + K + 1, max_len=40)
    first = {s: int(t) for s, t in zip(sorted(PROMPTS), logits.argmax(-1).tolist(),
                                       strict=True)}
    return m, cache, first


def plain_greedy(m, cache, first):
    """NEW greedy tokens per request, one eager decode step at a time."""
    slots = sorted(first)
    out = {s: [first[s]] for s in slots}
    for _ in range(NEW - 1):
        tokens = torch.tensor([out[s][-1] for s in slots], device=DEVICE)
        positions = torch.tensor([cache.written(s) for s in slots])
        step = decode_step(m, cache, tokens, positions, slots).argmax(-1).tolist()
        for s, t in zip(slots, step, strict=True):
            out[s].append(t)
    return out


def test_greedy_acceptance_takes_proposals_up_to_the_first_disagreement():
    logits = torch.full((2 * 4, 10), -1.0)
    choice = [[3, 4, 5, 6], [7, 1, 2, 9]]  # the target's argmax at each row
    for r, row in enumerate(sum(choice, [])):
        logits[r, row] = 1.0
    tokens = torch.tensor([0, 3, 4, 0, 0, 7, 8, 2])  # last accepted, then 3 proposals
    assert greedy_accept(logits, tokens, 4).tolist() == [[2, 5], [1, 1]]
    padded = torch.cat([logits, torch.zeros(3, 10)])  # a bucket of 11 rows: 3 pads
    assert greedy_accept(padded, torch.cat([tokens, torch.zeros(3, dtype=torch.long)]),
                         4).tolist() == [[2, 5], [1, 1]]


@pytest.mark.parametrize("strategy", GRAPHED)
def test_speculation_with_any_proposals_gives_plain_greedy_tokens(strategy):
    m, cache, first = setup()
    want = plain_greedy(m, cache, first)
    _, cache2, _ = setup()
    runner = graphcap.capture(m, strategy, buckets=[1 + K, 3 * (1 + K)],
                              inputs=PagedInputs(cache2, tokens_per_request=1 + K,
                                                 accept="greedy"))
    slots = sorted(first)
    got = {s: [first[s]] for s in slots}
    gen = torch.Generator().manual_seed(1)
    accepted_any = rejected_any = 0
    while any(len(got[s]) < NEW for s in slots):
        live = [s for s in slots if len(got[s]) < NEW]
        tokens = []
        for s in live:  # half the proposals right (from the answer), half random
            right = (want[s][len(got[s]):] + [0] * K)[:K]
            guess = torch.randint(1, PRESETS["tiny"].vocab_size, (K,), generator=gen)
            tokens += [got[s][-1]] + [r if torch.rand(1, generator=gen) < 0.6 else int(g)
                                      for r, g in zip(right, guess.tolist(), strict=True)]
        positions = [cache2.written(s) for s in live]
        out = runner(torch.tensor(tokens, device=DEVICE), positions=positions, slots=live)
        for s, p, (n, nxt) in zip(live, positions, out.tolist(), strict=True):
            proposals = tokens[live.index(s) * (1 + K) + 1:][:n]
            got[s] += proposals + [nxt]
            accepted_any += n
            rejected_any += n < K
            cache2.rewind(s, p + 1 + n)  # the rejected proposals' K/V: stale
    assert {s: got[s][:NEW] for s in slots} == want
    assert accepted_any > 0 and rejected_any > 0  # both paths taken


def test_rewind_keeps_what_was_written_and_refuses_the_rest():
    _, cache, _ = setup()
    written = cache.written(3)
    cache.rewind(3, written - 2)
    assert cache.written(3) == written - 2
    for bad in (written, -1, 1.5, True):
        with pytest.raises(ValueError, match="rewind of slot 3"):
            cache.rewind(3, bad)
    with pytest.raises(ValueError, match="holds no request"):
        cache.rewind(1, 0)
    assert cache.written(3) == written - 2


def test_a_verify_step_needs_proposals():
    _, cache, _ = setup()
    with pytest.raises(ValueError, match="tokens_per_request=1 \\+ k"):
        PagedInputs(cache, tokens_per_request=1, accept="greedy")
    with pytest.raises(ValueError, match="accept=.sometimes."):
        PagedInputs(cache, tokens_per_request=2, accept="sometimes")


def test_the_ngram_proposer_looks_up_the_longest_recurring_suffix_most_recent_first():
    lookup = NgramProposer(3, max_ngram=2)
    # "4 5" recurs (twice: the most recent one is followed by 9 9), "5" alone would too
    assert lookup.propose([4, 5, 6, 7, 4, 5, 9, 9, 1, 4, 5]) == [9, 9, 1]
    assert lookup.propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert lookup.propose([1, 2, 3, 2]) == [3, 2, 2]  # one follower of "2", then padded
    assert lookup.propose([7, 8, 9]) == [9, 9, 9]  # nothing recurs: the last token
    assert lookup.find([7, 8, 9]) == []
    with pytest.raises(ValueError, match="nothing to look up"):
        lookup.propose([])
    # a request's ids as a numpy array or a 1-d tensor, as prompts may come: the same ids
    # (their truth value raised, asked of several)
    for ids in (np.array([4, 5, 6, 7, 4, 5, 9, 9, 1, 4, 5]),
                torch.tensor([4, 5, 6, 7, 4, 5, 9, 9, 1, 4, 5])):
        assert lookup.propose(ids) == [9, 9, 1] and lookup.find(ids) == [9, 9, 1]
    assert lookup.propose(np.array([7])) == [7, 7, 7]
    with pytest.raises(ValueError, match="nothing to look up"):
        lookup.propose(np.array([], dtype=np.int64))
    with pytest.raises(ValueError, match="above max_ngram"):
        NgramProposer(2, max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="k must be a positive int"):
        NgramProposer(0)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_ngram_speculation_accepts_where_the_text_recurs_and_gives_plain_greedy_tokens(
        strategy):
    """Prompt lookup over a text in which the answer recurs (as when a reply quotes its
    context: here the lookup also sees the greedy continuation, earlier): proposals are
    accepted, verify steps are fewer than decode steps, and the tokens stay plain greedy
    decoding's."""
    m, cache, first = setup()
    want = plain_greedy(m, cache, first)
    _, cache2, _ = setup()
    runner = graphcap.capture(m, strategy, buckets=[3 * (1 + K)],
                              inputs=PagedInputs(cache2, tokens_per_request=1 + K,
                                                 accept="greedy"))
    lookup = NgramProposer(K)
    slots = sorted(first)
    got = {s: [first[s]] for s in slots}
    steps = 0
    while any(len(got[s]) < NEW for s in slots):
        live = [s for s in slots if len(got[s]) < NEW]
        tokens = sum(([got[s][-1]] + lookup.propose(want[s] + PROMPTS[s] + got[s])
                      for s in live), [])
        positions = [cache2.written(s) for s in live]
        out = runner(torch.tensor(tokens, device=DEVICE), positions=positions, slots=live)
        for i, (s, p, (n, nxt)) in enumerate(zip(live, positions, out.tolist(),
                                                  strict=True)):
            got[s] += tokens[i * (1 + K) + 1:][:n] + [nxt]
            cache2.rewind(s, p + 1 + n)
        steps += 1
    assert {s: got[s][:NEW] for s in slots} == want
    assert steps <= (NEW - 1) // 2  # at least two tokens a verify step


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_model_of_one_row_per_request_verifies_from_every_rows_logits(strategy):
    """A model built for prefill (logits of each request's last token only: what LLM
    serves) is asked for every row's in a verify step, and accepts as one of every row."""
    outs = []
    for logits in ("all", "last"):
        m, cache, first = setup()
        torch.manual_seed(0)
        model = Decoder(PRESETS["tiny"], logits=logits).to(DEVICE).eval()
        model.load_state_dict(m.state_dict())
        runner = graphcap.capture(model, strategy, buckets=[3 * (1 + K)],
                                  inputs=PagedInputs(cache, tokens_per_request=1 + K,
                                                     accept="greedy"))
        slots = sorted(PROMPTS)
        proposals = sum(([first[s], first[s], 4, 4] for s in slots), [])
        outs.append(runner(torch.tensor(proposals, device=DEVICE),
                           positions=[cache.written(s) for s in slots], slots=slots).tolist())
    assert outs[0] == outs[1]


def test_the_ngram_lookup_matches_a_plain_search_on_any_tokens():
    """The bytes search finds what comparing every earlier slice finds: token ids whose
    8-byte words share bytes (large ids, ids of 256 multiples) included."""
    def plain(tokens, k, longest):
        for n in range(min(longest, len(tokens) - 1), 0, -1):
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == tokens[len(tokens) - n:]:
                    return tokens[start + n:start + n + k]
        return []

    gen = torch.Generator().manual_seed(7)
    alphabet = [0, 1, 256, 257, 65536, 2**40 + 1, 2**62]
    for _ in range(300):
        length = int(torch.randint(1, 30, (1,), generator=gen))
        tokens = [alphabet[int(i)] for i in torch.randint(0, len(alphabet), (length,),
                                                           generator=gen)]
        for longest in (1, 3):
            assert NgramProposer(4, max_ngram=longest).find(tokens) == \
                plain(tokens, 4, longest), tokens


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_verify_step_returns_each_requests_hidden_state_at_its_last_accepted_token(
        strategy):
    """hidden=True: beside the acceptance, the target's hidden state (the last block's
    output) at each request's last accepted token, as a forward over the request's whole
    text gives it there; proposals half right, so requests accept 0 to K."""
    m, cache, first = setup()
    want = plain_greedy(m, cache, first)
    _, cache2, _ = setup()
    runner = graphcap.capture(m, strategy, buckets=[3 * (1 + K)],
                              inputs=PagedInputs(cache2, tokens_per_request=1 + K,
                                                 accept="greedy", hidden=True))
    slots = sorted(first)
    gen = torch.Generator().manual_seed(2)
    tokens = []
    for s in slots:  # the right continuation, spoiled from a random place on
        cut = int(torch.randint(0, K + 1, (1,), generator=gen))
        tokens += [first[s]] + want[s][1:1 + cut] + [0] * (K - cut)
    positions = [cache2.written(s) for s in slots]
    out, hidden = runner(torch.tensor(tokens, device=DEVICE), positions=positions,
                         slots=slots)
    assert sorted(set(out[:, 0].tolist())) != [0]  # some requests accepted proposals
    for i, s in enumerate(slots):
        n = int(out[i, 0])
        text = PROMPTS[s] + tokens[i * (1 + K):i * (1 + K) + 1 + n]
        _, h = m(torch.tensor(text, device=DEVICE), torch.arange(len(text), device=DEVICE),
                 seq_lens=[len(text)], hidden=True)
        torch.testing.assert_close(hidden[i], h[-1], rtol=1e-4, atol=1e-4)


def test_a_verify_step_with_hidden_states_captures_buckets_smaller_than_a_request():
    # A bucket of fewer tokens than a request's 1 + K holds no request: its graph returns
    # no rows (it failed to capture, reshaping no rows of hidden states).
    m, _, first = setup()
    _, cache, _ = setup()
    runner = graphcap.capture(m, "full", buckets=[2, 1 + K, 2 * (1 + K)],
                              inputs=PagedInputs(cache, tokens_per_request=1 + K,
                                                 accept="greedy", hidden=True))
    slot = sorted(first)[0]
    out, hidden = runner(torch.tensor([first[slot]] + [0] * K, device=DEVICE),
                         positions=[cache.written(slot)], slots=[slot])
    assert out.shape[0] == hidden.shape[0] == 1


def test_hidden_states_of_a_decode_step_need_a_verify_step():
    _, cache, _ = setup()
    with pytest.raises(ValueError, match="a verify step: accept="):
        PagedInputs(cache, tokens_per_request=2, hidden=True)
