"""``torch.compile(model, backend="sgl_piecewise")`` as the model changes under it: weights
reassigned or given new memory, buffers moved once, twice or on every call, Python numbers
the pieces read that change (``dynamic=True`` too): each captured again or run eagerly as
eager gives, the old memory never written."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from graphcap.piecewise import PiecewiseCompiler, counters
from tests.support.runner_helpers import DEVICE
from tests.support.trust_piecewise import Net, compiled, ids, net, warm
from tests.support.trust_piecewise import calls_beside_eager as _calls

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def test_a_reassigned_weight_is_recaptured_and_the_old_one_never_written():
    m = net()
    c = compiled(m)
    with torch.no_grad():
        warm(c)
        before = counters()
        old = m.lin.weight
        kept = old.detach().clone()
        m.lin.weight = nn.Parameter(torch.randn_like(old))  # same guards: no recompile
        torch.testing.assert_close(c(ids(4, 9)), m(ids(4, 9)))
    assert torch.equal(old, kept)
    assert counters()["recaptures"] - before["recaptures"] == 1
    assert counters()["graphs"] == before["graphs"]


def test_a_weight_given_new_storage_in_place_is_recaptured():
    m = net()
    c = compiled(m)
    with torch.no_grad():
        warm(c)
        before = counters()
        m.lin.weight.data = torch.randn_like(m.lin.weight)  # the same Parameter, new memory
        torch.testing.assert_close(c(ids(4, 9)), m(ids(4, 9)))
        torch.testing.assert_close(c(ids(4, 8)), m(ids(4, 8)))  # replays the new capture
    assert counters()["recaptures"] - before["recaptures"] == 1


def test_a_view_of_a_weight_across_a_split_is_never_written_when_the_weight_moves():
    """A piece passes ``w.t()`` (a view of a weight) to the piece after a split op, which
    reads it in place; once ``w.data`` is new memory, neither weight is ever written."""
    class Split(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            wt = self.w.t()
            out = torch.empty_like(x)
            torch.ops.graphcap_trust.split_b(x @ wt, out)
            return out @ wt

    torch.manual_seed(0)
    m = Split().to(DEVICE)
    a, b = m.w.data.clone(), torch.randn(4, 4, device=DEVICE)
    kept = a.clone(), b.clone()
    c = torch.compile(m, backend=PiecewiseCompiler(
        {"capture_sizes": [8], "split_ops": ["graphcap_trust::split_b"]}))
    with torch.no_grad():
        for seed, w in enumerate([a, a, a, b, b, a, b]):
            m.w.data = w
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
            torch.testing.assert_close(c(x), m(x))
            assert torch.equal(a, kept[0]) and torch.equal(b, kept[1]), seed


class Tabled(nn.Module):
    """A table held as a buffer (a rotary cos/sin table), read whole by the piece after a
    split op, as graphcap's decoders hand theirs to each layer's attention."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("table", torch.randn(64, 4), persistent=False)

    def forward(self, x, pos):
        out = torch.empty_like(x)
        torch.ops.graphcap_trust.split_b(self.lin(x), out)
        return out + self.table[pos]


def test_a_buffer_is_read_in_place_and_a_reassigned_one_recaptured_never_written():
    # A copy per piece and capture size (refreshed every replay) would cost Qwen3-0.6B's
    # rotary table (40960 positions, 21 MB) 28 layers x 42 sizes of memory: a buffer is
    # read where it is, as a weight is.
    torch.manual_seed(0)
    m = Tabled().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler(
        {"capture_sizes": [8], "split_ops": ["graphcap_trust::split_b"]}), fullgraph=True)
    pos = torch.arange(8, device=DEVICE) * 3
    with torch.no_grad():
        for seed in range(3):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
            torch.testing.assert_close(c(x, pos), m(x, pos))
        before, old = counters(), m.table
        kept = old.clone()
        m.table = torch.randn(64, 4, device=DEVICE)  # a new table: no recompile
        for seed in range(2):
            torch.testing.assert_close(c(x + seed, pos), m(x + seed, pos))
    assert torch.equal(old, kept)
    assert counters()["recaptures"] - before["recaptures"] == 1  # read in place, not copied
    assert counters()["graphs"] == before["graphs"]


class Decays(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("state", torch.zeros(4, 3))

    def forward(self, x):
        out = torch.empty_like(x)
        torch.ops.graphcap_trust.split_b(self.lin(x), out)
        self.state = self.state * 0.5 + out  # a new tensor every call
        return self.state + 1


@pytest.mark.parametrize("copy_outputs", [True, False])
def test_a_buffer_the_forward_reassigns_every_call_is_copied_after_moving_twice(copy_outputs):
    changes = _calls(Decays, lambda m, k: (torch.full((4, 3), k + 1.0, device=DEVICE),),
                     calls=7, copy_outputs=copy_outputs)
    assert sum(c.get("recaptures", 0) for c in changes) == 2
    assert all(not c for c in changes[-3:])  # replays from then on


def test_one_move_of_a_buffer_is_one_move_at_every_capture_size():
    # Each size sees the move: counted once, the table stays read in place at every size
    # (each captured again), and only a second move makes it a copy.
    torch.manual_seed(0)
    m = Tabled().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler(
        {"capture_sizes": [2, 4, 8], "split_ops": ["graphcap_trust::split_b"]}),
        fullgraph=True, dynamic=True)  # one graph, its pieces captured at each size

    def round_of_calls():
        before = counters()["recaptures"]
        for n in (2, 4, 8):
            for seed in range(3):
                x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
                pos = torch.arange(n, device=DEVICE) * 2
                torch.testing.assert_close(c(x, pos), m(x, pos))
        return counters()["recaptures"] - before

    with torch.no_grad():
        assert round_of_calls() == 0
        m.table = torch.randn(64, 4, device=DEVICE)
        assert round_of_calls() == 3  # every size, in place
        m.table = torch.randn(64, 4, device=DEVICE)
        assert round_of_calls() == 3  # the second move: every size, a copy from now on
        m.table = torch.randn(64, 4, device=DEVICE)
        assert round_of_calls() == 0


def test_dynamic_shapes_with_float_attributes_capture_and_see_a_changed_float():
    m = net()
    c = compiled(m, dynamic=True)
    with torch.no_grad():
        for n, seed in ((4, 0), (4, 1), (4, 2), (8, 3), (8, 4), (8, 5), (5, 6)):
            torch.testing.assert_close(c(ids(n, seed)), m(ids(n, seed)))
        m.scale = 3.0
        torch.testing.assert_close(c(ids(4, 7)), m(ids(4, 7)))


class Weighted(Net):
    """Reads a float attribute (``self.scale``) and a number it is given (``k``)."""

    def forward(self, ids, k):
        return super().forward(ids) * k


def _host_calls(c, m, how: str, values, calls: int = 3) -> list[Counter]:
    """Per value of the attribute or argument ``how``, the counters ``calls`` calls moved,
    each call checked against eager."""
    moved = []
    with torch.no_grad():
        for n, value in enumerate(values):
            if how == "attribute":
                m.scale = value
            k = value if how != "attribute" else 2.0
            before = counters()
            for seed in range(calls):
                x = ids(4, 10 * n + seed)
                torch.testing.assert_close(c(x, k), m(x, k))
            moved.append(counters() - before)
    return moved


@pytest.mark.parametrize("how", ["attribute", "float-argument", "int-argument"])
def test_a_changed_host_value_gets_graphs_again_not_eager_runs_from_then_on(how):
    # Dynamo guards on a Python number once and then passes it in (automatic dynamic):
    # a piece that baked the old value captures the new one once, as for a moved weight.
    torch.manual_seed(0)
    m = Weighted().to(DEVICE)
    c = compiled(m)
    values = [1, 2, 3, 4, 5] if how == "int-argument" else [0.5, 2.0, 3.0, 4.0, 5.0]
    moved = _host_calls(c, m, how, values)
    assert all(not step.get("eager_runs") for step in moved), moved
    assert moved[-1].get("recaptures"), moved  # a value no recompile saw: captured again


def test_a_host_value_that_changes_on_every_call_runs_eagerly_naming_it(caplog):
    torch.manual_seed(0)
    m = Weighted().to(DEVICE)
    c = compiled(m)
    with caplog.at_level("WARNING", logger="graphcap"):
        moved = _host_calls(c, m, "float-argument", [0.5 + i for i in range(16)], calls=1)
    assert moved[-1].get("eager_runs") == 1 and not moved[-1].get("captures"), moved
    told = [r.getMessage() for r in caplog.records if "host value k " in r.getMessage()]
    assert told and "tensor" in told[0], caplog.text
    settled = _host_calls(c, m, "float-argument", [15.5], calls=3)[0]  # the last one again
    assert not settled.get("eager_runs") and settled["recaptures"] == 1, settled


def test_host_values_that_take_turns_past_the_changes_run_eagerly_not_captured_again():
    # Two kinds of call passing two values in turn, one of them captured: the other came
    # before, but never on two calls in a row, so its capture would be replaced by the
    # next call's (a capture every few calls, without end); it runs eagerly instead.
    torch.manual_seed(0)
    m = Weighted().to(DEVICE)
    c = compiled(m)
    _host_calls(c, m, "float-argument", [0.5 + i for i in range(16)], calls=1)
    settled = _host_calls(c, m, "float-argument", [2.25], calls=3)[0]  # captured once
    assert settled["recaptures"] == 1, settled
    turns = _host_calls(c, m, "float-argument", [1.25, 2.25] * 8, calls=1)
    assert not any(step.get("captures") for step in turns), turns
    assert [bool(step.get("eager_runs")) for step in turns] == [True, False] * 8, turns
