"""A break whose results alias what it was given, or one another, on some calls only:
a replay that aliases where the capture did not is refused (eagerly a write through one
reaches the other; the graph after the break reads graphcap's copies), not silently
replayed apart. On the emulator in CI and on CUDA graphs on the GPU."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.errors import ReplayError
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


@graphcap.eager_on_graph
def unless_large(h):
    return h if h.abs().amax() > 1 else h + 2  # its argument on some calls only


class WritesThroughTheResult(torch.nn.Module):
    def forward(self, x):
        h = x * 1
        unless_large(h).add_(1)  # eagerly: h too when the result is h
        return h + 0


@graphcap.eager_on_graph
def twice_when_positive(h):
    y = h * 2
    return (y, y) if h.sum() > 0 else (y, y * 1)  # one tensor twice on some calls


class WritesThroughTheFirst(torch.nn.Module):
    def forward(self, x):
        a, b = twice_when_positive(x + 0)
        a.add_(1)  # eagerly: b too when it is a
        return b + 0


@graphcap.eager_on_graph
def cache_when_large(h, module):
    return module.cache if h.abs().amax() > 1 else h * 0  # the module's on some calls


class AccumulatesSometimes(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 2))

    def forward(self, x):
        cache_when_large(x + 0, self).add_(x)
        return self.cache * 1


@pytest.mark.parametrize("model, match", [
    (WritesThroughTheResult, "returned a new tensor at capture .result 0. and a view of "
                             "its arguments at replay"),
    (WritesThroughTheFirst, "returned results 0 and 1 apart at capture and on one memory"),
    (AccumulatesSometimes, "returned a new tensor at capture .result 0. and a view of its "
                           "arguments at replay"),
])
def test_a_break_aliasing_at_replay_where_it_did_not_at_capture_is_refused(model, match):
    m = model().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 2, device=DEVICE),))
    small = torch.full((4, 2), -0.5, device=DEVICE)  # apart, as at capture
    with torch.no_grad():
        torch.testing.assert_close(r(small), m(small))
    with pytest.raises(ReplayError, match=match):
        r(torch.full((4, 2), 5.0, device=DEVICE))
    with torch.no_grad():  # the runner stays usable
        torch.testing.assert_close(r(small), m(small))
