"""``graphcap::sample`` against transformers' logits warpers (temperature, then top-k, then
top-p, as ``generate`` applies them): the tokens that can be drawn and their
probabilities are the warpers', ties at the k-th token and a large vocabulary's top-p cut
included; the draws follow them; a row draws the same token in any batch."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    InfNanRemoveLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from graphcap.opsdb.sample import SAMPLE, probabilities


def warped(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """transformers' distribution: its warpers on float32 scores, as ``generate`` runs."""
    scores = logits.float()
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


def ours(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    rows = logits.shape[0]
    return probabilities(logits, torch.full((rows,), temperature),
                         torch.full((rows,), top_k), torch.full((rows,), top_p))


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers_does():
    tied = torch.tensor([[2.0, 2.0, 2.0, 0.0], [3.0, 1.0, 1.0, 1.0]])
    for row, top_k in ((0, 1), (1, 2)):
        want = warped(tied[row:row + 1], 1.0, top_k, 1.0)
        torch.testing.assert_close(ours(tied[row:row + 1], 1.0, top_k, 1.0), want)
    equal = ours(tied[:1], 1.0, 1, 1.0)[0]
    assert equal[0] == equal[1] == equal[2]  # equal logits, equal chances


@given(st.data())
def test_the_distribution_is_transformers_warpers(data):
    """Tie-heavy logits (small integers, bfloat16): the same probabilities, up to which of
    several tied tokens a top-p cut keeps (transformers' sort order decides that)."""
    vocab = data.draw(st.integers(1, 24))
    values = data.draw(st.lists(st.integers(-3, 3), min_size=vocab, max_size=vocab))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
    logits = (torch.tensor([values], dtype=torch.float32) * 0.75).to(dtype)
    temperature = data.draw(st.sampled_from([0.3, 1.0, 2.5]))
    top_k = data.draw(st.integers(0, vocab + 2))
    top_p = data.draw(st.sampled_from([0.05, 0.3, 0.5, 0.9, 1.0]))
    want = warped(logits, temperature, top_k, top_p)[0]
    got = ours(logits, temperature, top_k, top_p)[0]
    torch.testing.assert_close(got.sort().values, want.sort().values, atol=1e-6, rtol=0)
    if top_p == 1.0:  # no cut that ties could split: the very tokens
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_top_p_keeps_at_least_top_p_on_a_large_vocabulary():
    """Qwen3's vocabulary: the kept set is the smallest that reaches top_p, computed in
    float64, as transformers' is (1 minus a float32 sum rounded near 1 cut hundreds of
    tail tokens too early, keeping less than top_p)."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 151936, generator=gen) * 6
    for temperature, top_p in ((1.3, 0.999), (1.0, 0.95)):
        got = ours(logits, temperature, 0, top_p)[0] > 0
        exact = (logits[0].double() / temperature).softmax(dim=-1)
        kept = exact[got].sum()
        assert kept >= top_p - 1e-7, (temperature, top_p, float(kept))
        want = warped(logits, temperature, 0, top_p)[0] > 0
        assert (got != want).sum() <= 1  # a float32 top_p at the cut, at most


def test_draws_follow_transformers_probabilities_with_ties_at_the_kth_token():
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5, 2.0]], dtype=torch.bfloat16)
    want = warped(logits, 0.8, 2, 1.0)[0]  # four tokens tie at the top: all are kept
    rows = 40000
    tokens = SAMPLE(logits.expand(rows, 6), torch.full((rows,), 0.8),
                    torch.full((rows,), 2), torch.ones(rows), torch.arange(rows) * 7919,
                    torch.full((rows,), 11))
    seen = torch.bincount(tokens, minlength=6) / rows
    assert (seen - want).abs().max() < 0.011, (seen, want)  # 5 sigma of 40000 draws


@given(st.data())
def test_a_row_draws_the_same_token_alone_and_in_any_batch(data):
    rows = data.draw(st.integers(2, 6))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31)))
    logits = (torch.randn(rows, 50, generator=gen) * 3).round()  # ties too
    temperature = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 3.0]),
                                                  min_size=rows, max_size=rows)))
    top_k = torch.tensor(data.draw(st.lists(st.integers(0, 60), min_size=rows,
                                            max_size=rows)))
    top_p = torch.tensor(data.draw(st.lists(st.sampled_from([0.01, 0.5, 0.9, 1.0]),
                                            min_size=rows, max_size=rows)))
    seed = torch.tensor(data.draw(st.lists(st.integers(0, 2**63 - 1), min_size=rows,
                                           max_size=rows)))
    counter = torch.tensor(data.draw(st.lists(st.integers(0, 2**40), min_size=rows,
                                              max_size=rows)))
    args = (logits, temperature, top_k, top_p, seed, counter)
    batch = SAMPLE(*args)
    perm = torch.randperm(rows, generator=gen)
    torch.testing.assert_close(SAMPLE(*(a[perm] for a in args)), batch[perm])
    for row in range(rows):
        assert SAMPLE(*(a[row:row + 1] for a in args))[0] == batch[row]


INF, NAN = float("inf"), float("nan")


@st.composite
def non_finite_rows(draw, rows: int, vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` logits of small integers, each row with some +inf, NaN or -inf
    entries, or -inf only, or none."""
    out = []
    for _ in range(rows):
        kind = draw(st.sampled_from(["+inf", "nan", "both", "-inf only", "-inf", "finite"]))
        row = [float(v) for v in draw(st.lists(st.integers(-3, 3), min_size=vocab,
                                               max_size=vocab))]
        bad = {"+inf": [INF], "nan": [NAN], "both": [INF, NAN], "-inf": [-INF]}.get(kind)
        for i in draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=3)) \
                if bad else []:
            row[i] = draw(st.sampled_from(bad))
        out.append([-INF] * vocab if kind == "-inf only" else row)
    return torch.tensor(out)


def warped_invalid(logits: torch.Tensor, temperature: float, top_k: int, top_p: float):
    """transformers' distribution where its InfNanRemoveLogitsProcessor runs on the scaled
    logits, NaN first made +inf (torch.argmax ranks it first): +inf the largest float32,
    -inf the smallest."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.float())
    scores = InfNanRemoveLogitsProcessor()(None, scores.nan_to_num(INF, INF, -INF))
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


@given(st.data())
def test_non_finite_logits_give_a_distribution_and_draws_inside_it(data):
    """+inf logits (or NaN, ranked first as argmax ranks it) take all the mass, shared
    equally; a row of -inf only is uniform; never NaN (which made every draw and
    acceptance against it garbage); greedy rows take the argmax; the token drawn is one
    the distribution allows."""
    rows, vocab = data.draw(st.integers(1, 4)), data.draw(st.integers(1, 10))
    logits = data.draw(non_finite_rows(rows, vocab))
    temperature = data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                     min_size=rows, max_size=rows))
    top_k = data.draw(st.lists(st.integers(0, vocab + 1), min_size=rows, max_size=rows))
    top_p = data.draw(st.lists(st.sampled_from([0.3, 0.9, 1.0]), min_size=rows,
                               max_size=rows))
    params = (torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p))
    probs = probabilities(logits, *params)
    assert probs.isfinite().all() and (probs >= 0).all()
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(rows))
    for row in range(rows):
        if temperature[row] == 0.0:
            want = torch.zeros(vocab).index_fill_(0, logits[row].argmax(), 1.0)
            torch.testing.assert_close(probs[row], want)
        else:
            want = warped_invalid(logits[row:row + 1], temperature[row], top_k[row],
                                  top_p[row])[0]
            torch.testing.assert_close(probs[row].sort().values, want.sort().values,
                                       atol=1e-6, rtol=0)
    seed = torch.tensor(data.draw(st.lists(st.integers(0, 2**40), min_size=rows,
                                           max_size=rows)))
    tokens = SAMPLE(logits, *params, seed, torch.full((rows,), 7))
    assert (probs.gather(1, tokens[:, None]) > 0).all(), (tokens, probs)


def test_draws_share_the_mass_of_the_infinite_logits_equally():
    logits = torch.tensor([[INF, 1e30, INF, NAN, -INF]])
    rows = 30000
    tokens = SAMPLE(logits.expand(rows, 5), torch.full((rows,), 0.7),
                    torch.zeros(rows, dtype=torch.long), torch.ones(rows),
                    torch.arange(rows) * 7919, torch.full((rows,), 3))
    seen = torch.bincount(tokens, minlength=5) / rows
    assert seen[[1, 4]].sum() == 0 and (seen[[0, 2, 3]] - 1 / 3).abs().max() < 0.014, seen
