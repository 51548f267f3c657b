"""An op registered ``capturable=False`` and called through opsdb: an eager break under
breakable, run again at every replay; refused inside full's capture, naming the
strategies that run it, also where it is called as ``torch.ops``; and refused inside
breakable's as ``torch.ops``, which reaches no Python a break could be taken at, naming
the call that breaks (tc_piecewise splits it out by its tag:
tests/strategies/test_piecewise.py)."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.errors import CaptureError
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

CALLS = [0]  # host state the op reads and advances: no graph can hold it
NAME = "graphcap_test::count_calls"


def _count_calls(x):
    CALLS[0] += 1
    return x + CALLS[0]


if NAME not in graphcap.opsdb.REGISTRY:
    graphcap.register_op(NAME, "(Tensor x) -> Tensor", reference=_count_calls,
                         fake=lambda x: torch.empty_like(x), capturable=False)
COUNT_CALLS = graphcap.opsdb.REGISTRY[NAME]


class CountsItsCalls(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return COUNT_CALLS(self.lin(x)) * 2


class CallsItThroughTorchOps(CountsItsCalls):
    def forward(self, x):
        return torch.ops.graphcap_test.count_calls(self.lin(x)) * 2


def test_breakable_runs_an_uncapturable_op_eagerly_at_every_replay():
    torch.manual_seed(0)
    m = CountsItsCalls().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4])
    x = torch.randn(4, 4, device=DEVICE)
    r(x)  # captures
    for _ in range(3):
        before = CALLS[0]
        got = r(x)
        assert CALLS[0] == before + 1  # the op ran once in the call, as eagerly
        with torch.no_grad():  # what the call's own count gives eagerly
            want = (m.lin(x) + CALLS[0]) * 2
        torch.testing.assert_close(got, want)
    report = r.report()  # a break of its own (the emulator re-runs a captured op too)
    assert report["breaks"] == {4: 1} and sum(report["replays"].values()) == 4


@pytest.mark.parametrize("model", [CountsItsCalls, CallsItThroughTorchOps])
def test_full_refuses_an_uncapturable_op_naming_the_strategies_that_run_it(model):
    m = model().to(DEVICE)
    r = graphcap.capture(m, "full", buckets=[4])
    with pytest.raises(CaptureError, match=r"graphcap_test::count_calls is registered "
                       r"capturable=False.*strategy='breakable'.*'tc_piecewise'"):
        r(torch.randn(4, 4, device=DEVICE))


def test_breakable_refuses_an_uncapturable_op_called_as_torch_ops_naming_the_call_that_breaks():
    m = CallsItThroughTorchOps().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4])
    x = torch.randn(4, 4, device=DEVICE)
    with pytest.raises(CaptureError, match=r"graphcap_test::count_calls is registered "
                       r"capturable=False and was called as torch.ops inside a breakable "
                       r"capture.*get_op\('graphcap_test::count_calls'\).*eager_on_graph"):
        r(x)
    m.forward = CountsItsCalls.forward.__get__(m)  # through opsdb: the runner captures again
    before = CALLS[0]
    r(x)
    assert CALLS[0] > before and r.report()["breaks"] == {4: 1}
