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
