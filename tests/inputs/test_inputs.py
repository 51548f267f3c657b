"""The inputs seam: what a kind of input needs of a runner lives in one object, so a kind of
its own runs under every strategy without a line of the runner changed; and options that
do not apply to a strategy or a kind of input are errors, not ignored."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.core.checks import as_int
from graphcap.core.inputs import Batch, Inputs
from graphcap.errors import BadBatch, UnsupportedStrategy
from graphcap.models import MLP
from tests.support.runner_helpers import DEVICE, model

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


class Masked(Inputs):
    """A toy third kind: ``runner(x, valid=n)``, the model given ``x`` and the mask of its
    first ``n`` rows, the count staged on the device so one graph serves every ``n``."""

    kind = "masked"

    def __init__(self, device, width: int):
        super().__init__(device)
        self.width = width

    def check(self, args, kwargs):
        if len(args) != 1 or set(kwargs) != {"valid"}:
            raise BadBatch("call runner(x, valid=n)")
        (x,) = args
        valid = as_int(kwargs["valid"], "valid", BadBatch)
        if not 0 <= valid <= x.shape[0]:
            raise BadBatch(f"valid={valid} outside [0, {x.shape[0]}]")
        return Batch((x,), x.shape[0], [valid])

    def allocate(self, max_tokens, batch):
        self.buffers = [torch.zeros(max_tokens, self.width, device=self.device)]
        self.count = torch.zeros((), dtype=torch.long, device=self.device)
        self.rows_ = torch.arange(max_tokens, device=self.device)

    def forward(self, model, bucket, state):
        return model(self.buffers[0][:bucket], self.rows_[:bucket] < self.count)

    def stage(self, batch, bucket, state):
        self.copy_in(batch, bucket)
        self.count.fill_(batch.lens[0])

    def eager(self, model, batch):
        (x,) = batch.args
        mask = torch.arange(x.shape[0], device=x.device) < batch.lens[0]
        return lambda: model(x, mask)


class MaskedSum(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.lin(x) * mask[:, None]


@pytest.mark.parametrize("strategy", ("eager", *GRAPHED))
def test_a_kind_of_input_of_ones_own_runs_under_every_strategy(strategy):
    torch.manual_seed(0)
    m = MaskedSum().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8], inputs=Masked(torch.device(DEVICE), 8))
    for n, valid in ((3, 2), (8, 8), (5, 0), (6, 4), (12, 7)):
        x = torch.randn(n, 8, device=DEVICE)
        with torch.no_grad():
            want = m(x, torch.arange(n, device=DEVICE) < valid)
        torch.testing.assert_close(r(x, valid=valid), want)
    with pytest.raises(BadBatch, match="valid=9"):
        r(torch.randn(4, 8, device=DEVICE), valid=9)
    if strategy != "eager":
        assert r.report()["replays"] and r.report()["fallbacks"] == {"too_many_tokens": 1}
    if strategy == "tc_piecewise":  # its forward makes the mask anew: captured whole still
        assert r.report()["segments"] == {4: 1, 8: 1}


@pytest.mark.parametrize("strategy, kwargs, needle", [
    ("full", {"compiler": "inductor"}, "compiler= is an option of strategy 'tc_piecewise'"),
    ("full", {"debug": True}, "debug= is an option of strategy 'breakable'"),
    ("breakable", {"example_inputs": (torch.zeros(4, 8),)}, "example_inputs="),
])
def test_an_option_a_prefill_capture_does_not_take_is_an_error(strategy, kwargs, needle):
    with pytest.raises(UnsupportedStrategy, match=needle):
        graphcap.capture(model(), strategy, buckets=[8], **kwargs)


@pytest.mark.parametrize("kwargs, needle", [
    ({"attention": "torch_masked"}, "attention= is an option of inputs 'prefill'"),
    ({"max_requests": 2}, "max_requests="), ({"check_inputs": True}, "check_inputs=")])
def test_an_option_of_prefill_models_given_for_a_model_of_tensors_is_an_error(kwargs, needle):
    with pytest.raises(UnsupportedStrategy, match=needle):
        graphcap.capture(MLP(), "full", buckets=[8], **kwargs)


def test_a_progress_bar_for_a_capture_made_at_the_first_call_is_refused_not_dropped():
    with pytest.raises(UnsupportedStrategy, match="example_inputs"):
        graphcap.capture(MLP(), "full", buckets=[8], progress=True)
    shown = []
    graphcap.capture(MLP(), "full", buckets=[4, 8], example_inputs=(torch.zeros(4, 64),),
                     progress=lambda done, total: shown.append((done, total)))
    assert shown == [(1, 2), (2, 2)]


def test_options_an_inputs_object_carries_are_refused_beside_it():
    inputs = Masked(torch.device(DEVICE), 8)
    for kwargs in ({"max_requests": 8}, {"attention": "torch_varlen"}, {"check_inputs": True}):
        with pytest.raises(UnsupportedStrategy, match="inputs object"):
            graphcap.capture(MaskedSum(), "full", buckets=[4], inputs=inputs, **kwargs)


@pytest.mark.parametrize("slots", [0, -1, 2.5, True])
def test_prefill_into_the_cache_needs_a_positive_count_of_request_slots(slots):
    from graphcap.inputs import CachePrefillInputs
    from graphcap.kv import PagedKVCache
    from graphcap.opsdb.attention import get_backend

    cache = PagedKVCache(1, 2, 16, max_requests=2, max_len=16)
    with pytest.raises(ValueError, match="slots must be a positive int"):
        CachePrefillInputs(cache, get_backend(None, torch.device("cpu")), slots=slots)


class NoTensors(torch.nn.Module):
    def forward(self, x):
        return x * 2


def test_a_model_of_no_tensors_runs_where_its_example_inputs_are():
    example = torch.ones(4, 2, device="meta")
    runner = graphcap.capture(NoTensors(), "eager", buckets=[4], example_inputs=(example,))
    assert runner.device == torch.device("meta")
    runner = graphcap.capture(NoTensors(), "breakable", buckets=[4])  # no example: guessed
    with pytest.raises(BadBatch, match="no parameters or buffers to say where it runs, "
                                       "so its runner captures on cpu: give .*example_inputs"):
        runner(example)
    assert runner(torch.ones(4, 2)).sum().item() == 16  # still usable
