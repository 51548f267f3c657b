"""A step that raised counts nothing in the cache: its tokens are written only once it has
run, so no later step reads a slot nobody wrote (the K/V a released request left in its
pages). Token ids out of the vocabulary are refused before anything runs, with
``check_inputs``; positions past the model's ``max_position`` always."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.api import STRATEGIES
from graphcap.engine.eager import decode_step, prefill
from graphcap.errors import BadBatch, UnsupportedModel
from graphcap.inputs import CachePrefillInputs, DecodeInputs
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, Decoder, build_model
from graphcap.opsdb.attention import get_backend
from tests.support.runner_helpers import DEVICE, windowed_extend

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


class Interrupted(KeyboardInterrupt):
    pass


class InterruptOnce:
    """A kind of input whose next call is interrupted once staged, before its replay (a
    Ctrl-C landing there): ``arm()`` it, and the next stage raises (an eager call: before
    it runs)."""

    armed = False

    def arm(self):
        self.armed = True

    def stage(self, batch, bucket, state):
        super().stage(batch, bucket, state)
        if self.armed:  # staged, not replayed
            self.armed = False
            raise Interrupted

    def eager(self, model, batch):
        run = super().eager(model, batch)
        if not self.armed:
            return run
        self.armed = False

        def interrupted():
            raise Interrupted
        return interrupted


class InterruptedDecode(InterruptOnce, DecodeInputs):
    pass


class InterruptedPrefill(InterruptOnce, CachePrefillInputs):
    pass


def used_cache(model, leftover: list[int]) -> PagedKVCache:
    """A cache whose slot 0 held a request of ``leftover`` tokens, released: its pages
    keep that request's K/V, and the next request admitted to slot 0 gets them."""
    a = model.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=2, max_len=16,
                         page_size=4, device=DEVICE)
    cache.admit(0, len(leftover))
    prefill(model, cache, torch.tensor(leftover, device=DEVICE), [len(leftover)], [0])
    cache.release(0)
    cache.admit(0, 12)
    return cache


def tokens(*ids):
    return torch.tensor(ids, device=DEVICE)


def interrupted(model, strategy: str, cache: PagedKVCache, token: int, position: int):
    """A decode runner of ``model`` over ``cache`` whose step of ``token`` at ``position``
    of slot 0 was interrupted once staged, before its replay."""
    inputs = InterruptedDecode(cache)
    runner = graphcap.capture(model, strategy, buckets=[1, 2], inputs=inputs)
    inputs.arm()
    with pytest.raises(Interrupted):
        runner(tokens(token), positions=[position], slots=[0])
    return runner


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_decode_step_that_raised_leaves_the_next_position_unreadable(strategy):
    model = build_model("tiny", device=DEVICE)
    logits = []
    for leftover in ([7] * 12, [3] * 12):  # two previous owners of slot 0's pages
        cache = used_cache(model, leftover)
        prefill(model, cache, tokens(1, 2, 3), [3], [0])
        runner = interrupted(model, strategy, cache, 4, position=3)
        assert cache.written(0) == 3
        with pytest.raises(BadBatch, match="position 4 of slot 0 skips past the 3 tokens"):
            runner(tokens(5), positions=[4], slots=[0])
        runner(tokens(4), positions=[3], slots=[0])  # the retry writes position 3
        logits.append(runner(tokens(5), positions=[4], slots=[0]))
        assert cache.written(0) == 5
    assert torch.equal(logits[0], logits[1])  # nothing of a previous owner was read


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_prefill_that_raised_leaves_its_tokens_unwritten(strategy):
    model = build_model("tiny", device=DEVICE)
    backend = get_backend(None, torch.device(DEVICE), strategy=strategy)
    logits = []
    for leftover in ([7] * 12, [3] * 12):
        cache = used_cache(model, leftover)
        inputs = InterruptedPrefill(cache, backend, slots=2, extend=True)
        runner = graphcap.capture(model, strategy, buckets=[4, 8], inputs=inputs)
        inputs.arm()
        with pytest.raises(Interrupted):
            runner(tokens(1, 2, 3), torch.arange(3, device=DEVICE), seq_lens=[3], slots=[0])
        assert cache.written(0) == 0
        with pytest.raises(BadBatch, match="starts at 3, but its pages hold 0 tokens"):
            runner(tokens(4, 5), torch.arange(3, 5, device=DEVICE), seq_lens=[2],
                   slots=[0], starts=[3])
        runner(tokens(1, 2, 3), torch.arange(3, device=DEVICE), seq_lens=[3], slots=[0])
        logits.append(runner(tokens(4, 5), torch.arange(3, 5, device=DEVICE), seq_lens=[2],
                             slots=[0], starts=[3]))
        assert cache.written(0) == 5
    assert torch.equal(logits[0], logits[1])


class FailsAfterItsLayers:
    """A hook on the model's last block: raises while ``on`` (an error late in the
    forward, every layer's K/V written: out of memory in the LM head, say)."""

    on = False

    def __call__(self, module, args, out):
        if self.on:
            raise MemoryError("the LM head ran out of memory")


def test_a_step_that_rewrote_an_earlier_position_and_raised_leaves_the_later_ones_unread():
    # A step may rewrite a position before the written ones; one that raised after its
    # layers wrote must leave what follows that position unreadable, not count it good.
    model = build_model("tiny", device=DEVICE)
    truth = used_cache(model, [7] * 12)
    prefill(model, truth, tokens(1, 2, 3, 4, 5, 6), [6], [0])
    want = decode_step(model, truth, tokens(7), [6], [0])
    cache = used_cache(model, [7] * 12)
    prefill(model, cache, tokens(1, 2, 3, 4, 5, 6), [6], [0])
    runner = graphcap.capture(model, "eager", buckets=[1], inputs=DecodeInputs(cache))
    fails = FailsAfterItsLayers()
    handle = model.blocks[-1].register_forward_hook(fails)
    try:
        fails.on = True
        with pytest.raises(MemoryError):
            runner(tokens(99), positions=[2], slots=[0])
    finally:
        handle.remove()
    assert cache.written(0) == 2  # position 2 on may hold the failed step's K/V
    with pytest.raises(BadBatch, match="position 6 of slot 0 skips past the 2 tokens"):
        runner(tokens(7), positions=[6], slots=[0])
    for position, token in enumerate((3, 4, 5, 6), start=2):  # written again, in turn
        runner(tokens(token), positions=[position], slots=[0])
    torch.testing.assert_close(runner(tokens(7), positions=[6], slots=[0]), want)


def test_the_eager_step_that_rewrote_and_raised_leaves_the_later_positions_unread():
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    prefill(model, cache, tokens(1, 2, 3, 4, 5, 6), [6], [0])
    fails = FailsAfterItsLayers()
    fails.on = True
    handle = model.blocks[-1].register_forward_hook(fails)
    try:
        with pytest.raises(MemoryError):
            decode_step(model, cache, tokens(99), [2], [0])
    finally:
        handle.remove()
    assert cache.written(0) == 2



@pytest.mark.parametrize("strategy", ["eager", "full", "decode_step"])
def test_a_ctrl_c_anywhere_in_a_call_that_rewrote_a_position_never_counts_it_as_it_was(
        strategy):
    """A Ctrl-C at any instruction of a call's bookkeeping (the runner's, or the eager
    step's), the cache's count of what it wrote included: the cache counts the rewrite
    of position 2 (3 tokens), or keeps only the tokens before it, or, the step never
    run, all 6; never 6 over a position 2 the step rewrote (later steps would read the
    old continuation of another token)."""
    from graphcap.core.runner import Runner
    from graphcap.engine import eager
    from graphcap.inputs.paged import PagedInputs
    from tests.support.interrupts import code_of, instructions
    from tests.support.interrupts import interrupted as interrupted_at

    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    if strategy == "decode_step":
        codes = code_of(eager._run, PagedInputs.commit, PagedKVCache.wrote)

        def call():
            return decode_step(model, cache, tokens(99), [2], [0])
    else:
        codes = code_of(Runner._call, PagedInputs.commit, PagedKVCache.wrote)
        runner = graphcap.capture(model, strategy, buckets=[1], inputs=DecodeInputs(cache))

        def call():
            return runner(tokens(99), positions=[2], slots=[0])

    def written_before():
        prefill(model, cache, tokens(1, 2, 3, 4, 5, 6), [6], [0])
        return cache.k.clone()

    written_before()
    count = instructions(codes, call)
    assert count > 20
    for n in range(1, count + 1):
        k = written_before()
        _, out = interrupted_at(codes, n, call)
        assert isinstance(out, KeyboardInterrupt), (n, out)
        ran = not torch.equal(cache.k, k)
        assert cache.written(0) in ((2, 3) if ran else (2, 6)), (n, ran, cache.written(0))

def test_a_call_refused_before_it_ran_keeps_every_token():
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    cache.admit(1, 12)
    prefill(model, cache, tokens(1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6), [6, 6], [0, 1])
    runner = graphcap.capture(model, "full", buckets=[1], inputs=DecodeInputs(cache),
                              fallback=False)
    with pytest.raises(BadBatch, match="cannot replay a graph"):
        runner(tokens(9, 9), positions=[2, 6], slots=[0, 1])  # a rewrite, never run
    assert (cache.written(0), cache.written(1)) == (6, 6)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_an_interrupted_rewrite_of_an_earlier_position_keeps_only_the_tokens_before_it(
        strategy):
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    prefill(model, cache, tokens(1, 2, 3, 4, 5, 6), [6], [0])
    runner = interrupted(model, strategy, cache, 99, position=2)
    assert cache.written(0) == 2
    runner(tokens(3), positions=[2], slots=[0])  # the retry goes on from there
    assert cache.written(0) == 3


def test_an_inputs_object_serves_one_live_runner():
    model = build_model("tiny", device=DEVICE)
    cache, twin = used_cache(model, [7] * 12), used_cache(model, [7] * 12)
    for c in (cache, twin):
        prefill(model, c, tokens(1, 2, 3), [3], [0])
    inputs = DecodeInputs(cache)
    runner = graphcap.capture(model, "full", buckets=[1], inputs=inputs)
    with pytest.raises(ValueError, match="already serves a live runner"):
        graphcap.capture(model, "breakable", buckets=[1], inputs=inputs)
    torch.testing.assert_close(runner(tokens(4), positions=[3], slots=[0]),
                               decode_step(model, twin, tokens(4), [3], [0]))
    del runner
    graphcap.capture(model, "breakable", buckets=[1], inputs=inputs)  # once it is gone


@pytest.mark.skipif(DEVICE == "cuda", reason="an id past the vocabulary is a device-side "
                    "assert on CUDA, which ends the process's CUDA context")
def test_a_step_that_failed_in_the_model_counts_no_token():
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    prefill(model, cache, tokens(1, 2, 3), [3], [0])
    runner = graphcap.capture(model, "full", buckets=[1], inputs=DecodeInputs(cache))
    with pytest.raises(IndexError):  # unchecked: the embedding's own error
        runner(tokens(model.vocab_size), positions=[3], slots=[0])
    assert cache.written(0) == 3
    with pytest.raises(BadBatch, match="skips past the 3 tokens"):
        runner(tokens(5), positions=[4], slots=[0])


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("bad", ["vocab", "negative"])
def test_checked_decode_refuses_token_ids_outside_the_vocabulary_before_anything_runs(
        strategy, bad):
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    prefill(model, cache, tokens(1, 2, 3), [3], [0])
    runner = graphcap.capture(model, strategy, buckets=[1, 2],
                              inputs=DecodeInputs(cache, check_inputs=True))
    k, v = cache.k.clone(), cache.v.clone()
    token = model.vocab_size if bad == "vocab" else -1
    with pytest.raises(BadBatch, match=r"tokens range over .* outside the vocabulary"):
        runner(tokens(token), positions=[3], slots=[0])
    assert torch.equal(cache.k, k) and torch.equal(cache.v, v)
    assert cache.written(0) == 3
    twin = used_cache(model, [7] * 12)
    prefill(model, twin, tokens(1, 2, 3), [3], [0])
    want = decode_step(model, twin, tokens(4), tokens(3), [0])
    torch.testing.assert_close(runner(tokens(4), positions=[3], slots=[0]), want)  # usable


def test_the_eager_decode_step_checks_its_token_ids():
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 12)
    with pytest.raises(BadBatch, match="outside the vocabulary"):
        decode_step(model, cache, tokens(-1), tokens(0), [0])
    assert cache.written(0) == 0


def test_check_inputs_needs_the_models_vocabulary():
    class NoVocabulary(Decoder):
        vocab_size = None

    model = NoVocabulary(PRESETS["tiny"]).to(DEVICE).eval()
    cache = used_cache(build_model("tiny", device=DEVICE), [7] * 4)
    with pytest.raises(UnsupportedModel, match="vocab_size"):
        graphcap.capture(model, "full", buckets=[1],
                         inputs=DecodeInputs(cache, check_inputs=True))


def test_positions_past_the_models_max_position_are_refused():
    model = build_model("tiny", device=DEVICE)
    a = model.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1,
                         max_len=a.max_position + 8, page_size=4, device=DEVICE)
    cache.admit(0, a.max_position + 8)
    cache.wrote([(0, a.max_position)])  # as if a long prompt had been prefilled
    runner = graphcap.capture(model, "full", buckets=[1], inputs=DecodeInputs(cache))
    with pytest.raises(BadBatch, match="past the model's max_position"):
        runner(tokens(1), positions=[a.max_position], slots=[0])


class ReadsAHostValue(Decoder):
    """A decoder whose forward reads a device value on the host (a graph cannot)."""

    def forward(self, input_ids, positions, last_rows=None, seq_lens=None):
        if input_ids.sum().item() < 0:
            return None
        return super().forward(input_ids, positions, last_rows, seq_lens)


class RefusesEveryBatch(Decoder):
    def forward(self, input_ids, positions, last_rows=None, seq_lens=None):
        raise BadBatch("this model's own refusal")


@pytest.mark.parametrize("strategy", ["breakable", "full"])
def test_a_decode_capture_raises_the_models_own_errors(strategy):
    # Not "wrote no K/V to the cache ... must go through attention_half": the attention
    # is fine, the model's own line is what a graph cannot run, or what refused.
    for kind, error, match in ((ReadsAHostValue, graphcap.errors.CaptureError,
                                r"(?s)host synchronisation.*\.item|\.item.*host synchronisation"),
                               (RefusesEveryBatch, BadBatch, "this model's own refusal")):
        model = kind(PRESETS["tiny"]).to(DEVICE).eval()
        cache = used_cache(build_model("tiny", device=DEVICE), [7] * 4)
        with pytest.raises(error, match=match):
            graphcap.capture(model, strategy, buckets=[1], inputs=DecodeInputs(cache))


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_model_converted_under_a_live_decode_runner_raises_its_own_error(strategy):
    model = build_model("tiny", device=DEVICE)
    cache = used_cache(model, [7] * 4)
    prefill(model, cache, tokens(1, 2, 3), [3], [0])
    runner = graphcap.capture(model, strategy, buckets=[1], inputs=DecodeInputs(cache))
    runner(tokens(4), positions=[3], slots=[0])
    model.to(torch.float64)
    with pytest.raises(graphcap.errors.OpInputError, match="has dtype torch.float64"):
        runner(tokens(5), positions=[4], slots=[0])
    assert cache.written(0) == 4


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_prefill_attention_in_a_decode_forward_says_to_go_through_the_cache(strategy):
    model = build_model("tiny", device=DEVICE)
    for block in model.blocks:
        block.attn.layer = None  # graphcap::attention, which knows nothing of the cache
    cache = used_cache(build_model("tiny", device=DEVICE), [7] * 4)
    with pytest.raises(UnsupportedModel, match=r"graphcap::attention .* ran in a forward "
                       r"over a paged K/V cache.*attention_half"):
        runner = graphcap.capture(model, strategy, buckets=[1], inputs=DecodeInputs(cache))
        runner(tokens(1), positions=[0], slots=[0])


def test_a_ctrl_c_in_the_commit_of_a_windowed_call_that_ran_leaves_its_request_to_go_on():
    # Delivered once the commit freed pages behind the window: the call ran, and the
    # request keeps at least the tokens a step after the freed pages needs, never fewer
    # (every later step would be refused as reaching back to them, until a release).
    from graphcap.inputs.paged import PagedInputs
    from tests.support.interrupts import code_of, delivered

    _, cache, runner = windowed_extend(slots=1)
    ids, positions = torch.arange(1, 17, device=DEVICE), torch.arange(16, device=DEVICE)
    codes = code_of(PagedInputs.commit, PagedKVCache.wrote, PagedKVCache._free_behind)

    def call(start=0):
        return runner(ids[start:], positions[start:], seq_lens=[16 - start], slots=[0],
                      starts=[start])

    def again(call):
        cache.release(0)
        cache.admit(0, 30)
        return call()

    cache.admit(0, 30)
    want, count = call()[-1], delivered(codes, None, again, call)[0]
    assert cache.least_kept(0) > 0 and count > 3
    for n in range(1, count + 1):
        _, out = delivered(codes, n, again, call)
        assert isinstance(out, KeyboardInterrupt), (n, out)
        kept = cache.written(0)
        assert cache.least_kept(0) <= kept, n
        torch.testing.assert_close(call(kept)[-1], want, atol=1e-4, rtol=1e-4)


def test_a_prefill_of_more_requests_than_its_slots_without_fallback_is_told_slots():
    model = build_model("tiny", device=DEVICE)
    cache = PagedKVCache(model.args.layers, model.args.kv_heads, model.args.head_dim,
                         max_requests=3, max_len=16, device=DEVICE)
    for slot in range(3):
        cache.admit(slot, 8)
    backend = get_backend(None, DEVICE, strategy="full", dtype=torch.float32)
    runner = graphcap.capture(model, "full", buckets=[8],
                              inputs=CachePrefillInputs(cache, backend, slots=2),
                              fallback=False)
    positions = torch.tensor([0, 1, 0, 1, 0, 1], device=DEVICE)
    with pytest.raises(BadBatch, match=r"too many requests: .*2 request slots\) and "
                                       r"fallback=False; capture more request slots .*a "
                                       r"CachePrefillInputs' slots="):
        runner(tokens(1, 2, 3, 4, 5, 6), positions, seq_lens=[2, 2, 2], slots=[0, 1, 2])
    assert [cache.written(s) for s in range(3)] == [0, 0, 0]
