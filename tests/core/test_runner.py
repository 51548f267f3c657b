"""The runner's contract: bad calls are rejected before any replay and leave it usable;
host syncs fail capture with advice; eager breaks; debug mode; outputs and reports."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import graphcap
from graphcap.core.checks import BadBatch
from graphcap.errors import CaptureError, ReplayError, UnsupportedStrategy
from graphcap.models import MLP
from tests.support.runner_helpers import batch, eager, model, runner

STRATEGY, ATTN = "full", "torch_masked"


def good_call(r):
    lens = [5, 3]
    ids, pos = batch(lens)
    torch.testing.assert_close(r(ids, pos, seq_lens=lens), eager(ATTN, ids, pos, lens))


BAD = {
    "float ids": (lambda ids, pos: (ids.float(), pos, [5, 3]), "dtype"),
    "ids on another device": (lambda ids, pos: (ids.to("meta"), pos, [5, 3]), "meta"),
    "empty batch": (lambda ids, pos: (ids[:0], pos[:0], [0]), "empty"),
    "sparse ids": (lambda ids, pos: (ids.to_sparse(), pos, [5, 3]), "sparse_coo.*to_dense"),
    "lengths do not sum": (lambda ids, pos: (ids, pos, [5, 2]), "sum to 7 but there are 8"),
    "negative length": (lambda ids, pos: (ids, pos, [9, -1]), "non-negative"),
    "no seq_lens": (lambda ids, pos: (ids, pos, None), "seq_lens"),
    "lengths on the device": (lambda ids, pos: (ids, pos, torch.tensor([5, 3]).to("meta")),
                              "host"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_calls_are_rejected_before_any_replay_and_the_runner_stays_usable(case):
    r = runner(STRATEGY, ATTN)
    make, needle = BAD[case]
    replays = dict(r.stats.replays)
    ids, pos = batch([5, 3])
    a, b, lens = make(ids, pos)
    with pytest.raises(BadBatch, match=needle):
        r(a, b, seq_lens=lens)
    assert dict(r.stats.replays) == replays
    good_call(r)


def test_too_many_tokens_without_fallback_is_an_error_naming_the_limits():
    r = graphcap.capture(model(), STRATEGY, buckets=[8, 16], max_requests=2,
                         attention=ATTN, fallback=False)
    ids, pos = batch([20])
    with pytest.raises(BadBatch, match="too many tokens.*16 tokens"):
        r(ids, pos, seq_lens=[20])
    ids, pos = batch([6])
    torch.testing.assert_close(r(ids, pos, seq_lens=[6]), eager(ATTN, ids, pos, [6]))


def test_the_first_fallback_of_each_reason_is_told_once_with_its_fix(caplog):
    r = graphcap.capture(model(), STRATEGY, buckets=[8, 16], max_requests=1, attention=ATTN)
    calls = [[20], [20], [3, 2], [30], [3, 2]]  # too many tokens twice, too many requests
    with caplog.at_level("WARNING", logger="graphcap"):
        for lens in calls:
            ids, pos = batch(lens)
            torch.testing.assert_close(r(ids, pos, seq_lens=lens), eager(ATTN, ids, pos, lens))
    told = [rec.getMessage() for rec in caplog.records if "ran eagerly" in rec.getMessage()]
    assert len(told) == 2, told
    assert "too many tokens: buckets up to 16 tokens" in told[0] and "max_tokens" in told[0]
    assert "too many requests" in told[1] and "max_requests" in told[1]
    assert r.report()["fallbacks"] == {"too_many_tokens": 3, "too_many_requests": 2}


def test_outputs_are_fresh_tensors_unless_zero_copy_is_asked_for():
    ids, pos = batch([6])
    first = runner(STRATEGY, ATTN)(ids, pos, seq_lens=[6])
    kept = first.clone()
    ids2, pos2 = batch([6], seed=1)
    runner(STRATEGY, ATTN)(ids2, pos2, seq_lens=[6])
    assert torch.equal(first, kept)
    # As the model's own outputs: ordinary (not inference) tensors, usable with autograd.
    assert not torch.is_inference(first) and first.is_contiguous()
    assert first.shape == eager(ATTN, ids, pos, [6]).shape
    assert first.untyped_storage().nbytes() == first.numel() * first.element_size()

    r = graphcap.capture(model(), STRATEGY, buckets=[8], max_requests=1, attention=ATTN,
                         copy_outputs=False)
    view = r(ids, pos, seq_lens=[6])
    r(ids2, pos2, seq_lens=[6])
    assert not torch.equal(view, kept)  # overwritten by the next call, as documented


def test_report_lists_shapes_segments_memory_and_build_time():
    rep = runner("breakable", "torch_varlen").report()
    assert rep["strategy"] == "breakable" and rep["shapes"] == [4, 8, 16, 32, 64]
    assert rep["debug"] is False
    layers = model().args.layers
    assert rep["breaks"][64] == layers  # attention on host lengths: one eager break a layer
    assert rep["segments"][64] == layers + 1 and rep["splits_in_graph"][64] == 0
    assert rep["graph_pool_bytes"] > 0 and rep["build_s"]["capture"] > 0


def test_a_breakable_forward_whose_breaks_all_have_static_metadata_is_one_graph_per_shape():
    # torch_masked runs on the runner's prepared metadata (static buffers): attention is
    # captured inside the graph, so nothing breaks it.
    r = graphcap.capture(model(), "breakable", buckets=[8, 16], max_requests=4,
                         attention="torch_masked")
    layers = model().args.layers
    rep = r.report()
    assert rep["segments"] == {8: 1, 16: 1} and rep["breaks"] == {8: 0, 16: 0}
    assert rep["splits_in_graph"] == {8: layers, 16: layers}
    for lens in ([5, 7], [16], [3, 0, 2]):
        ids, pos = batch(lens)
        torch.testing.assert_close(r(ids, pos, seq_lens=lens),
                                   eager("torch_masked", ids, pos, lens), atol=1e-5, rtol=1e-5)
    assert sum(r.stats.replays.values()) == 3


def test_an_eager_on_graph_function_still_breaks_a_forward_whose_attention_is_in_graph():
    class Marked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = model()
            self.double = graphcap.eager_on_graph(lambda h: (h.cpu() * 2).to(h.device))

        def forward(self, input_ids, positions):
            return self.double(self.decoder(input_ids, positions))

    r = graphcap.capture(Marked(), "breakable", buckets=[8], max_requests=2,
                         attention="torch_masked")
    rep = r.report()
    assert (rep["segments"][8], rep["breaks"][8]) == (2, 1)
    assert rep["splits_in_graph"][8] == model().args.layers
    ids, pos = batch([5, 3])
    torch.testing.assert_close(r(ids, pos, seq_lens=[5, 3]),
                               eager("torch_masked", ids, pos, [5, 3]) * 2,
                               atol=1e-5, rtol=1e-5)


class Syncing(torch.nn.Module):
    def __init__(self, marked: bool):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.scale = graphcap.eager_on_graph(self._scale) if marked else self._scale

    @staticmethod
    def _scale(h):
        # A host round trip (a sync under capture); each row stays its own.
        return (h.cpu() * 2.0).to(h.device)

    def forward(self, x):
        return self.lin(self.scale(self.lin(x)))


def test_a_host_sync_in_an_unmarked_function_fails_capture_suggesting_eager_on_graph():
    m = Syncing(marked=False)
    x = torch.randn(8, 8)
    with pytest.raises(CaptureError, match="eager_on_graph") as info:
        graphcap.capture(m, "breakable", buckets=[8], example_inputs=(x,))
    assert "cpu" in str(info.value)
    with torch.no_grad():
        assert m(x).shape == (8, 8)  # the model still runs eagerly


def test_a_function_marked_eager_on_graph_runs_as_a_break_on_every_replay():
    m = Syncing(marked=True)
    r = graphcap.capture(m, "breakable", buckets=[4, 8])
    for seed in range(3):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            torch.testing.assert_close(r(x), m(x))
    assert r.report()["breaks"] == {4: 1, 8: 1}


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_debug_mode_runs_the_whole_forward_as_one_eager_break(how, environ):
    if how == "environment":
        environ.set("GRAPHCAP_DEBUG_CUDA_GRAPH", "1")
    r = graphcap.capture(model(), "breakable", buckets=[8, 16], max_requests=2,
                         attention=ATTN, debug=how == "argument")
    rep = r.report()
    assert rep["strategy"] == "breakable" and rep["debug"] is True
    assert rep["segments"] == {8: 0, 16: 0} and rep["breaks"] == {8: 1, 16: 1}
    ids, pos = batch([7, 5])
    torch.testing.assert_close(r(ids, pos, seq_lens=[7, 5]), eager(ATTN, ids, pos, [7, 5]))


def test_a_generic_model_is_captured_on_its_first_call_and_padded_rows_stay_out():
    torch.manual_seed(0)
    mlp = MLP()
    r = graphcap.capture(mlp, "full", buckets=[4, 8, 16])
    for n in (3, 8, 13, 16, 20):
        x = torch.randn(n, 64)
        with torch.no_grad():
            torch.testing.assert_close(r(x), mlp(x))
    assert r.stats.fallbacks["too_many_tokens"] == 1
    # The host's work per replayed call: visible, and only replays are counted in it.
    assert r.report()["host_us_per_replay"] > 0 and sum(r.stats.replays.values()) == 4
    with pytest.raises(BadBatch, match="shape"):
        r(torch.randn(4, 32))


def test_a_replays_host_time_leaves_out_the_capture_before_it(monkeypatch):
    # A clock that moves a second a reading, and a thousand through each capture: the
    # first call captures, then replays; its replay time counts the readings only.
    import types

    from graphcap.core import runner as runner_module

    clock = [0.0]

    def tick():
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(perf_counter=tick))
    r = graphcap.capture(MLP(), "full", buckets=[4])
    capture_all = r._capture_all

    def slow_capture(*args):
        clock[0] += 1000.0
        return capture_all(*args)

    monkeypatch.setattr(r, "_capture_all", slow_capture)
    with torch.no_grad():
        r(torch.randn(4, 64))
    assert sum(r.stats.replays.values()) == 1 and r.stats.replay_host_s < 1000


def test_unknown_strategies_and_backends_are_named_in_the_error():
    with pytest.raises(UnsupportedStrategy, match="choose one of"):
        graphcap.capture(model(), "cudagraph")
    with pytest.raises(UnsupportedStrategy, match="torch_varlen.*full"):
        graphcap.capture(model(), "full", buckets=[8], attention="torch_varlen")


def test_a_break_holds_its_arguments_and_output_strongly():
    # Weak references here gave silent wrong output once later captures reused the
    # memory (the field's breakable bug); strong ones keep every break input alive.
    from graphcap.breakable import BreakableCapture
    from graphcap.breakable.graph import Break
    from graphcap.core import new_pool

    double = graphcap.eager_on_graph(lambda h: h * 2)
    x = torch.randn(4)
    bcg = BreakableCapture(new_pool("cpu"))
    bcg.run(lambda: double(x + 1) - 1)
    (brk,) = [i for i in bcg.items if isinstance(i, Break)]
    assert all(type(a) is torch.Tensor for a in brk.args) and type(brk.output) is torch.Tensor


def test_a_break_that_returns_a_host_value_is_refused_at_capture():
    peak = graphcap.eager_on_graph(lambda h: float(h.abs().max()))

    class Normalised(torch.nn.Module):
        def forward(self, x):
            return x / peak(x)

    with pytest.raises(CaptureError, match="returned a host value"):
        graphcap.capture(Normalised(), "breakable", buckets=[4],
                         example_inputs=(torch.randn(4, 2),))


@pytest.mark.parametrize("returns", ["its argument", "a view of it", "a new tensor"])
def test_a_break_returning_its_argument_keeps_eagers_aliasing_on_every_replay(returns):
    # A result on an argument's memory is that memory, not graphcap's copy: a write
    # through it reaches the argument (and the other way round), as eagerly.
    head = graphcap.eager_on_graph(
        lambda h: h if returns == "its argument" else h[:, :1] if returns == "a view of it"
        else h[:, :1].clone())

    class WritesThrough(torch.nn.Module):
        def forward(self, x):
            y = x * 2
            head(y).mul_(10)
            return y + 1

    m = WritesThrough()
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(torch.randn(4, 2),))
    for seed in range(3):
        x = torch.randn(4, 2, generator=torch.Generator().manual_seed(seed))
        torch.testing.assert_close(r(x), m(x))


def test_a_break_returning_another_view_at_replay_than_at_capture_is_an_error():
    other = [False]

    @graphcap.eager_on_graph
    def head(h):
        return h[:, 1:] if other[0] else h[:, :1]

    class Model(torch.nn.Module):
        def forward(self, x):
            return head(x * 2) + 1

    r = graphcap.capture(Model(), "breakable", buckets=[4], example_inputs=(torch.randn(4, 2),))
    other[0] = True  # the same shape, another view
    with pytest.raises(ReplayError, match="returned a view of its arguments at capture"):
        r(torch.randn(4, 2))


def test_a_break_whose_results_shared_memory_at_capture_but_not_at_replay_is_an_error():
    apart = [False]

    @graphcap.eager_on_graph
    def twice(h):
        y = h * 2
        if apart[0] == "views":
            return y, y.t()
        return (y, -y) if apart[0] else (y, y)

    class Model(torch.nn.Module):
        def forward(self, x):
            a, b = twice(x + 0)
            return a + 10 * b

    m = Model()
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(torch.randn(4, 2),))
    x = torch.randn(4, 2)
    torch.testing.assert_close(r(x), m(x))
    apart[0] = True  # the same shapes, two tensors: one buffer cannot hold both
    with pytest.raises(ReplayError, match="on one memory at capture.*apart or as other"):
        r(x)

    apart[0] = False  # captured as (y, y); then (y, y.t()): the same memory, other views
    square = graphcap.capture(m, "breakable", buckets=[2],
                              example_inputs=(torch.randn(2, 2),))
    x = torch.randn(2, 2)
    torch.testing.assert_close(square(x), m(x))
    apart[0] = "views"
    with pytest.raises(ReplayError, match="apart or as other views"):
        square(x)
    apart[0] = False
    torch.testing.assert_close(r(x), m(x))  # the runner stays usable


def test_a_runner_called_from_inside_its_own_call_refuses_and_stays_usable():
    inner = {"runner": None}

    @graphcap.eager_on_graph
    def calls_the_runner(h):
        if inner["runner"] is not None:
            inner["runner"](torch.ones(6, 8))  # would restage the outer call's inputs
        return h * 1

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.b(calls_the_runner(self.a(x))) + x

    m = Model()
    r = graphcap.capture(m, "breakable", buckets=[4, 8])
    x = torch.randn(5, 8)
    r(x)
    inner["runner"] = r
    for call in (lambda: r(x), r.recapture):
        with pytest.raises(BadBatch, match="inside a call of the same runner"):
            call()
    inner["runner"] = None
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))


@pytest.mark.parametrize("outer", ["full", "breakable"])
def test_a_runner_called_while_another_model_captures_is_refused(outer):
    inner = torch.nn.Linear(8, 8)
    inner_runner = graphcap.capture(inner, "full", buckets=[8])
    inner_runner(torch.randn(5, 8))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = torch.nn.Linear(8, 8), [inner_runner]

        def forward(self, x):  # its graph would replay the inner runner's buffers unchecked
            return self.head[0](self.lin(x)) + 1

    r = graphcap.capture(Outer(), outer, buckets=[8])
    with pytest.raises(CaptureError, match="made while a graph captures"):
        r(torch.randn(5, 8))
    x = torch.randn(5, 8)
    with torch.no_grad():
        torch.testing.assert_close(inner_runner(x), inner(x))


def test_a_breakable_capture_used_directly_runs_eagerly_under_other_metadata():
    # Without the runner: the capture itself checks the state its segments read.
    from graphcap.breakable import BreakableCapture
    from graphcap.core import new_pool
    from graphcap.core.context import forward_context

    m, backend = model(), graphcap.opsdb.attention.get_backend("torch_masked")
    ids, pos = batch([16])
    meta = backend.metadata(16, 2, ids.device).update([16])

    def forward():
        with forward_context(attention=meta):
            return m(ids, pos)

    bcg = BreakableCapture(new_pool(ids.device))
    with torch.inference_mode():
        out = bcg.run(forward)
        meta = backend.metadata(16, 2, ids.device).update([9, 7])  # another object
        with forward_context(attention=meta):  # replayed where the state is current
            assert not bcg.current()
            bcg.replay()
    torch.testing.assert_close(out, eager("torch_masked", ids, pos, [9, 7]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("conf, splits", [
    ("", True), ("garbage_collection_threshold:0.8", True),
    ("max_split_size_mb:128", False), ("expandable_segments:True", False),
    ("expandable_segments:False,roundup_power2_divisions:4", True)])
def test_pool_sizing_stands_aside_where_the_allocator_would_not_split_one_block(
        conf, splits, environ):
    from graphcap.core.graphs import _one_block_splits

    environ.set("PYTORCH_CUDA_ALLOC_CONF", conf)
    environ.unset("PYTORCH_ALLOC_CONF")
    assert _one_block_splits() is splits


def test_outputs_of_another_structure_for_another_shape_are_refused_at_capture():
    class Reordered(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            a, b = self.lin(x), -x
            return {"a": a, "b": b} if x.shape[0] > 4 else {"b": b, "a": a}

    with pytest.raises(UnsupportedStrategy, match="outputs of one structure"):
        graphcap.capture(Reordered(), "full", buckets=[4, 8],
                         example_inputs=(torch.randn(8, 4),))


def test_a_dataclass_of_outputs_is_refused_naming_the_containers_torch_looks_into():
    @dataclasses.dataclass
    class Output:
        logits: torch.Tensor

    class Wrapped(torch.nn.Module):
        def forward(self, x):
            return Output(x * 2)

    with pytest.raises(UnsupportedStrategy, match="Output is a class torch's pytree does "
                                                  "not look into.*register_dataclass"):
        graphcap.capture(Wrapped(), "full", buckets=[4], example_inputs=(torch.randn(4, 4),))
    torch.utils._pytree.register_dataclass(Output)
    r = graphcap.capture(Wrapped(), "full", buckets=[4], example_inputs=(torch.randn(4, 4),))
    x = torch.randn(3, 4)
    assert torch.equal(r(x).logits, x * 2)


def test_eager_on_graph_refuses_what_is_no_function_where_it_is_marked():
    with pytest.raises(TypeError, match="eager_on_graph marks a function, got 3"):
        graphcap.eager_on_graph(3)


class MarksAboveTheDescriptor(torch.nn.Module):
    @graphcap.eager_on_graph
    @staticmethod
    def doubled(x):
        return x * 2

    @graphcap.eager_on_graph
    @classmethod
    def tripled(cls, x):
        return x * 3

    def forward(self, x):
        return self.tripled(self.doubled(x + 1)) - 1


def test_eager_on_graph_marks_a_static_or_class_method_above_its_decorator():
    m = MarksAboveTheDescriptor()
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(torch.zeros(4, 2),))
    x = torch.randn(4, 2)
    torch.testing.assert_close(r(x), m(x))
    assert r.report()["breaks"] == {4: 2}
