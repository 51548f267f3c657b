"""The paths of a model of tensors and of packed requests that a replay does not take: a
fallback (a batch no graph holds) gives the model what a replay gives it, copies of the
caller's tensors, never the tensors themselves; a first call names what is wrong."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import BadBatch
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


class AddsInPlace(torch.nn.Module):
    """A forward that writes its input (a residual stream updated in place)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.add_(1.0)
        return self.lin(x)


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_forward_that_writes_its_input_never_writes_the_callers_tensor(strategy):
    torch.manual_seed(0)
    m = AddsInPlace().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8])
    for n in (8, 6, 16):  # a bucket filled, one padded, and past the buckets: a fallback
        x = torch.randn(n, 4, device=DEVICE)
        mine = x.clone()
        got = r(x)
        assert torch.equal(x, mine), f"{n} rows: the caller's tensor was written"
        with torch.no_grad():
            torch.testing.assert_close(got, m(mine.clone()))
    assert r.report()["fallbacks"] == {"too_many_tokens": 1}


def test_the_eager_strategy_runs_the_model_itself_on_the_callers_tensor():
    r = graphcap.capture(AddsInPlace().to(DEVICE), "eager", buckets=[4])
    x = torch.zeros(6, 4, device=DEVICE)
    r(x)
    assert torch.equal(x, torch.ones_like(x))  # as the model called directly would


def test_a_fallback_passes_a_strided_input_contiguous_as_a_replay_does():
    class Views(torch.nn.Module):
        def forward(self, x):
            return x.view(-1).view(x.shape) * 2  # needs a contiguous tensor

    r = graphcap.capture(Views(), "full", buckets=[4],
                         example_inputs=(torch.zeros(4, 4, device=DEVICE),))
    for n in (4, 6):  # a replay, a fallback
        x = torch.randn(4, n, device=DEVICE).t()
        torch.testing.assert_close(r(x), x * 2)


class ShiftsPositions(torch.nn.Module):
    """A prefill forward that writes its positions, and returns them (an integer row)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 4)

    def forward(self, input_ids, positions):
        positions.add_(1)
        return self.emb(input_ids) + positions[:, None], positions * 1


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_prefill_fallback_neither_writes_the_callers_ids_nor_keeps_their_int32(strategy):
    m = ShiftsPositions().to(DEVICE)
    r = graphcap.capture(m, strategy, inputs="prefill", buckets=[4, 8], max_requests=1)
    for n in (8, 6, 12):  # a bucket filled, one padded, and past the buckets: a fallback
        ids = torch.arange(n, device=DEVICE, dtype=torch.int32)
        pos = torch.arange(n, device=DEVICE, dtype=torch.int32)
        out, shifted = r(ids, pos, seq_lens=[n])
        assert torch.equal(pos, ids), f"{n} tokens: the caller's positions were written"
        assert shifted.dtype == torch.long, f"{n} tokens: {shifted.dtype}, not the buffers'"
        assert torch.equal(shifted, pos.long() + 1)
        with torch.no_grad():
            torch.testing.assert_close(out, m(ids.long(), pos.long())[0])
    assert r.report()["fallbacks"] == {"too_many_tokens": 1}


def test_a_first_call_with_an_argument_that_is_no_tensor_names_it():
    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, *rest):
            return self.lin(x)

    r = graphcap.capture(Lin().to(DEVICE), "full", buckets=[4])
    with pytest.raises(BadBatch, match="argument 1 must be a tensor, got int"):
        r(torch.randn(4, 4, device=DEVICE), 3)  # was: 'expected 1 tensor arguments, got 2'
    assert r(torch.randn(3, 4, device=DEVICE)).shape == (3, 4)  # shapes of this call


class WritesItsIds(torch.nn.Module):
    """A paged forward that notes its token ids' dtype and zeroes them once it has read
    them (a forward that reuses its input's storage)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.dtypes = inner, set()

    def forward(self, input_ids, positions, *rest, **more):
        self.dtypes.add(input_ids.dtype)
        out = self.inner(input_ids, positions, *rest, **more)
        input_ids.zero_()
        return out


PAGED_PROMPTS = {0: [5, 9, 2, 7, 1], 2: [3], 3: [8, 8, 4, 11, 6, 2, 9]}


def paged_runner(kind: str, strategy: str, buckets: list[int]):
    from graphcap.inputs import CachePrefillInputs, DecodeInputs, PagedInputs
    from graphcap.inputs.draft_steps import DraftStepsInputs
    from graphcap.opsdb.attention import get_backend
    from tests.support.runner_helpers import prefilled_tiny

    m, cache, logits = prefilled_tiny(PAGED_PROMPTS, 6)
    inputs = {"decode": lambda: DecodeInputs(cache),
              "verify": lambda: PagedInputs(cache, tokens_per_request=2),
              "extend": lambda: CachePrefillInputs(
                  cache, get_backend(None, DEVICE, strategy=strategy, dtype=torch.float32),
                  slots=3, extend=True),
              "draft": lambda: DraftStepsInputs(cache, 2)}[kind]()
    model = WritesItsIds(m)
    return model, graphcap.capture(model, strategy, buckets=buckets, inputs=inputs), cache


def paged_call(kind: str, runner, cache):
    slots = sorted(PAGED_PROMPTS)
    written = [cache.written(s) for s in slots]
    if kind == "extend":
        ids = torch.tensor([4, 6, 9, 2, 5, 7], device=DEVICE, dtype=torch.int32)
        positions = torch.tensor([w + j for w in written for j in range(2)], device=DEVICE)
        return ids, runner(ids, positions, seq_lens=[2, 2, 2], slots=slots, starts=written)
    per = 2 if kind == "verify" else 1
    ids = torch.tensor([4, 6, 9, 2, 5, 7][:per * len(slots)], device=DEVICE,
                       dtype=torch.int32)
    return ids, runner(ids, positions=written, slots=slots)


@pytest.mark.parametrize("kind", ["decode", "verify", "extend", "draft"])
def test_a_paged_fallback_neither_writes_the_callers_ids_nor_keeps_their_int32(kind):
    """A call no bucket holds gives the model int64 copies of the caller's token ids, as a
    replay gives it its buffer: the caller's stay as they were, and the outputs are a
    replay's (a replay of the same call by a runner with a larger bucket)."""
    outs = []
    for buckets in ([6], [1]):  # a replay, then the same call as a fallback
        model, runner, cache = paged_runner(kind, "full", buckets)
        model.dtypes.clear()  # the warm-up's and capture's
        ids, out = paged_call(kind, runner, cache)
        assert torch.equal(ids, torch.tensor([4, 6, 9, 2, 5, 7], dtype=torch.int32,
                                             device=DEVICE)[:ids.shape[0]]), \
            f"{buckets}: the caller's ids were written"
        assert model.dtypes <= {torch.long}, f"{buckets}: the model got {model.dtypes}"
        outs.append(out)
    assert runner.report()["fallbacks"] == {"too_many_tokens": 1}
    replayed, fallen_back = outs
    assert (fallen_back.dtype, fallen_back.shape) == (replayed.dtype, replayed.shape)
    torch.testing.assert_close(fallen_back, replayed, atol=1e-5, rtol=1e-5)
