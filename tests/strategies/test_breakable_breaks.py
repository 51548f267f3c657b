"""What a break of the breakable strategy is given and gives back, replayed as eagerly:
its lists and dicts as they were at the call, results sharing memory sharing it again,
an exception the forward caught refused, and a marked function under torch.compile a
plain call. On the emulator in CI and on CUDA graphs on the GPU."""

from __future__ import annotations

import contextlib
import gc
import warnings

import pytest
import torch

import graphcap
from graphcap.errors import CaptureError
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


@graphcap.eager_on_graph
def newest_doubled(hidden_states):
    return hidden_states[-1] * 2


class Collects(torch.nn.Module):
    """Every layer's output in a list (output_hidden_states), a break reading the newest
    one after the first layer, then more appended."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        hidden_states, h = [x], x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            hidden_states.append(h)
            if i == 0:
                h = newest_doubled(hidden_states)
        return h


@graphcap.eager_on_graph
def doubled_and_first_column(h):
    y = h * 2
    return y, y[:, :1]  # a new tensor and a view of it


class WritesThroughTheView(torch.nn.Module):
    def forward(self, x):
        y, first = doubled_and_first_column(x + 0)
        first.mul_(10)  # eagerly: y's first column too
        return y + 0


@graphcap.eager_on_graph
def route(h):
    if not h.any():  # a zero batch (as capture's) is refused
        raise ValueError("nothing to route")
    return h * 2


class CatchesTheBreak(torch.nn.Module):
    def forward(self, x):
        try:
            return route(x) + 1
        except ValueError:
            return x - 1


def test_a_breaks_exception_the_forward_caught_at_capture_is_refused_by_name():
    with pytest.raises(CaptureError, match=r"eager break route raised ValueError \(nothing "
                                           r"to route\) at capture and the forward caught"):
        graphcap.capture(CatchesTheBreak(), "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 2, device=DEVICE),))


@graphcap.eager_on_graph
def summed(h, parts):
    return h + sum(parts)


class PassesAGenerator(torch.nn.Module):
    def forward(self, x):
        return summed(x + 0, (p for p in (x * 2, x * 3)))


def test_an_iterator_given_to_a_break_is_refused_at_capture_not_used_up_at_replay():
    with pytest.raises(CaptureError, match=r"eager break summed was given an iterator "
                                           r"\(generator\).*list or tuple"):
        graphcap.capture(PassesAGenerator(), "breakable", buckets=[4],
                         example_inputs=(torch.ones(4, 2, device=DEVICE),))


@graphcap.eager_on_graph
def projected(h, w):
    return h @ w


class ProjectsUnderAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            h = projected(x, self.w)  # in bfloat16, at capture and eagerly
        return h.float() + 1


def test_a_break_called_under_the_forwards_autocast_replays_under_it():
    m = ProjectsUnderAutocast().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 4, device=DEVICE),))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    got = r(x)
    assert not torch.is_autocast_enabled(DEVICE)  # the replay's autocast ended with it
    with torch.no_grad():
        torch.testing.assert_close(got, m(x))


@graphcap.eager_on_graph
def bounded(h):
    if (h > 100).any():  # not at capture (zeros)
        raise ValueError("out of bounds")
    return h * 2


class CatchesOnSomeCalls(torch.nn.Module):
    def forward(self, x):
        try:
            return bounded(x) + 1
        except ValueError:
            return x - 1


def test_a_breaks_exception_at_replay_says_the_forward_cannot_catch_it_there():
    r = graphcap.capture(CatchesOnSomeCalls(), "breakable", buckets=[4],
                         example_inputs=(torch.ones(4, 2, device=DEVICE),))
    with pytest.raises(ValueError, match="out of bounds") as caught:
        r(torch.full((4, 2), 1000.0, device=DEVICE))  # eagerly caught: x - 1
    assert any("eager break bounded at a replay" in note and "try/except" in note
               for note in caught.value.__notes__)
    torch.testing.assert_close(r(torch.ones(4, 2, device=DEVICE)),
                               torch.full((4, 2), 3.0, device=DEVICE))


class Bounded(torch.nn.Module):
    def forward(self, x):
        return bounded(x) + 1


def test_an_error_of_the_model_under_debug_reaches_the_caller_without_a_note_on_breaks():
    r = graphcap.capture(Bounded(), "breakable", buckets=[4], debug=True,
                         example_inputs=(torch.ones(4, 2, device=DEVICE),))
    with pytest.raises(ValueError, match="out of bounds") as caught:
        r(torch.full((4, 2), 1000.0, device=DEVICE))  # the forward's Python ran: as eagerly
    assert not getattr(caught.value, "__notes__", [])
    r = graphcap.capture(CatchesOnSomeCalls(), "breakable", buckets=[4], debug=True,
                         example_inputs=(torch.ones(4, 2, device=DEVICE),))
    torch.testing.assert_close(r(torch.full((4, 2), 1000.0, device=DEVICE)),  # caught
                               torch.full((4, 2), 999.0, device=DEVICE))


def test_a_marked_function_is_a_plain_call_under_torch_compile():
    m = WritesThroughTheView()
    x = torch.randn(4, 2, device=DEVICE)
    compiled = torch.compile(m, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), m(x))


def test_a_breakable_capture_runs_once():
    from graphcap.breakable import BreakableCapture
    from graphcap.core import new_pool

    bcg = BreakableCapture(new_pool(DEVICE))
    x = torch.randn(4, device=DEVICE)
    bcg.run(lambda: newest_doubled([x]) + 1)
    with pytest.raises(CaptureError, match="has run already"):
        bcg.run(lambda: x + 1)


@pytest.mark.parametrize("captured_in", [torch.inference_mode, torch.no_grad])
def test_a_breakable_capture_replays_whatever_the_callers_grad_mode(captured_in):
    from graphcap.breakable import BreakableCapture
    from graphcap.core import new_pool

    x, lin = torch.zeros(4, 4, device=DEVICE), torch.nn.Linear(4, 4, device=DEVICE)
    bcg = BreakableCapture(new_pool(DEVICE))
    with captured_in():
        out = bcg.run(lambda: newest_doubled([lin(x)]) + 1)
    for replayed_in in (torch.enable_grad, torch.no_grad, torch.inference_mode):
        x.copy_(torch.randn(4, 4, device=DEVICE))
        with replayed_in():
            bcg.replay()
        with torch.no_grad():
            torch.testing.assert_close(out, lin(x) * 2 + 1)


@pytest.mark.skipif(DEVICE != "cuda", reason="a graph on the GPU, a result on the host")
def test_a_break_result_off_the_graphs_device_is_refused():
    host = graphcap.eager_on_graph(lambda h: h.abs().amax().cpu())

    class Scales(torch.nn.Module):
        def forward(self, x):
            return x / host(x)

    with pytest.raises(CaptureError, match="returned a tensor on cpu, not on the graph's"):
        graphcap.capture(Scales(), "breakable", buckets=[4],
                         example_inputs=(torch.randn(4, 2, device=DEVICE),))


@graphcap.eager_on_graph
def collected(h, scratch):
    scratch.append(h * 2)  # a list the forward makes afresh each call
    return torch.stack(scratch).sum(0)


class Collects2(torch.nn.Module):
    def forward(self, x):
        scratch = [x - 1]
        return collected(x + 1, scratch) * len(scratch)


@graphcap.eager_on_graph
def with_an_empty_chunk(h):
    y = h * 2
    return (y, *torch.split(y, [2, 0, 2]))  # an expert no token went to: a 0-row chunk


class WritesThroughAChunk(torch.nn.Module):
    def forward(self, x):
        y, first, empty, last = with_an_empty_chunk(x + 0)
        first.mul_(3)  # eagerly: y's first rows too
        return y + last.sum() + empty.sum()


@graphcap.eager_on_graph
def with_its_expansion(h):
    y = h * 2
    return y, y[:1].expand(4, -1), y[1:3]  # views of one new tensor, one expanded


class ReadsViews(torch.nn.Module):
    def forward(self, x):
        y, rows, middle = with_its_expansion(x + 0)
        return y + rows + middle.sum()


@pytest.mark.parametrize("model", [Collects, WritesThroughTheView, Collects2, ReadsViews,
                                   WritesThroughAChunk])
def test_a_break_replays_on_what_it_was_given_and_gives_what_eager_gives(model):
    assert_replays_as_eagerly(model().to(DEVICE), torch.randn(4, 4, device=DEVICE))


def assert_replays_as_eagerly(m, example):
    """``m`` captured under breakable on ``example`` [4, 4], replayed on three others."""
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(example,))
    for seed in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        with torch.no_grad():
            torch.testing.assert_close(r(x), m(x))


@graphcap.eager_on_graph
def on_host(h):
    return float(h.sum())


class CatchesARefusal(torch.nn.Module):
    def forward(self, x):
        try:
            return x * on_host(x)
        except CaptureError:
            return x


def test_a_refusal_of_a_breaks_result_the_forward_caught_is_raised_at_the_end():
    with pytest.raises(CaptureError, match="eager break on_host raised CaptureError"):
        graphcap.capture(CatchesARefusal(), "breakable", buckets=[4],
                         example_inputs=(torch.ones(4, 2, device=DEVICE),))


@graphcap.eager_on_graph
def with_its_conjugate(h):
    z = torch.complex(h, h * 2)
    return z, z.conj()


class ReadsAConjugate(torch.nn.Module):
    def forward(self, x):
        z, zc = with_its_conjugate(x + 0)
        return torch.view_as_real(z + zc * 2)


def test_a_conjugate_view_among_a_breaks_results_keeps_its_flag():
    m = ReadsAConjugate().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.randn(4, 4, device=DEVICE),))
    for seed in range(3):
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        torch.testing.assert_close(r(x), m(x))


@graphcap.eager_on_graph
def cache_of(module):
    return module.cache  # a host-side lookup picking one of the module's tensors


class AccumulatesIntoItsCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 4))

    def forward(self, x):
        cache_of(self).add_(x)  # eagerly: into the module's cache
        return self.cache * 1


def test_writes_through_a_modules_tensor_a_break_returned_reach_the_module():
    m = AccumulatesIntoItsCache().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 4, device=DEVICE),))
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(s)).to(DEVICE)
          for s in range(3)]
    m.cache.zero_()
    got = [r(x) for x in xs]
    replayed = m.cache.clone()
    m.cache.zero_()
    with torch.no_grad():
        want = [m(x) for x in xs]
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(replayed, m.cache)


@graphcap.eager_on_graph
def first_key_of(module):
    return module.layers[0][0]  # a cache of one (k, v) tuple per layer, in a list


class CountsInANestedCache(torch.nn.Module):
    def __init__(self, device):
        super().__init__()  # plain attributes, nested (which .to() would not move)
        self.layers = [(torch.zeros(4, device=device), torch.zeros(4, device=device))]

    def forward(self, x):
        first_key_of(self).add_(1)  # eagerly: the module's tensor, a count of calls
        return x + self.layers[0][0]


def test_writes_reach_a_modules_tensor_a_break_returned_from_nested_lists_and_tuples():
    m = CountsInANestedCache(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 4, device=DEVICE),))
    m.layers[0][0].zero_()
    x = torch.zeros(4, 4, device=DEVICE)
    got = [r(x)[0, 0].item() for _ in range(3)]
    assert got == [1.0, 2.0, 3.0]
    assert m.layers[0][0].tolist() == [3.0] * 4


@graphcap.eager_on_graph
def scaled_by(h, module):
    return h * module.scale


class HoldsALazyLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.later = torch.nn.LazyLinear(3)  # never called: a parameter of no storage

    def forward(self, x):
        return scaled_by(x + 1, self) + 1


def test_a_module_given_to_a_break_may_hold_tensors_of_no_storage():
    m = HoldsALazyLayer().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 2, device=DEVICE),))
    x = torch.randn(4, 2, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))


@graphcap.eager_on_graph
def doubled(h):
    return h * 2


class CatchesEverything(torch.nn.Module):
    def forward(self, x):
        try:
            n = int(x.sum())  # refused at capture, and caught
        except CaptureError:
            n = 0
        try:
            y = doubled(x)  # the segment before it cannot end: caught too
        except CaptureError:
            y = x
        return y + n


@pytest.mark.skipif(DEVICE == "cuda", reason="the emulator's refusal, caught")
def test_a_segment_that_cannot_end_at_a_break_is_refused_by_name_when_the_forward_catches_it():
    with pytest.raises(CaptureError, match=r"the graph segment before eager break doubled "
                                           r"raised CaptureError \(host synchronisation"):
        graphcap.capture(CatchesEverything(), "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 2, device=DEVICE),))


@graphcap.eager_on_graph
def gathered(h, found):
    if (h > 100).any():  # on some calls only: not at capture
        found.append(h * 10)
    return torch.stack(found).sum(0)


class GathersSometimes(torch.nn.Module):
    def forward(self, x):
        return gathered(x + 0, [x * 0]) + 1


def test_a_list_a_break_appends_to_on_some_calls_only_is_given_afresh_at_every_replay():
    m = GathersSometimes().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4],
                         example_inputs=(torch.zeros(4, 2, device=DEVICE),))
    x = torch.full((4, 2), 1000.0, device=DEVICE)
    for _ in range(3):  # the capture's list, appended to at every replay, grew
        torch.testing.assert_close(r(x), m(x))


@graphcap.eager_on_graph
def first_row(h):
    return h[0] * 1


class TransposesAGivenTensor(torch.nn.Module):
    def forward(self, x):
        h = x * 1
        row = first_row(h)
        h.t_()  # in place, after the break was given it: eagerly it read rows
        return h * 1 + row


class TransposesAResult(torch.nn.Module):
    def forward(self, x):
        h = doubled(x * 1)
        h.t_()  # graphcap's buffer of the result, were it handed out, would turn too
        return h * 1


@graphcap.eager_on_graph
def itself(h):
    return h


class UnsqueezesAnArgumentReturned(torch.nn.Module):
    def forward(self, x):
        h = itself(x * 1)
        h.unsqueeze_(1)  # the argument's own view: a replay's must lie as at the call
        return (h * 2).squeeze(1)


@graphcap.eager_on_graph
def rows_of(h):
    return torch.full((4,), float(h.shape[0]), device=h.device)


class TransposesAnEmptyTensorGiven(torch.nn.Module):
    def forward(self, x):
        empty = x[:, :0] * 1  # [4, 0]: no bytes, but a shape the break reads
        rows = rows_of(empty)
        empty.t_()
        return x[:, 0] + rows + empty.sum()


@graphcap.eager_on_graph
def transposed_first_row(h):
    h.t_()  # the break itself reshapes what it was given
    return h[0] * 1


class ABreakTransposesItsArgument(torch.nn.Module):
    def forward(self, x):
        h = x * 1  # the segment before the break writes it as it lies at the break's call
        column = transposed_first_row(h)
        return h * 1 + column


@pytest.mark.parametrize("model", [TransposesAGivenTensor, TransposesAResult,
                                   UnsqueezesAnArgumentReturned,
                                   TransposesAnEmptyTensorGiven,
                                   ABreakTransposesItsArgument])
def test_a_tensor_reshaped_in_place_after_a_break_replays_as_eagerly(model):
    assert_replays_as_eagerly(model().to(DEVICE), torch.zeros(4, 4, device=DEVICE))


@contextlib.contextmanager
def without_gc():
    """No collection inside: what is left holding memory there is held by a cycle."""
    graphcap.capture(torch.nn.Linear(2, 2), "breakable", buckets=[4])(torch.ones(4, 2))
    gc.collect()  # the process's first capture's imports, and earlier tests' cycles
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


calls = [0]


@graphcap.eager_on_graph
def refuses_at_capture(h):
    calls[0] += 1
    if calls[0] == 2:  # the warm-up runs; the capture's call raises
        raise KeyboardInterrupt
    return h * 2


class RaisesAtABreak(torch.nn.Module):
    def forward(self, x):
        return refuses_at_capture(x * 3) + 1


@pytest.mark.skipif(DEVICE == "cuda", reason="the emulator's bytes are its live graphs'")
@pytest.mark.parametrize("model, error", [(CatchesTheBreak, CaptureError),
                                          (RaisesAtABreak, KeyboardInterrupt)])
def test_a_capture_failing_at_a_break_lets_its_graphs_go_with_its_error(model, error):
    calls[0] = 0
    r = graphcap.capture(model().to(DEVICE), "breakable", buckets=[4])
    with without_gc():
        try:  # the segment before the break is captured, then the break fails
            r(torch.zeros(4, 2, device=DEVICE))
        except error:
            pass
        else:
            raise AssertionError("the capture did not fail")
        assert r.pool.bytes() == 0  # no cycle through the error's frames holds them


class ReadsLazilyAfterABreak(torch.nn.Module):
    """A break, then a host read on the first sight of each size: a shape's direct
    capture fails after it closed a segment, and is warmed up and captured again."""

    def __init__(self):
        super().__init__()
        self.scales: dict[int, float] = {}

    def forward(self, x):
        h = doubled(x + 1)
        n = h.shape[0]
        if n not in self.scales:
            self.scales[n] = float(h.abs().sum()) + 1.0  # refused in a capture
        return h * self.scales[n]


@pytest.mark.skipif(DEVICE == "cuda", reason="the emulator's bytes are its live graphs'")
def test_a_failed_direct_capture_lets_its_graphs_go_when_the_retry_builds():
    with without_gc():
        r = graphcap.capture(ReadsLazilyAfterABreak().to(DEVICE), "breakable",
                             buckets=[4, 8],
                             example_inputs=(torch.zeros(8, 2, device=DEVICE),))
        assert r.report()["warmup_retries"] == 1
        built = r.pool.bytes()
    gc.collect()
    assert r.pool.bytes() == built  # nothing of the failed capture was left to collect


class BreaksFirst(torch.nn.Module):
    """A forward that begins with two breaks in a row: its first two segments are empty."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(newest_doubled([newest_doubled([x])]))


def test_segments_with_no_ops_before_and_between_breaks_replay_without_a_warning():
    # torch warns of an empty CUDA graph as "captured on wrong device or stream".
    m = BreaksFirst().to(DEVICE).eval()
    x = torch.randn(4, 8, device=DEVICE)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(x,))
        with torch.no_grad():
            torch.testing.assert_close(r(x), m(x))
    assert not [w for w in seen if "CUDA Graph is empty" in str(w.message)]
    assert r.report()["breaks"] == {4: 2}
