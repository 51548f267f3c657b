"""Sampled acceptance of a verify step (rejection sampling in the graph): whatever was
proposed, each token a request gains is distributed as plain sampling draws it with the
same temperature, top-k and top-p; greedy rows accept as greedy acceptance does; the draws
are the seed's, the same eagerly and in every graph."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import BadBatch
from graphcap.inputs import PagedInputs, Sampling
from graphcap.inputs.accept import greedy_accept, sampled_accept
from graphcap.opsdb.sample import probabilities
from tests.opsdb.test_sample import non_finite_rows
from tests.support.runner_helpers import DEVICE, prefilled_tiny

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

VOCAB = 6


def critical(dof: int) -> float:
    """The chi-square statistic of ``dof`` degrees of freedom passed with probability
    1e-4 (Wilson and Hilferty's approximation, within 3% from 1 degree up). The draws are
    seeded: a test passes or fails the same way every run; a right implementation fails
    for about one seed in ten thousand tried, never by the run's luck."""
    if dof == 0:
        return 1e-9
    c = 2 / (9 * dof)
    return dof * (1 - c + 3.719 * c ** 0.5) ** 3


def chi_square(seen: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of the counts ``seen`` against ``probs`` over the tokens
    ``probs`` allows, and its degrees of freedom."""
    support = probs > 0
    expected = probs[support] * seen.sum()
    stat = ((seen[support] - expected) ** 2 / expected).sum().item()
    return stat, int(support.sum()) - 1


def verify_batch(rows: torch.Tensor, proposals: list[int], requests: int, sampling):
    """``requests`` copies of one verify step: the target's logits ``rows`` [1 + k,
    VOCAB] and the proposals, each copy with its own seed; every request at position 10."""
    step = rows.shape[0]
    logits = rows.repeat(requests, 1)
    tokens = torch.tensor([0] + proposals).repeat(requests)
    positions = (10 + torch.arange(step)).repeat(requests)
    params = [torch.full((requests * step,), v, dtype=d) for v, d in (
        (sampling.temperature, torch.float32), (sampling.top_k, torch.long),
        (sampling.top_p, torch.float32))]
    seeds = (torch.arange(requests, dtype=torch.long) * 7919 + 3).repeat_interleave(step)
    return sampled_accept(logits, tokens, step, *params, seeds, positions)


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("finite", [True, False], ids=["finite", "non-finite"])
@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0),
                                      Sampling(temperature=0.7, top_k=4),
                                      Sampling(temperature=1.3, top_p=0.8)],
                         ids=["t1", "t0.7-top4", "t1.3-topp0.8"])
def test_each_token_gained_is_distributed_as_plain_sampling_draws_it(sampling, finite):
    """Non-finite logits too: two +inf tokens share row 0's mass, a NaN token takes all
    of row 1's, row 2 is -inf only (NaN probabilities refused every proposal and drew
    token 0 whatever its chance)."""
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(3, VOCAB, generator=gen) * 1.5
    if not finite:
        rows[0, [1, 4]], rows[1, 2], rows[2] = INF, NAN, -INF
    probs = probabilities(rows, torch.full((3,), sampling.temperature),
                          torch.full((3,), sampling.top_k), torch.full((3,), sampling.top_p),)
    # The most likely token, then the second most likely that sampling keeps (if any)
    kept = int((probs[1] > 0).sum())
    proposals = [int(probs[0].argmax()), int(probs[1].argsort()[-min(2, kept)])]
    requests = 50000
    out = verify_batch(rows, proposals, requests, sampling)
    accepted, following = out[:, 0], out[:, 1]
    gained = torch.full((requests, 3), -1)
    for j in range(2):  # the proposals accepted, then the next token
        gained[:, j] = torch.where(accepted > j, proposals[j],
                                   torch.where(accepted == j, following, -1))
    gained[:, 2] = torch.where(accepted == 2, following, -1)
    # The first token gained follows row 0's p; given it equals the first proposal (the
    # context row 1 saw), the second follows row 1's p; given both, the third row 2's.
    for j, given in ((0, torch.ones(requests, dtype=torch.bool)),
                     (1, gained[:, 0] == proposals[0]),
                     (2, (gained[:, 0] == proposals[0]) & (gained[:, 1] == proposals[1]))):
        seen = torch.bincount(gained[given, j], minlength=VOCAB).double()
        assert seen[probs[j] == 0].sum() == 0  # nothing top-k or top-p cut
        stat, dof = chi_square(seen, probs[j].double())
        assert given.sum() > 100 and stat < critical(dof), (j, stat, dof, seen)


def test_greedy_rows_accept_as_greedy_acceptance_does():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5 * 4 + 2, 50, generator=gen)  # 5 requests of 1 + 3, 2 pad rows
    tokens = logits.argmax(-1)
    tokens[torch.rand(22, generator=gen) < 0.3] = 7  # some proposals wrong
    greedy = [torch.zeros(22), torch.zeros(22, dtype=torch.long), torch.ones(22)]
    positions = torch.arange(22)
    for seed in range(4):
        got = sampled_accept(logits, tokens, 4, *greedy, torch.full((22,), seed), positions)
        assert torch.equal(got, greedy_accept(logits, tokens, 4))


@hypothesis.given(st.data())
def test_what_a_request_gains_is_what_its_rows_allow_whatever_the_logits(data):
    """Logits with +inf, NaN and -inf entries, any proposals: a proposal is accepted only
    where its row allows it, a refused one is never the next token, which its row allows;
    greedy requests accept as greedy acceptance does; a request's result is its own,
    alone or beside others."""
    requests, k = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 3))
    vocab, step = data.draw(st.integers(2, 8)), k + 1
    logits = data.draw(non_finite_rows(requests * step, vocab))
    tokens = torch.tensor(data.draw(st.lists(st.integers(0, vocab - 1),
                                             min_size=requests * step,
                                             max_size=requests * step)))
    sampling = [data.draw(st.builds(Sampling, st.sampled_from([0.0, 0.6, 1.0]),
                                    st.integers(0, vocab), st.sampled_from([0.5, 1.0]),
                                    st.integers(0, 2**40))) for _ in range(requests)]
    params = [torch.tensor([getattr(p, name) for p in sampling]).repeat_interleave(step)
              for name in ("temperature", "top_k", "top_p", "seed")]
    positions = torch.arange(requests * step) + 5
    out = sampled_accept(logits, tokens, step, *params, positions)
    probs = probabilities(logits, *params[:3]).view(requests, step, vocab)
    proposed = tokens.view(requests, step)[:, 1:]
    for r, (n, following) in enumerate(out.tolist()):
        assert 0 <= n <= k and probs[r, n, following] > 0, (r, n, following, probs[r])
        assert all(probs[r, j, proposed[r, j]] > 0 for j in range(n))
        if n < k:
            assert following != proposed[r, n]
        rows = slice(r * step, (r + 1) * step)
        alone = sampled_accept(logits[rows], tokens[rows], step,
                               *(p[rows] for p in params), positions[rows])
        assert alone.tolist() == [[n, following]]
        if sampling[r].temperature == 0.0:
            assert alone.tolist() == greedy_accept(logits[rows], tokens[rows], step).tolist()


def test_a_request_draws_the_same_tokens_from_the_same_seed_and_others_from_another():
    rows = torch.randn(4, 40, generator=torch.Generator().manual_seed(3))
    proposals = [int(t) for t in rows[:3].argmax(-1)]
    a = verify_batch(rows, proposals, 300, Sampling(temperature=2.0))
    assert torch.equal(a, verify_batch(rows, proposals, 300, Sampling(temperature=2.0)))
    assert len(set(map(tuple, a.tolist()))) > 10  # the seeds draw apart


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_sampled_verify_step_replays_what_it_computes_eagerly(strategy):
    """The same proposals and seeds through a captured verify runner and an eager one:
    the same accepted counts and next tokens, mixed greedy and sampled requests."""
    prompts = {0: [5, 9, 2, 7, 1], 1: [3], 3: [8, 8, 4, 11, 6, 2, 9]}
    k = 3
    runs = {}
    for name in ("eager", strategy):
        m, cache, _ = prefilled_tiny(prompts, 8 * (1 + k), max_len=48)
        runner = graphcap.capture(m, name, buckets=[2 * (1 + k), 4 * (1 + k)],
                                  inputs=PagedInputs(cache, tokens_per_request=1 + k,
                                                     accept="sampled"))
        gen = torch.Generator().manual_seed(4)
        slots = sorted(prompts)
        sampling = [Sampling(temperature=1.5, seed=11), Sampling(),
                    Sampling(temperature=0.8, top_k=20, seed=12)]
        outs = []
        for _ in range(5):
            tokens = torch.randint(1, m.args.vocab_size, (3 * (1 + k),), generator=gen)
            positions = [cache.written(s) for s in slots]
            out = runner(tokens.to(DEVICE), positions=positions, slots=slots,
                         sampling=sampling)
            outs.append(out.tolist())
            for s, p, (n, _) in zip(slots, positions, out.tolist(), strict=True):
                cache.rewind(s, p + 1 + n)
        runs[name] = outs
    assert runs[strategy] == runs["eager"]


def test_a_sampled_verify_step_takes_one_sampling_per_request():
    model, cache, _ = prefilled_tiny({0: [1, 2]}, 8, max_len=16)
    runner = graphcap.capture(model, "eager", buckets=[3],
                              inputs=PagedInputs(cache, tokens_per_request=3,
                                                 accept="sampled"))
    tokens = torch.tensor([1, 2, 3], device=DEVICE)
    with pytest.raises(BadBatch, match="sampling must be 1 graphcap.Sampling"):
        runner(tokens, positions=[2], slots=[0], sampling=[Sampling(), Sampling()])
    for given in (Sampling(temperature=0.7), 3):  # one for all, or no list: refused too
        with pytest.raises(BadBatch, match="sampling must be 1 graphcap.Sampling"):
            runner(tokens, positions=[2], slots=[0], sampling=given)
    assert cache.written(0) == 2  # refused before anything ran
    assert runner(tokens, positions=[2], slots=[0]).shape == (1, 2)  # None: greedy
