"""Extend: prefill on top of a request's cached tokens (a long prompt in chunks, or a
prompt on a cached prefix). Eagerly and through a runner under every strategy, a prompt
prefilled in chunks leaves the cache and the last-token logits of prefilling it whole,
and the decode steps after it give the same tokens; a call mixes fresh prompts and
continuations; a chunk may not start past its request's cached tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphcap
from graphcap.api import STRATEGIES
from graphcap.engine.eager import decode_step, prefill
from graphcap.errors import BadBatch
from graphcap.inputs.cache_prefill import CachePrefillInputs
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, Decoder
from graphcap.opsdb.attention import get_backend
from tests.support.runner_helpers import DEVICE, windowed_extend

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = {0: [5, 9, 2, 7, 1, 3, 3, 8, 6, 2, 4], 1: [3, 1, 4, 1, 5, 9, 2], 2: [8, 6]}
# The chunks each step prefills: (slot, first position, tokens); slot 2 starts fresh
# in the second call, slot 1 continues in a call with a fresh prompt.
CHUNKS = [[(0, 0, 4), (1, 0, 3)], [(0, 4, 5), (2, 0, 2), (1, 3, 4)], [(0, 9, 2)]]


def setup(nan: bool = False):
    torch.manual_seed(0)
    m = Decoder(PRESETS["tiny"]).to(DEVICE).eval()
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=3, max_len=24,
                         page_size=4, device=DEVICE)
    if nan:  # no page but a request's own is ever read
        cache.k.fill_(float("nan"))
        cache.v.fill_(float("nan"))
    for slot, prompt in PROMPTS.items():
        cache.admit(slot, len(prompt) + 4)
    return m, cache


def call_of(chunk):
    ids = torch.tensor(sum((PROMPTS[s][b:b + n] for s, b, n in chunk), []), device=DEVICE)
    positions = torch.cat([torch.arange(b, b + n) for _, b, n in chunk]).to(DEVICE)
    return ids, positions, [n for *_, n in chunk], [s for s, *_ in chunk], \
        [b for _, b, _ in chunk]


def whole(m, cache):
    """Every prompt prefilled at once, then two greedy decode steps: logits per step."""
    slots = sorted(PROMPTS)
    ids = torch.tensor(sum((PROMPTS[s] for s in slots), []), device=DEVICE)
    first = prefill(m, cache, ids, [len(PROMPTS[s]) for s in slots], slots)
    return first, decode(m, cache, first)


def decode(m, cache, first):
    slots, out, last = sorted(PROMPTS), [], first.argmax(-1)
    for step in range(2):
        positions = torch.tensor([len(PROMPTS[s]) + step for s in slots], device=DEVICE)
        logits = decode_step(m, cache, last, positions, slots)
        out.append(logits)
        last = logits.argmax(-1)
    return out


def last_of(chunks, results):
    """Each request's logits at its prompt's last token, from the calls that reached it."""
    last = {}
    for chunk, logits in zip(chunks, results, strict=True):
        end = 0
        for s, b, n in chunk:
            end += n
            if b + n == len(PROMPTS[s]):
                last[s] = logits[end - 1]
    return torch.stack([last[s] for s in sorted(PROMPTS)])


def test_a_prompt_prefilled_in_chunks_is_the_prompt_prefilled_whole():
    m, cache = setup()
    want_first, want_steps = whole(m, cache)
    m2, cache2 = setup(nan=True)
    got = []
    for chunk in CHUNKS:
        ids, positions, lens, slots, starts = call_of(chunk)
        got.append(prefill(m2, cache2, ids, lens, slots, starts=starts))
    firsts = {}
    for chunk, logits in zip(CHUNKS, got, strict=True):  # one row per request
        for (s, b, n), row in zip(chunk, logits, strict=True):
            if b + n == len(PROMPTS[s]):
                firsts[s] = row
    first = torch.stack([firsts[s] for s in sorted(PROMPTS)])
    torch.testing.assert_close(first, want_first, atol=1e-4, rtol=1e-4)
    for a, b in zip(decode(m2, cache2, first), want_steps, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert [cache2.written(s) for s in sorted(PROMPTS)] == [13, 9, 4]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_chunks_through_a_runner_replay_the_eager_extend(strategy):
    m, cache = setup()
    want_first, want_steps = whole(m, cache)
    m2, cache2 = setup(nan=True)
    backend = get_backend(None, DEVICE, strategy=strategy, dtype=torch.float32)
    runner = graphcap.capture(m2, strategy, buckets=[4, 8, 16],
                              inputs=CachePrefillInputs(cache2, backend, slots=3,
                                                        extend=True))
    got = []
    for chunk in CHUNKS:
        ids, positions, lens, slots, starts = call_of(chunk)
        got.append(runner(ids, positions, seq_lens=lens, slots=slots, starts=starts))
    first = last_of(CHUNKS, got)
    torch.testing.assert_close(first, want_first, atol=1e-4, rtol=1e-4)
    for a, b in zip(decode(m2, cache2, first), want_steps, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    report = runner.report()
    if strategy != "eager":
        assert report["replays"] == {8: 1, 16: 1, 4: 1} and not report["fallbacks"]
    untouched = torch.ones(cache2.pages + 1, dtype=torch.bool)
    untouched[0] = False  # the null page: the pads'
    for pages in cache2.owned().values():
        untouched[pages] = False
    assert cache2.k[:, untouched].isnan().all()


def test_bad_starts_are_refused_and_the_runner_stays_usable():
    m, cache = setup()
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    plain = graphcap.capture(m, "full", buckets=[8],
                             inputs=CachePrefillInputs(cache, backend, slots=3))
    ids, positions, lens, slots, starts = call_of(CHUNKS[0])
    with pytest.raises(BadBatch, match=r"needs CachePrefillInputs\(\.\.\., extend=True\)"):
        plain(ids, positions, seq_lens=lens, slots=slots, starts=starts)
    runner = graphcap.capture(m, "full", buckets=[8],
                              inputs=CachePrefillInputs(cache, backend, slots=3,
                                                        extend=True))
    ids, positions, lens, slots, starts = call_of([(0, 4, 3)])
    with pytest.raises(BadBatch, match="starts at 4, but its pages hold 0 tokens"):
        runner(ids, positions, seq_lens=lens, slots=slots, starts=starts)
    with pytest.raises(BadBatch, match="starts at -1, .*a position is never negative"):
        runner(ids, positions, seq_lens=lens, slots=slots, starts=[-1])
    with pytest.raises(BadBatch, match="starts must be an integer"):
        runner(ids, positions, seq_lens=lens, slots=slots, starts=[0.5])
    for given in (0, torch.tensor(0), "0"):  # not one int per request: a BadBatch too
        with pytest.raises(BadBatch, match="starts must be"):
            runner(ids, positions, seq_lens=lens, slots=slots, starts=given)
    with pytest.raises(BadBatch, match="starts has 2 entries for 1 requests"):
        runner(ids, positions, seq_lens=lens, slots=slots, starts=[0, 0])
    ids, positions, lens, slots, starts = call_of([(2, 0, 2)])
    runner(ids, positions, seq_lens=lens, slots=slots, starts=starts)
    with pytest.raises(BadBatch, match="longer than their slots were admitted for"):
        runner(torch.ones(5, dtype=torch.long, device=DEVICE),
               torch.arange(2, 7, device=DEVICE), seq_lens=[5], slots=[2], starts=[2])
    ids, positions, lens, slots, starts = call_of(CHUNKS[0])
    runner(ids, positions, seq_lens=lens, slots=slots, starts=starts)
    assert cache.written(0) == 4 and cache.written(1) == 3 and cache.written(2) == 2


def test_each_token_runs_at_the_position_its_start_gives_and_other_positions_are_refused():
    # The cache counts a request's tokens from its start: the graphs write and read them
    # at those positions, whatever the call's positions say; check_inputs refuses those.
    m, cache = setup(nan=True)
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    runner = graphcap.capture(m, "full", buckets=[8],
                              inputs=CachePrefillInputs(cache, backend, slots=3))
    ids, positions, lens, slots, _ = call_of([(0, 0, 4)])
    got = runner(ids, positions + 6, seq_lens=lens, slots=slots)  # positions 6..9
    torch.testing.assert_close(got, runner(ids, positions, seq_lens=lens, slots=slots))
    step = decode_step(m, cache, torch.tensor([3], device=DEVICE),
                       torch.tensor([4], device=DEVICE), [0])
    assert not step.isnan().any()  # positions 0..3 were written
    checked = graphcap.capture(m, "full", buckets=[8], inputs=CachePrefillInputs(
        cache, backend, slots=3, check_inputs=True))
    with pytest.raises(BadBatch, match=r"positions must run from each request's start"):
        checked(ids, positions + 6, seq_lens=lens, slots=slots)
    checked(ids, positions, seq_lens=lens, slots=slots)  # usable after


def test_a_prompt_past_the_models_positions_is_refused_before_anything_runs():

    torch.manual_seed(0)
    m = Decoder(dataclasses.replace(PRESETS["tiny"], max_position=16)).to(DEVICE).eval()
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1, max_len=24,
                         page_size=4, device=DEVICE)
    cache.admit(0, 24)
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    runner = graphcap.capture(m, "full", buckets=[24], inputs=CachePrefillInputs(
        cache, backend, slots=1, extend=True))
    ids = torch.ones(20, dtype=torch.long, device=DEVICE)
    with pytest.raises(BadBatch, match=r"ending at positions \[20\] reach past the model's "
                                       "max_position 16"):
        runner(ids, torch.arange(20, device=DEVICE), seq_lens=[20], slots=[0])
    assert cache.written(0) == 0
    runner(ids[:16], torch.arange(16, device=DEVICE), seq_lens=[16], slots=[0])  # usable


def test_the_prefill_attention_backend_may_be_given_by_its_name():
    m, cache = setup()
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    named = CachePrefillInputs(cache, backend.name, slots=3)
    assert type(named.attention) is type(backend)
    runner = graphcap.capture(m, "full", buckets=[8], inputs=named)
    ids, positions, lens, slots, _ = call_of(CHUNKS[0])
    runner(ids, positions, seq_lens=lens, slots=slots)
    assert cache.written(0) == 4


def test_a_zero_length_request_beside_others_reads_nothing_and_is_no_refusal_in_a_window():
    # Slot 0's first pages were freed behind the window: a chunk of it from position 0
    # would attend to them, but a request of no tokens reads nothing at any start.
    m, cache, runner = windowed_extend(slots=2)
    cache.admit(0, 30)
    cache.admit(1, 30)
    runner(torch.arange(16, device=DEVICE), torch.arange(16, device=DEVICE),
           seq_lens=[16, 0], slots=[0, 1])
    assert cache.least_kept(0) > 0
    with pytest.raises(BadBatch, match="position 0 of slot 0 is one of the tokens before 8"):
        runner(torch.arange(3, device=DEVICE), torch.arange(3, device=DEVICE),
               seq_lens=[3, 0], slots=[0, 1])
    ids = torch.tensor([4, 5, 6], device=DEVICE)
    got = runner(ids, torch.arange(3, device=DEVICE), seq_lens=[0, 3], slots=[0, 1])
    want = prefill(m, cache, ids, [3], [1])  # slot 1 again, from its start
    torch.testing.assert_close(got[-1], want[0], atol=1e-4, rtol=1e-4)
    assert (cache.written(0), cache.written(1)) == (16, 3)
