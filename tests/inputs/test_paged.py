"""One paged kind of input (``graphcap.inputs.PagedInputs``) for every way tokens meet the
cache: a step of ``k`` tokens per request (``1 + k`` of a verify step) gives the logits of
``k`` decode steps, under every graphed strategy; per-request models get each request's
last row, whatever path the call takes; decode attention is picked through the same
``get_backend`` as prefill's."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.engine.eager import decode_step, prefill
from graphcap.errors import BackendUnavailable, BadBatch
from graphcap.inputs import DecodeInputs, PagedInputs
from graphcap.opsdb.attention import DECODE_BACKENDS, get_backend
from tests.support.runner_helpers import DEVICE, prefilled_tiny

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = {0: [5, 9, 2, 7, 1], 2: [3], 3: [8, 8, 4, 11, 6, 2, 9]}
K = 3  # tokens per request of the step


def setup(logits="all"):
    m, cache, _ = prefilled_tiny(PROMPTS, 2 * K, logits=logits)
    return m, cache


def proposals(slots, step):
    return torch.tensor([(7 * s + 3 * j + step) % 13 + 1 for s in slots for j in range(K)],
                        device=DEVICE)


def one_at_a_time(m, cache, slots, tokens):
    """The rows of a k-token step as k eager decode steps: ``[requests * k, vocab]``."""
    rows = tokens.view(len(slots), K)
    out = []
    for j in range(K):
        positions = torch.tensor([cache.written(s) for s in slots])
        out.append(decode_step(m, cache, rows[:, j].contiguous(), positions, slots))
    return torch.stack(out, dim=1).reshape(len(slots) * K, -1)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_step_of_k_tokens_per_request_gives_the_logits_of_k_decode_steps(strategy):
    m, cache = setup()
    m2, cache2 = setup()
    runner = graphcap.capture(m2, strategy, buckets=[K, 2 * K, 4 * K],
                              inputs=PagedInputs(cache2, tokens_per_request=K))
    for step, slots in enumerate([[0, 2, 3], [3], [0, 2]]):
        tokens = proposals(slots, step)
        want = one_at_a_time(m, cache, slots, tokens)
        got = runner(tokens, positions=[cache2.written(s) for s in slots], slots=slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=f"step {step}")
        assert [cache2.written(s) for s in slots] == [cache.written(s) for s in slots]
    assert sum(runner.report()["replays"].values()) == 3


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_model_of_one_row_per_request_gets_each_requests_last_token(strategy):
    """Replayed, or eager past the largest bucket: each request's row is its last token's."""
    m, cache = setup()
    last, cache2 = setup(logits="last")
    runner = graphcap.capture(last, strategy, buckets=[K],
                              inputs=PagedInputs(cache2, tokens_per_request=K))
    for slots in ([2], [0, 2, 3]):  # one bucket: the second call runs eagerly
        tokens = proposals(slots, 0)
        want = one_at_a_time(m, cache, slots, tokens)[K - 1::K]
        got = runner(tokens, positions=[cache2.written(s) for s in slots], slots=slots)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert runner.report()["fallbacks"]


def test_decode_past_the_largest_bucket_returns_a_row_per_request():
    m, cache = setup()
    last, cache2 = setup(logits="last")
    runner = graphcap.capture(last, "full", buckets=[1, 2], inputs=DecodeInputs(cache2))
    slots = [0, 2, 3]
    tokens = torch.tensor([4, 6, 9], device=DEVICE)
    want = decode_step(m, cache, tokens, torch.tensor([cache.written(s) for s in slots]),
                       slots)
    got = runner(tokens, positions=[cache2.written(s) for s in slots], slots=slots)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("tokens", "kwargs", "match"), [
    (3, {"positions": [5], "slots": [0]}, "3 tokens are not 2 per request"),
    (2, {"positions": [5, 1], "slots": [0]}, "positions must be 1 ints"),
    (2, {"positions": [6], "slots": [0]}, "position 6 of slot 0 skips past the 5"),
    (2, {"positions": [1], "slots": [1]}, r"request slots \[1\] hold no request"),
    (4, {"positions": [1, 5], "slots": [2, 0]}, r"\(slot, end\) \[\(2, 3\)\]"),
    ("sparse", {"positions": [5], "slots": [0]}, "tokens is a sparse_coo tensor.*to_dense"),
])
def test_a_bad_step_of_k_tokens_is_refused_and_the_cache_stays(tokens, kwargs, match):
    m, cache = setup()
    cache.release(2)
    cache.admit(2, 2)  # one token of prompt and one new: a step of 2 ends past it
    prefill(m, cache, torch.tensor([3], device=DEVICE), [1], [2])
    runner = graphcap.capture(m, "full", buckets=[4],
                              inputs=PagedInputs(cache, tokens_per_request=2))
    before = cache.k.clone()
    with pytest.raises(BadBatch, match=match):
        ids = torch.arange(1, 3, device=DEVICE).to_sparse() if tokens == "sparse" else \
            torch.arange(1, tokens + 1, device=DEVICE)
        runner(ids, **kwargs)
    torch.testing.assert_close(cache.k, before, equal_nan=True, atol=0, rtol=0)
    assert (cache.written(0), cache.written(2)) == (5, 1)
    runner(torch.tensor([1, 2], device=DEVICE), positions=[5], slots=[0])
    assert cache.written(0) == 7


@pytest.mark.parametrize("accept", [None, "greedy"])
def test_sampling_given_to_a_step_that_draws_nothing_is_refused_naming_what_draws(accept):
    m, cache = setup()
    runner = graphcap.capture(m, "full", buckets=[K],
                              inputs=PagedInputs(cache, tokens_per_request=K, accept=accept))
    with pytest.raises(BadBatch, match=r"sample=True\).*accept='sampled'"):
        runner(proposals([0], 0), positions=[5], slots=[0],
               sampling=[graphcap.Sampling(temperature=0.7)])
    assert cache.written(0) == 5
    with pytest.raises(BadBatch, match=f"a step of {K} tokens per request is called as"):
        runner(proposals([0], 0), positions=[5], slot=[0])


def test_what_a_paged_kind_refuses_to_be_built_as():
    _, cache = setup()
    with pytest.raises(ValueError, match="sample=True draws one token per request"):
        PagedInputs(cache, tokens_per_request=2, sample=True)
    with pytest.raises(ValueError, match="extend=True continues requests of any length"):
        PagedInputs(cache, tokens_per_request=1, extend=True)
    with pytest.raises(ValueError, match="need the prefill attention backend"):
        PagedInputs(cache, tokens_per_request=None)
    with pytest.raises(ValueError, match="tokens_per_request must be a positive int"):
        PagedInputs(cache, tokens_per_request=0)
    with pytest.raises(ValueError, match="output_rows='request'"):  # its own, not the model's
        PagedInputs(cache, tokens_per_request=2, output_rows="request")
    with pytest.raises(ValueError, match=r"attention= and slots= shape a prefill \(tokens_"
                                         r"per_request=None\): a step of 3 tokens a request"):
        PagedInputs(cache, 3, attention="torch_varlen", slots=2)  # was ignored
    with pytest.raises(ValueError, match=r"^slots= shape a prefill .* a step of 1 token a "):
        PagedInputs(cache, 1, slots=2)


def test_decode_attention_is_picked_through_get_backend_as_prefills_is():
    _, cache = setup()
    assert get_backend(kind="decode", cache=cache).name == "graphcap"
    assert set(DECODE_BACKENDS) == {"graphcap", "flashinfer"}
    assert PagedInputs(cache).report() == {"cache": repr(cache)}
    with pytest.raises(BackendUnavailable, match=r"no decode attention backend 'fast'; "
                       r"choose one of \['flashinfer', 'graphcap'\]"):
        get_backend("fast", kind="decode", cache=cache)
    with pytest.raises(ValueError, match="needs cache="):
        get_backend(kind="decode")
    with pytest.raises(ValueError, match="'prefill' or 'decode'"):
        get_backend(kind="verify")
    if DEVICE == "cpu":
        with pytest.raises(BackendUnavailable, match="'flashinfer' runs on cuda tensors"):
            PagedInputs(cache, decode_attention="flashinfer")


def test_a_replay_derives_places_rows_and_lengths_in_one_op_as_the_eager_path_does():
    # What a decode graph recomputes on every replay is one graphcap::cache_places launch
    # (a score of small kernels before), equal to the eager path's CacheBatch.paged.
    from torch.utils._python_dispatch import TorchDispatchMode

    from graphcap.kv import CacheBatch

    m, cache = setup()
    inputs = DecodeInputs(cache)
    inputs.bind(m)
    inputs.allocate(4, None)
    state = inputs.prepare(4)
    slots = torch.tensor([2, 0, -1, 3], dtype=inputs.buffers[2].dtype, device=DEVICE)
    positions = torch.tensor([1, 5, 0, 7], dtype=inputs.buffers[1].dtype, device=DEVICE)
    inputs.buffers[2][:4].copy_(slots)
    inputs.buffers[1][:4].copy_(positions)
    ran = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ran.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode(), Ops():
        inputs.derive(state)
    assert [op for op in ran if op != "aten::slice"] == ["graphcap::cache_places"]
    want = CacheBatch.paged(cache, slots, positions)
    assert torch.equal(state.kv.cache_loc, want.cache_loc)
    assert torch.equal(state.kv.block_table, want.block_table)
    assert torch.equal(state.kv.seq_lens, want.seq_lens)
    assert state.kv.seq_lens.tolist() == [2, 6, 0, 8]  # the pad attends to nothing


def test_a_paged_kind_captured_without_buckets_takes_the_shapes_its_calls_can_fill():
    # A step holds one request a slot at most: the token ladder (4 .. 2048) captured 42
    # graphs no step of the 4 request slots could fill past 4, and ran every step of one
    # request eagerly (its 4 rows pad it past twice over); a prefill into 2 request slots
    # of 32 tokens brings 64 tokens at most.
    from graphcap.inputs import CachePrefillInputs
    from graphcap.inputs.draft_steps import DraftStepsInputs

    m, cache = setup()
    for inputs, want in ((DecodeInputs(cache), [1, 2, 3, 4]),
                         (PagedInputs(cache, K), [3, 6, 9, 12]),
                         (DraftStepsInputs(cache, 2), [1, 2, 3, 4])):
        assert graphcap.capture(m, "full", inputs=inputs).report()["shapes"] == want
    runner = graphcap.capture(m, "full", inputs=DecodeInputs(cache))
    runner(torch.tensor([4], device=DEVICE), positions=[cache.written(2)], slots=[2])
    assert runner.report()["replays"] == {1: 1} and not runner.report()["fallbacks"]
    prefill = CachePrefillInputs(cache, get_backend(None, DEVICE, strategy="full"), 2)
    assert graphcap.capture(m, "full", inputs=prefill).report()["shapes"] == [
        4, 8, 12, 16, 20, 24, 28, 32, 48, 64]
    # max_tokens given: the same ladders up to it (the token ladder captured [4] for 3,
    # and a step of one or two requests ran eagerly)
    assert graphcap.capture(m, "full", max_tokens=3, inputs=DecodeInputs(cache)
                            ).report()["shapes"] == [1, 2, 3]
    assert graphcap.capture(m, "full", max_tokens=7, inputs=PagedInputs(cache, K)
                            ).report()["shapes"] == [3, 6]
    assert graphcap.capture(m, "full", max_tokens=8, inputs=prefill
                            ).report()["shapes"] == [4, 8]
    with pytest.raises(ValueError, match=f"max_tokens=2 holds no step of {K} tokens a "
                                         f"request: give at least {K}"):
        graphcap.capture(m, "full", max_tokens=2, inputs=PagedInputs(cache, K))



def test_buckets_larger_than_any_step_fills_are_named_at_capture(caplog):
    # Each request brings K tokens from a distinct request slot: a step holds at most
    # K x max_requests tokens, and a larger bucket is captured for no call.
    m, cache = setup()
    most = K * cache.max_requests
    with caplog.at_level("WARNING", logger="graphcap"):
        runner = graphcap.capture(m, "full", buckets=[K, most, 2 * most],
                                  inputs=PagedInputs(cache, tokens_per_request=K))
        graphcap.capture(m, "full", buckets=[1, cache.max_requests],
                         inputs=DecodeInputs(cache))
    told = [r.getMessage() for r in caplog.records if "never replayed" in r.getMessage()]
    assert told == [f"graphcap: buckets [{2 * most}] are larger than any call of PagedInputs "
                    f"fills (at most {most} tokens, {cache.max_requests} request slots): "
                    "they are captured and never replayed; leave them out, or build the "
                    "cache with more max_requests"]
    assert sorted(runner.entries) == [K, most, 2 * most]
