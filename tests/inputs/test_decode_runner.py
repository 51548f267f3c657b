"""Decode steps through a runner (``graphcap.inputs.DecodeInputs``): under breakable and
full, on the graph emulator here and CUDA graphs on the GPU, a greedy loop whose batch
shrinks and grows across buckets (requests finish, others join) gives the tokens and
logits of the eager steps, padded rows touch no request's pages, and bad steps are
refused before anything runs."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.engine.eager import decode_step, prefill
from graphcap.errors import BadBatch
from graphcap.inputs import DecodeInputs
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, Decoder
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = {0: [5, 9, 2, 7, 1], 1: [3], 2: [8, 8, 4, 11, 6, 2, 9], 3: [4, 4]}
# Which request slots step at each step: the batch moves across the buckets 1..4.
SCHEDULE = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [2], [2, 3], [1, 2, 3], [0, 1, 2, 3],
            [3], [0, 3]]
BUCKETS = [1, 2, 4]


def setup(preset="tiny", **changes):
    torch.manual_seed(0)
    m = Decoder(dataclasses.replace(PRESETS[preset], **changes)).to(DEVICE).eval()
    a = m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=32,
                         page_size=4, device=DEVICE)
    for slot, prompt in PROMPTS.items():
        cache.admit(slot, len(prompt) + len(SCHEDULE) + 1)
    return m, cache


def run(step, m, cache):
    """Prefill every prompt, then follow SCHEDULE greedily: tokens and logits per step."""
    slots = sorted(PROMPTS)
    ids = torch.tensor(sum((PROMPTS[s] for s in slots), []), device=DEVICE)
    logits = prefill(m, cache, ids, [len(PROMPTS[s]) for s in slots], slots)
    last = dict(zip(slots, logits.argmax(-1).tolist(), strict=True))
    length = {s: len(PROMPTS[s]) for s in slots}
    seen = []
    for rows in SCHEDULE:
        tokens = torch.tensor([last[s] for s in rows], device=DEVICE)
        out = step(tokens, [length[s] for s in rows], rows)
        seen.append(out.clone())
        for s, t in zip(rows, out.argmax(-1).tolist(), strict=True):
            last[s], length[s] = t, length[s] + 1
    return seen


def eager(m, cache):
    return lambda tokens, positions, rows: decode_step(
        m, cache, tokens, torch.tensor(positions, device=DEVICE), rows)


@pytest.mark.parametrize("strategy", [*GRAPHED, "breakable-debug", "eager"])
def test_a_greedy_loop_through_the_runner_replays_the_eager_steps(strategy):
    m, cache = setup()
    want = run(eager(m, cache), m, cache)
    m2, cache2 = setup()
    cache2.k.fill_(float("nan"))  # no page but a request's own is ever read
    cache2.v.fill_(float("nan"))
    debug = strategy == "breakable-debug"  # the whole step as one eager break
    runner = graphcap.capture(m2, strategy.removesuffix("-debug"), buckets=BUCKETS,
                              inputs=DecodeInputs(cache2), **({"debug": True} if debug
                                                              else {}))
    got = run(lambda t, p, s: runner(t, positions=p, slots=s), m2, cache2)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {step}")
    report = runner.report()
    if strategy != "eager":
        assert sum(report["replays"].values()) == len(SCHEDULE)
        assert not report["fallbacks"]
    if debug:
        assert set(report["breaks"].values()) == {1} and set(report["segments"].values()) \
            == {0}


@pytest.mark.parametrize("strategy", [*GRAPHED, "eager"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])  # rotary alone; with qk-norm
def test_steps_whose_attention_rotates_the_projections_rows_equal_the_two_kernel_steps(
        strategy, preset, monkeypatch):
    """A backend that rotates (``rotates``: the default's decode kernel normalises and
    rotates q and the new key itself, in the launch that writes and attends) decodes the
    tokens and logits of the default path (graphcap::qkv_norm_rope first)."""
    from graphcap.opsdb.attention.paged import OpsdbDecode

    m, cache = setup(preset)
    want = run(eager(m, cache), m, cache)
    monkeypatch.setattr(OpsdbDecode, "rotates", True)
    m2, cache2 = setup(preset)
    if strategy == "eager":
        step = eager(m2, cache2)
    else:
        runner = graphcap.capture(m2, strategy, buckets=BUCKETS, inputs=DecodeInputs(cache2))
        step = lambda t, p, s: runner(t, positions=p, slots=s)  # noqa: E731
    got = run(step, m2, cache2)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=f"step {i}")
    # Every request's pages hold the rotated keys (page 0, the null page, takes the pads')
    torch.testing.assert_close(cache2.k[:, 1:], cache.k[:, 1:], atol=1e-5, rtol=1e-5)


def test_padded_rows_write_only_the_null_page():
    m, cache = setup()
    runner = graphcap.capture(m, "full", buckets=[4], inputs=DecodeInputs(cache))
    before = cache.k.clone()
    positions, slots = [0, 0, 0], [1, 2, 3]  # slot 0's pages: no live row's
    runner(torch.tensor([1, 2, 3], device=DEVICE), positions=positions, slots=slots)
    assert runner.report()["replays"] == {4: 1}  # one padded row
    # Token cells written, [layers, pages, page offsets]: the live rows' own cells, and
    # nothing of any real page besides (a pad writing a live request's page shows here).
    changed = (cache.k != before).flatten(3).any(-1)
    allowed = torch.zeros_like(changed[0])
    allowed[0] = True  # the null page, which no request owns
    for s, p in zip(slots, positions, strict=True):
        allowed[cache.owned()[s][p // cache.page_size], p % cache.page_size] = True
    assert not (changed & ~allowed).any()


@pytest.mark.parametrize("strategy", GRAPHED)
def test_poison_in_padded_rows_and_buffer_tails_never_reaches_a_live_row(strategy):
    """Before every step the static buffers' rows past the live ones hold poison: other
    (valid) tokens and positions, NaN temperatures and top-p, absurd top-k and seeds, so
    the padded rows of the bucket run on them; the live rows draw what eager draws."""
    from graphcap import Sampling
    from graphcap.inputs.sampling import draw

    m, cache = setup()
    m2, cache2 = setup()
    cache2.k.fill_(float("nan"))
    cache2.v.fill_(float("nan"))
    runner = graphcap.capture(m2, strategy, buckets=BUCKETS,
                              inputs=DecodeInputs(cache2, sample=True))
    eager_steps = eager(m, cache)
    length = {s: len(p) for s, p in PROMPTS.items()}
    for cache_ in (cache, cache2):
        ids = torch.tensor(sum(PROMPTS.values(), []), device=DEVICE)
        prefill(m if cache_ is cache else m2, cache_, ids, [len(p) for p in PROMPTS.values()],
                list(PROMPTS))
    tokens = {s: 1 for s in PROMPTS}
    for step, rows in enumerate(SCHEDULE):
        n, buffers = len(rows), runner.inputs.buffers
        if step:  # captured on the first call
            buffers[0][n:].fill_(m.args.vocab_size - 1)
            buffers[1][n:].fill_(cache2.max_len - 1)
            for b in buffers[3:]:
                b[n:].fill_(float("nan") if b.is_floating_point() else -2**40)
        params = [Sampling(temperature=0.8, top_k=6, seed=s) for s in rows]
        t = torch.tensor([tokens[s] for s in rows], device=DEVICE)
        positions = [length[s] for s in rows]
        got = runner(t, positions=positions, slots=rows, sampling=params)
        want = draw(eager_steps(t, positions, rows), params, [p + 1 for p in positions])
        assert got.tolist() == want, f"step {step}"
        for s, token in zip(rows, want, strict=True):
            tokens[s], length[s] = token, length[s] + 1
    assert sum(runner.report()["replays"].values()) == len(SCHEDULE)


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"positions": [0], "slots": [0, 1]}, "must be 2 ints"),
    ({"positions": [99, 0], "slots": [0, 1]}, "position 99 of slot 0 is outside"),
    ({"positions": [0, 0], "slots": [1, 1]}, "repeat a request slot"),
    ({"positions": [0, 0], "slots": [0, 7]}, "request slot 7 is not one of 0..3"),
    ({"positions": [0.5, 0], "slots": [0, 1]}, "must be 2 ints"),
    ({"slots": [0, 1]}, r"runner\(tokens, positions"),
])
def test_bad_steps_are_refused_and_the_runner_stays_usable(kwargs, match):
    m, cache = setup()
    runner = graphcap.capture(m, "full", buckets=[2], inputs=DecodeInputs(cache))
    before = cache.k.clone()
    with pytest.raises(BadBatch, match=match):
        runner(torch.tensor([1, 2], device=DEVICE), **kwargs)
    assert torch.equal(cache.k, before)
    runner(torch.tensor([1, 2], device=DEVICE), positions=[0, 0], slots=[0, 1])


def test_a_step_past_the_tokens_written_is_refused():
    # It would read pages never written (or a released request's leftovers).
    m, cache = setup()
    runner = graphcap.capture(m, "full", buckets=[2], inputs=DecodeInputs(cache))
    with pytest.raises(BadBatch, match="position 3 of slot 1 skips past the 0 tokens"):
        runner(torch.tensor([1, 2], device=DEVICE), positions=[0, 3], slots=[0, 1])
    prefill(m, cache, torch.tensor([4, 5, 6], device=DEVICE), [3], [1])
    runner(torch.tensor([1, 2], device=DEVICE), positions=[0, 3], slots=[0, 1])
    assert cache.written(1) == 4 and cache.written(0) == 1


@pytest.mark.parametrize("strategy", GRAPHED)
def test_tokens_drawn_in_the_graph_follow_each_calls_sampling(strategy):
    from graphcap import Sampling
    from graphcap.inputs.sampling import draw

    m, cache = setup()
    logits_of = graphcap.capture(m, "eager", buckets=BUCKETS, inputs=DecodeInputs(cache))
    m2, cache2 = setup()
    runner = graphcap.capture(m2, strategy, buckets=BUCKETS,
                              inputs=DecodeInputs(cache2, sample=True))
    tokens, positions, slots = torch.tensor([3, 5, 7], device=DEVICE), [0, 0, 0], [0, 1, 2]
    for params in ([Sampling()] * 3,
                   [Sampling(temperature=1.0, seed=s) for s in range(3)],
                   [Sampling(temperature=0.5, top_k=4, seed=9), Sampling(),
                    Sampling(temperature=2.0, top_p=0.5, seed=1)]):
        got = runner(tokens, positions=positions, slots=slots, sampling=params)
        logits = logits_of(tokens, positions=positions, slots=slots)
        assert got.tolist() == draw(logits, params, [p + 1 for p in positions])
    report = runner.report()
    assert report["replays"] == {4: 3} and report["recaptures"] == 0


@pytest.mark.parametrize("strategy", GRAPHED)
def test_prefill_through_a_runner_fills_the_cache_as_eager_prefill_does(strategy):
    from graphcap.inputs.cache_prefill import CachePrefillInputs
    from graphcap.opsdb.attention import get_backend

    m, cache = setup()
    slots = sorted(PROMPTS)
    ids = torch.tensor(sum((PROMPTS[s] for s in slots), []), device=DEVICE)
    lens = [len(PROMPTS[s]) for s in slots]
    want = prefill(m, cache, ids, lens, slots)
    m2, cache2 = setup()
    cache2.k.fill_(float("nan"))
    cache2.v.fill_(float("nan"))
    backend = get_backend(None, DEVICE, strategy=strategy, dtype=torch.float32)
    runner = graphcap.capture(m2, strategy, buckets=[8, 16, 32],
                              inputs=CachePrefillInputs(cache2, backend, slots=4))
    positions = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    logits = runner(ids, positions, seq_lens=lens, slots=slots)
    last = torch.tensor(lens).cumsum(0) - 1
    torch.testing.assert_close(logits[last.to(DEVICE)], want, atol=1e-4, rtol=1e-4)
    assert runner.report()["replays"] == {16: 1}  # 15 tokens, one padded
    untouched = torch.ones(cache2.pages + 1, dtype=torch.bool)
    untouched[0] = False  # the null page: the pad's
    for pages in cache2.owned().values():
        untouched[pages] = False
    assert cache2.k[:, untouched].isnan().all()  # no page nobody owns was written
    for slot, n in zip(slots, lens, strict=True):  # every prompt token's K/V, as eager
        where = cache.cache_loc(torch.full((n,), slot, device=DEVICE),
                            torch.arange(n, device=DEVICE))
        for a, b in ((cache.k, cache2.k), (cache.v, cache2.v)):
            got = b.flatten(1, 2)[:, where.to(DEVICE)]
            torch.testing.assert_close(got, a.flatten(1, 2)[:, where.to(DEVICE)],
                                       atol=1e-5, rtol=1e-5)
    with pytest.raises(BadBatch, match="slots are the requests' cache slots"):
        runner(ids, positions, seq_lens=lens)


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA's sync debug mode: a CUDA device only")
@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("sample", [False, True])
def test_a_decode_step_makes_no_host_sync(strategy, sample):
    """A step's staging (host positions, slots, sampling parameters into the static
    buffers) and its replay never make the host wait for the device; CUDA's sync debug
    mode raises on any synchronising call."""
    m, cache = setup()
    slots = sorted(PROMPTS)
    ids = torch.tensor(sum((PROMPTS[s] for s in slots), []), device=DEVICE)
    prefill(m, cache, ids, [len(PROMPTS[s]) for s in slots], slots)
    runner = graphcap.capture(m, strategy, buckets=BUCKETS,
                              inputs=DecodeInputs(cache, sample=sample))
    length = {s: len(PROMPTS[s]) for s in slots}
    extra = {"sampling": [graphcap.Sampling(temperature=0.7, top_k=5, seed=s)
                          for s in slots]} if sample else {}
    tokens = torch.ones(len(slots), dtype=torch.long, device=DEVICE)
    runner(tokens, positions=[length[s] for s in slots], slots=slots, **extra)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            out = runner(tokens, positions=[length[s] + step for s in slots], slots=slots,
                         **extra)
            tokens = out if sample else out.argmax(-1)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert sum(runner.report()["replays"].values()) == 4


def test_flashinfer_decode_says_where_it_cannot_run():
    m, cache = setup()
    with pytest.raises(ValueError, match="attention='fast'"):
        DecodeInputs(cache, attention="fast")
    if DEVICE == "cpu":
        with pytest.raises(graphcap.errors.BackendUnavailable,
                           match="decode attention 'flashinfer' runs on cuda tensors"):
            DecodeInputs(cache, attention="flashinfer")


@pytest.mark.skipif(DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None,
                    reason="FlashInfer on a CUDA device")
@pytest.mark.parametrize("variant", [{}, dict(window=5, global_every=2, softcap=3.0),
                                     dict(window=5, global_every=2, sinks=True),
                                     dict(heads=7, kv_heads=1)],
                         ids=["plain", "windowed-soft-capped", "windowed-sinks", "group-7"])
@pytest.mark.parametrize("strategy", GRAPHED)
def test_flashinfer_decode_replays_the_eager_steps(strategy, variant):
    """bf16 (FlashInfer's dtypes): its plan before each replay, its kernel in the graph,
    against graphcap's own decode attention run eagerly; with alternating windowed and
    global layers and soft-capped scores, a plan per (window, softcap) pair, the windowed
    one over the pages of the window only (pages of 4 tokens, requests up to 16); with
    sinks, folded in from the kernel's log-sum-exp; with 7 query heads a key/value head,
    a group its decode kernel is not built for, on its prefill kernel."""
    def bf16():
        m, cache = setup(head_dim=64, **variant)  # a head dim FlashInfer's kernels take
        a = m.args
        cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=32,
                             page_size=4, device=DEVICE, dtype=torch.bfloat16)
        for slot, prompt in PROMPTS.items():
            cache.admit(slot, len(prompt) + len(SCHEDULE) + 1)
        return m.to(torch.bfloat16), cache

    m, cache = bf16()
    fed = []  # the eager loop's tokens, fed to both (bf16 argmax may tie differently)

    def feeding(tokens, positions, rows):
        fed.append(tokens)
        return decode_step(m, cache, tokens, torch.tensor(positions, device=DEVICE), rows)

    want = run(feeding, m, cache)
    m2, cache2 = bf16()
    cache2.k.fill_(float("nan"))
    cache2.v.fill_(float("nan"))
    runner = graphcap.capture(m2, strategy, buckets=BUCKETS,
                              inputs=DecodeInputs(cache2, attention="flashinfer"))
    steps = iter(fed)
    got = run(lambda t, p, s: runner(next(steps), positions=p, slots=s), m2, cache2)
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g.float(), w.float(), atol=0.05, rtol=0.05,
                                   msg=f"step {step}")
    assert sum(runner.report()["replays"].values()) == len(SCHEDULE)


def flashinfer_runner(lens: dict[int, int]):
    """A bf16 model's decode runner on FlashInfer (batches of 2), the requests of ``lens``
    (slot -> tokens) prefilled, pages of 16 tokens."""
    m, _ = setup(head_dim=64)
    m, a = m.to(torch.bfloat16), m.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=1024,
                         page_size=16, device=DEVICE, dtype=torch.bfloat16)
    for slot, n in lens.items():
        cache.admit(slot, n + 1)
    ids = torch.randint(0, a.vocab_size, (sum(lens.values()),), device=DEVICE)
    prefill(m, cache, ids, list(lens.values()), list(lens))
    return graphcap.capture(m, "full", buckets=[2],
                            inputs=DecodeInputs(cache, attention="flashinfer"))


@pytest.mark.skipif(DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None,
                    reason="FlashInfer on a CUDA device")
def test_flashinfer_decode_calls_queued_back_to_back_each_read_their_own_plan():
    """Two calls of one shape queued with no wait between them, the GPU held busy: the
    second's plan (FlashInfer's schedule, copied from one pinned host workspace) does not
    reach the first's replay. Long requests, then short ones (their schedules differ)."""
    lens = {0: 700, 1: 650, 2: 9, 3: 14}
    runner = flashinfer_runner(lens)
    tokens = torch.tensor([1, 2], device=DEVICE)

    def step(slots):  # the same token at the same position: the same K/V written again
        return runner(tokens, positions=[lens[s] for s in slots], slots=slots).clone()

    want = {0: step([0, 1]), 2: step([2, 3])}
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # the GPU busy while both calls plan and queue
    got = {0: step([0, 1]), 2: step([2, 3])}
    torch.cuda.synchronize()
    for first in want:
        assert torch.equal(got[first], want[first]), f"slots from {first}"


@pytest.mark.skipif(DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None,
                    reason="FlashInfer on a CUDA device")
def test_a_flashinfer_decode_step_is_planned_and_queued_while_the_gpu_is_busy():
    """A step's plan waits for no step queued before it (only for the previous plan's
    copies): the host plans and queues the call while the GPU still runs earlier work."""
    lens = {0: 700, 1: 650}
    runner = flashinfer_runner(lens)
    tokens = torch.tensor([1, 2], device=DEVICE)
    runner(tokens, positions=[700, 650], slots=[0, 1])  # captures
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time
    busy = torch.cuda.Event()
    busy.record()
    runner(tokens, positions=[700, 650], slots=[0, 1])
    assert not busy.query(), "the step's plan waited for the GPU's earlier work"
    torch.cuda.synchronize()
    assert sum(runner.report()["replays"].values()) == 2
