"""A forward hook or pre-hook added or removed since capture (on the model, a submodule,
or globally) changes what eager computes, while a graph runs the hooks of its capture:
a changed model, recaptured or refused. A hook on another model changes nothing."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import ModelChanged
from tests.support.runner_helpers import DEVICE, tolerance

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def _doubled(module, args, out):
    return out * 2


def _model_and_runners(strategy):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    m = m.to(DEVICE).eval()
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4], example_inputs=(x,))
    strict = graphcap.capture(m, strategy, buckets=[4], example_inputs=(x,),
                              on_change="error")
    r(x), strict(x)
    return m, x, r, strict


def _matches_eager(r, m, x):
    with torch.inference_mode():
        want = m(x)
    atol, rtol = tolerance()
    torch.testing.assert_close(r(x), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("strategy", GRAPHED)  # tc_piecewise: compiled again with it
def test_a_hook_added_or_removed_after_capture_is_recaptured_or_refused(strategy):
    m, x, r, strict = _model_and_runners(strategy)
    handle = m[0].register_forward_hook(_doubled)
    _matches_eager(r, m, x)  # the hook's result, not the capture's
    with pytest.raises(ModelChanged, match="0 forward hooks and pre-hooks: 1"):
        strict(x)
    strict.recapture()
    handle.remove()
    _matches_eager(r, m, x)  # without it again
    with pytest.raises(ModelChanged, match="0 forward hooks and pre-hooks: 0 .1 at"):
        strict(x)
    assert r.report()["recaptures"] == 2


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_global_hook_is_a_change_and_a_hook_on_another_model_is_none(strategy):
    m, x, r, _ = _model_and_runners(strategy)
    other = torch.nn.Linear(8, 8)
    other.register_forward_pre_hook(lambda module, args: None)
    _matches_eager(r, m, x)
    assert r.report()["recaptures"] == 0
    handle = torch.nn.modules.module.register_module_forward_hook(_doubled)
    try:
        _matches_eager(r, m, x)
        assert r.report()["recaptures"] == 1
    finally:
        handle.remove()
    _matches_eager(r, m, x)
    assert r.report()["recaptures"] == 2


@pytest.mark.parametrize("strategy", ["full"])
def test_a_hook_on_the_model_itself_is_named_as_the_models(strategy):
    m, x, _, strict = _model_and_runners(strategy)
    handle = m.register_forward_pre_hook(lambda module, args: None)
    try:
        with pytest.raises(ModelChanged, match="model's own and global forward hooks and "
                                               "pre-hooks: 1 .0 at"):
            strict(x)
    finally:
        handle.remove()


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_global_hook_at_capture_runs_once_a_module_as_in_eager(strategy):
    handle = torch.nn.modules.module.register_module_forward_hook(_doubled)
    try:
        m, x, r, _ = _model_and_runners(strategy)
        _matches_eager(r, m, x)  # not on graphcap's own modules (tc_piecewise's pieces)
        assert r.report()["recaptures"] == 0
    finally:
        handle.remove()
