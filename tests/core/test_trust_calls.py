"""A hostile user's calls: threads, eager breaks that change their results, odd lengths and
sizes, models of packed requests without graphcap attention, faults mid-call. Each gives
eager's result or a clear error, and the runner stays usable."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import BadBatch, ModelChanged, ReplayError, UnsupportedModel
from tests.support.check_models import SdpaDecoder  # its attention blind to request boundaries
from tests.support.runner_helpers import DEVICE, batch, eager, model, runner, tolerance

ATTN = "torch_masked"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def close(got, want):
    atol, rtol = tolerance()
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


# -- threads -------------------------------------------------------------------------
def _hammer(call, jobs, threads: int = 4):
    """Run ``call(job)`` for every job from ``threads`` threads; the failures seen."""
    failures, lock = [], threading.Lock()

    def work(mine):
        stream = torch.cuda.Stream() if DEVICE == "cuda" else None  # each its own stream
        for job in mine:
            try:
                if stream is not None:
                    with torch.cuda.stream(stream):
                        call(job)
                        stream.synchronize()
                else:
                    call(job)
            except Exception as exc:  # noqa: BLE001 - collected, asserted below
                with lock:
                    failures.append(f"{job}: {type(exc).__name__}: {exc}")

    if DEVICE == "cuda":
        torch.cuda.synchronize()  # the inputs and truths, made on the default stream
    pool = [threading.Thread(target=work, args=(jobs[i::threads],)) for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return failures


@pytest.mark.parametrize("strategy", GRAPHED)
def test_one_runner_called_from_several_threads_gives_every_caller_eager_results(strategy):
    r = runner(strategy, ATTN)
    cases = [[(n % 13) + 1, (n * 7) % 11] for n in range(48)]
    truth = {}
    for i, lens in enumerate(cases):
        ids, pos = batch(lens, seed=i)
        truth[i] = (ids, pos, lens, eager(ATTN, ids, pos, lens))

    def call(i):
        ids, pos, lens, want = truth[i]
        close(r(ids, pos, seq_lens=lens), want)

    assert _hammer(call, list(truth)) == []


def test_a_tensors_runner_captures_once_when_its_first_calls_come_from_two_threads():
    torch.manual_seed(0)
    mlp = graphcap.models.MLP().to(DEVICE)
    r = graphcap.capture(mlp, "full", buckets=[4, 8, 16])
    xs = [torch.randn(3 + i % 12, 64, device=DEVICE) for i in range(24)]
    with torch.no_grad():
        want = [mlp(x) for x in xs]

    def call(i):
        with torch.no_grad():
            close(r(xs[i]), want[i])

    assert _hammer(call, list(range(24))) == []
    assert r.report()["warmups"] == 1 and r.report()["shapes"] == [4, 8, 16]


# -- eager breaks ----------------------------------------------------------------------
class WithBreak(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.brk = graphcap.eager_on_graph(fn)

    def forward(self, x):
        return self.lin(self.brk(self.lin(x)))


def test_a_break_returning_other_shapes_at_replay_is_an_error_and_the_runner_stays_usable():
    width = {"w": 8}
    m = WithBreak(lambda h: torch.cat([h[:, :width["w"]], h[:, width["w"]:]], 1)
                  if width["w"] == 8 else h[:, :width["w"]]).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(x,))
    width["w"] = 1  # a width-1 result would be broadcast into the kept buffer
    with pytest.raises(ReplayError, match="at replay but"):
        r(x)
    width["w"] = 3  # and one that cannot broadcast
    with pytest.raises(ReplayError, match=r"\(4, 3\)"):
        r(x)
    width["w"] = 8
    with torch.no_grad():
        close(r(x), m(x))
    assert r.report()["failed"] == 2 and sum(r.stats.replays.values()) == 1


class WithKeyedBreak(WithBreak):
    def forward(self, x):
        return self.lin(next(iter(self.brk(self.lin(x)).values())))


def test_a_break_returning_another_structure_of_the_same_tensors_is_an_error_naming_both():
    key = {"k": "gate"}
    m = WithKeyedBreak(lambda h: {key["k"]: h * 2}).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(x,))
    key["k"] = "up"  # the same tensor, under another key
    with pytest.raises(ReplayError, match=r"\['up'\].* at replay but .*\['gate'\].* at capture"):
        r(x)


class GrowsItsTable(torch.nn.Module):
    """A break that makes its buffer anew where a call needs more rows than it has."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.arange(4.0))
        self.grow = graphcap.eager_on_graph(self._grow)

    def _grow(self, h):
        need = int(h.abs().sum().ceil())  # known on the host only
        if need > self.table.shape[0]:
            self.register_buffer("table", torch.arange(float(need), device=h.device))

    def forward(self, x):
        self.grow(x)
        return x + self.table.sum()


@pytest.mark.parametrize("debug", [False, True])
def test_a_call_whose_break_assigns_a_buffer_is_refused_not_answered_from_the_old_one(debug):
    m = GrowsItsTable().to(DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4], debug=debug,
                         example_inputs=(torch.zeros(4, 4, device=DEVICE),))
    x = torch.ones(4, 4, device=DEVICE)
    if not debug:  # the graph after the break read the 4-row table
        with pytest.raises(ModelChanged, match=r"an eager break changed GrowsItsTable during "
                                               r"this call \(table: another tensor.*copy_"):
            r(x)
    close(r(x), x + 120)  # captured again (debug: eager, the table it made)
    close(r(x), x + 120)


def test_a_break_sees_real_values_at_capture_not_graph_garbage():
    seen = []

    def record(h):
        seen.append(bool(torch.isfinite(h).all()))
        return h * 2

    m = WithBreak(record).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    graphcap.capture(m, "breakable", buckets=[2, 4], example_inputs=(x,))
    assert seen and all(seen)  # the warm-up and both captures


def test_a_break_returning_a_model_tensor_never_has_it_written_by_replays():
    table = torch.randn(2, 4, 8, device=DEVICE)
    kept = table.clone()
    pick = {"i": 0}

    class Picks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)
            self.choose = graphcap.eager_on_graph(lambda h: table[pick["i"]])

        def forward(self, x):
            return self.lin(x) + self.choose(x)

    m = Picks().to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(x,))
    pick["i"] = 1
    with torch.no_grad():
        close(r(x), m(x))
    assert torch.equal(table, kept)  # table[0], returned at capture, was not overwritten


# -- lengths, buckets, sizes -----------------------------------------------------------
ODD_LENGTHS = {"floats": [5.9, 2.1], "integral floats": [5.0, 3.0], "strings": ["5", "3"],
               "bools": [True, 7], "a float tensor": torch.tensor([5.0, 3.0]),
               "a bare int": 8, "a string": "53", "a 0-d tensor": torch.tensor(8),
               "a float array": np.array([5.0, 3.0]), "a 2-d array": np.array([[5, 3]])}


@pytest.mark.parametrize("case", sorted(ODD_LENGTHS))
def test_lengths_must_be_integers_and_are_never_rounded(case):
    r = runner("full", ATTN)
    ids, pos = batch([5, 3])
    with pytest.raises(BadBatch, match="seq_lens"):
        r(ids, pos, seq_lens=ODD_LENGTHS[case])
    close(r(ids, pos, seq_lens=[np.int64(5), torch.tensor(3)]), eager(ATTN, ids, pos, [5, 3]))
    close(r(ids, pos, seq_lens=np.array([5, 3])), eager(ATTN, ids, pos, [5, 3]))


@pytest.mark.parametrize("kwargs, needle", [
    (dict(buckets=[4.7, 8]), "bucket"), (dict(buckets=["8"]), "bucket"),
    (dict(max_tokens=64.0), "max_tokens"), (dict(buckets=[8], max_requests=2.5),
                                              "max_requests"),
    (dict(buckets=[8], max_requests=True), "max_requests")])
def test_sizes_must_be_integers(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        graphcap.capture(model(), "full", attention=ATTN, **kwargs)


def test_the_opt_in_input_check_refuses_ids_and_positions_out_of_range():
    r = graphcap.capture(model(), "full", buckets=[8], max_requests=2, attention=ATTN,
                         check_inputs=True)
    ids, pos = batch([5, 3])
    vocab = model().args.vocab_size
    for bad_ids, needle in ((ids - 300, "input_ids range"), (ids + vocab, "vocabulary")):
        with pytest.raises(BadBatch, match=needle):
            r(bad_ids, pos, seq_lens=[5, 3])
    with pytest.raises(BadBatch, match="positions"):
        r(ids, pos - 1, seq_lens=[5, 3])
    close(r(ids, pos, seq_lens=[5, 3]), eager(ATTN, ids, pos, [5, 3]))


# -- models of packed requests ----------------------------------------------------------
@pytest.mark.parametrize("strategy", ("eager", *GRAPHED))
def test_packed_requests_into_a_model_without_graphcap_attention_are_refused(strategy):
    m = SdpaDecoder().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[8, 16], max_requests=2, attention=ATTN)
    ids = torch.randint(0, 64, (8,), device=DEVICE)
    pos = torch.cat([torch.arange(5), torch.arange(3)]).to(DEVICE)
    with pytest.raises(UnsupportedModel, match="ran no graphcap attention.*Bring your own"):
        r(ids, pos, seq_lens=[5, 3])
    with torch.no_grad():  # one request at a time cannot mix
        close(r(ids[:5], pos[:5], seq_lens=[5, 0]), m(ids[:5], pos[:5]))
    if strategy != "eager":
        assert r.report()["attention"] is None


def test_graphcap_packed_refuses_a_model_without_graphcap_attention_too():
    m = SdpaDecoder().to(DEVICE)
    ids = torch.randint(0, 64, (8,), device=DEVICE)
    with pytest.raises(UnsupportedModel, match="ran no graphcap attention"):
        with graphcap.packed([5, 3], DEVICE):
            m(ids, ids)


def test_a_prefill_model_is_declared_not_guessed_from_its_parameter_names():
    class Renamed(torch.nn.Module):
        graphcap_inputs = "prefill"

        def __init__(self):
            super().__init__()
            self.inner = model()

        def forward(self, tokens, where):
            return self.inner(tokens, where)

    r = graphcap.capture(Renamed(), "full", buckets=[8], max_requests=2, attention=ATTN)
    ids, pos = batch([5, 3])
    close(r(ids, pos, seq_lens=[5, 3]), eager(ATTN, ids, pos, [5, 3]))
    assert r.report()["attention"] == ATTN
    plain = graphcap.capture(Renamed(), "full", buckets=[8], inputs="tensors")
    with pytest.raises(BadBatch, match="inputs='prefill'"):
        plain(ids, pos, seq_lens=[5, 3])


# -- faults and counters ---------------------------------------------------------------
def test_a_break_that_raises_at_replay_leaves_the_runner_usable_and_is_counted():
    fail = {"now": False}

    def maybe(h):
        if fail["now"]:
            raise RuntimeError("the break failed")
        return h + 1

    m = WithBreak(maybe).to(DEVICE)
    x = torch.randn(4, 8, device=DEVICE)
    r = graphcap.capture(m, "breakable", buckets=[4], example_inputs=(x,))
    fail["now"] = True
    with pytest.raises(RuntimeError, match="the break failed"):
        r(x)
    fail["now"] = False
    with torch.no_grad():
        close(r(x), m(x))
    assert r.report()["failed"] == 1 and r.stats.replays[4] == 1


@pytest.mark.parametrize("strategy", GRAPHED)
def test_every_accepted_call_is_a_replay_a_fallback_or_a_failure(strategy):
    m = graphcap.models.build_model("tiny", device=DEVICE)
    r = graphcap.capture(m, strategy, buckets=[8], max_requests=2, attention=ATTN,
                         on_change="error")
    ids, pos = batch([5, 3])
    r(ids, pos, seq_lens=[5, 3])
    m.lm_head.weight = torch.nn.Parameter(m.lm_head.weight.detach().clone())
    with pytest.raises(graphcap.ModelChanged):
        r(ids, pos, seq_lens=[5, 3])
    r.recapture()
    r(ids, pos, seq_lens=[5, 3])
    ids, pos = batch([12])
    r(ids, pos, seq_lens=[12])  # a fallback
    rep = r.report()
    assert rep["calls"] == 4 and rep["failed"] == 1
    assert rep["calls"] == sum(rep["replays"].values()) + sum(rep["fallbacks"].values()) \
        + rep["failed"]


def test_a_fallback_that_raises_is_counted_as_a_failure_only():
    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.fail = torch.nn.Linear(8, 8), False

        def forward(self, x):
            if self.fail:  # Python: an eager run sees it
                raise RuntimeError("the model failed")
            return self.lin(x)

    m = Flaky().to(DEVICE)
    r = graphcap.capture(m, "full", buckets=[4],
                         example_inputs=(torch.randn(4, 8, device=DEVICE),))
    past = torch.randn(6, 8, device=DEVICE)  # past the one bucket: an eager fallback
    m.fail = True
    with pytest.raises(RuntimeError, match="the model failed"):
        r(past)
    rep = r.report()
    assert (rep["calls"], rep["failed"], sum(rep["fallbacks"].values())) == (1, 1, 0)
    m.fail = False
    with torch.no_grad():
        close(r(past), m(past))  # the next fallback runs, counted
    assert sum(r.report()["fallbacks"].values()) == 1


@pytest.mark.parametrize("tokens", [3, 6], ids=["replay", "fallback"])
def test_a_call_whose_outputs_cannot_be_copied_is_counted_as_a_failure_only(tokens,
                                                                            monkeypatch):
    m = torch.nn.Linear(8, 8).to(DEVICE)
    r = graphcap.capture(m, "full", buckets=[4],
                         example_inputs=(torch.randn(4, 8, device=DEVICE),))

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("no memory left for the outputs")

    with monkeypatch.context() as patch:  # the copies a call returns, and nothing else
        patch.setattr(torch.Tensor, "narrow_copy", out_of_memory)
        patch.setattr(torch.Tensor, "clone", out_of_memory)
        with pytest.raises(torch.OutOfMemoryError):
            r(torch.randn(tokens, 8, device=DEVICE))
    rep = r.report()
    assert (rep["calls"], rep["failed"], sum(rep["replays"].values()),
            sum(rep["fallbacks"].values())) == (1, 1, 0, 0)


def test_a_batch_too_small_for_the_buckets_is_refused_naming_a_smaller_bucket():
    m = graphcap.models.build_model("tiny", device=DEVICE)
    r = graphcap.capture(m, "full", buckets=[8, 16], max_requests=2, attention=ATTN,
                         fallback=False)
    ids, pos = batch([1])  # padded 8x into the smallest bucket: past max_pad_ratio 2
    with pytest.raises(BadBatch, match=r"a batch of 1 token cannot .*padding: .*its bucket is over "
                                       r"2x that\) .* add a smaller bucket"):
        r(ids, pos, seq_lens=[1])
    ids, pos = batch([5])
    r(ids, pos, seq_lens=[5])  # usable


class LazyMask(torch.nn.Module):
    """Makes a mask for each size it is called with, replacing the last one: a lazy
    cache of the kind models keep (a causal mask, a rotary table)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.mask = None

    def forward(self, x):
        n = x.shape[0]
        if self.mask is None or self.mask.shape[0] != n:
            self.mask = torch.tril(torch.ones(n, n, device=x.device))
        return self.mask @ self.lin(x)


@pytest.mark.parametrize("strategy", ["breakable", "full"])
def test_a_tensor_the_model_replaces_while_later_shapes_build_stays_what_graphs_read(strategy):
    # Each shape warmed up makes its own mask; the graph of a shape captured before reads
    # the one it saw, which must outlive the build (on CUDA its memory would be reused).
    torch.manual_seed(0)
    m = LazyMask().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8, 16], warmup="every",
                         example_inputs=(torch.randn(16, 8, device=DEVICE),))
    masks = {n: r.entries[n].kept for n in (4, 8, 16)}
    for n in (16, 8, 4):
        assert any(t.shape == (n, n) for t in masks[n]), n  # its own mask, held
        scratch = [torch.randn(n, n, device=DEVICE) for _ in range(8)]  # memory reused
        x = torch.randn(n, 8, device=DEVICE)
        with torch.inference_mode():
            want = torch.tril(torch.ones(n, n, device=DEVICE)) @ m.lin(x)
        atol, rtol = tolerance()
        torch.testing.assert_close(r(x), want, atol=atol, rtol=rtol)
        del scratch


class RunningState(torch.nn.Module):
    """A forward that reassigns a buffer from itself on every call: a graph would read the
    buffer of its capture for ever and assign nothing."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("state", torch.zeros(4))

    def forward(self, x):
        y = self.lin(x) + self.state
        self.state = self.state * 0.5 + 1.0
        return y


class AveragesItsInputs(torch.nn.Module):
    """A running average of its inputs, reassigned on every call: from zeros, as the
    buffer starts, a warm-up's zero inputs leave it zeros, its value at every call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        self.ema = self.ema * 0.5 + x.mean(0) * 0.5
        return x - self.ema


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("model,refusal", [
    (RunningState, r"gives state another value on every call.*run twice.*in place"),
    # on zeros its value stays put: told by a run from another value of it
    (AveragesItsInputs, r"gives ema another value on every call.*run again from other "
                        r"values of it.*in place")], ids=["from-itself", "from-its-inputs"])
def test_a_forward_that_reassigns_its_buffer_on_every_call_is_refused(strategy, model,
                                                                       refusal):
    torch._dynamo.reset()
    r = graphcap.capture(model().to(DEVICE), strategy, buckets=[4])
    with pytest.raises(UnsupportedModel, match=refusal):
        r(torch.randn(4, 4, device=DEVICE))


class CopiesItsBuffer(torch.nn.Module):
    """Reassigns its buffers on every call, to what they held: a copy, a view."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 3.0))
        self.register_buffer("shift", torch.ones(8))

    def forward(self, x):
        self.scale, self.shift = self.scale.clone(), self.shift[:4]
        return self.lin(x) * self.scale + self.shift


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_buffer_reassigned_to_a_copy_or_view_of_itself_is_captured_and_kept(strategy):
    torch._dynamo.reset()
    m = CopiesItsBuffer().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4])
    x = torch.randn(4, 4, device=DEVICE)
    got = r(x)
    assert m.scale.tolist() == [3.0] * 4 and m.shift.tolist() == [1.0] * 4
    with torch.inference_mode():
        close(got, m.lin(x) * 3 + 1)


class LazyBufferMask(LazyMask):
    """LazyMask's mask as a registered buffer, replaced for each new size."""

    def __init__(self):
        super().__init__()
        del self.mask

    def forward(self, x):
        n = x.shape[0]
        if "mask" not in self._buffers or self.mask.shape[0] != n:
            self.register_buffer("mask", torch.tril(torch.ones(n, n, device=x.device)))
        return self.mask @ self.lin(x)


@pytest.mark.parametrize("strategy", ["breakable", "full"])  # a size in a branch: no Dynamo
@pytest.mark.parametrize("warmup", ["first", "every"])
def test_a_buffer_made_lazily_for_each_size_replays_right(strategy, warmup):
    # Warmed up, each new size replaces the mask, and a warm-up once more finds it made;
    # a shape captured directly makes its mask inside its graph, which every replay remakes.
    torch.manual_seed(0)
    m = LazyBufferMask().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8, 16], warmup=warmup,
                         example_inputs=(torch.randn(16, 8, device=DEVICE),))
    for n in (16, 8, 4, 8):
        x = torch.randn(n, 8, device=DEVICE)
        with torch.inference_mode():
            want = torch.tril(torch.ones(n, n, device=DEVICE)) @ m.lin(x)
        atol, rtol = tolerance()
        torch.testing.assert_close(r(x), want, atol=atol, rtol=rtol)
    assert r.report()["recaptures"] == 0
    # Each warm-up made its size's mask, so ran twice: the report counts both forwards.
    assert r.report()["warmups"] == (6 if warmup == "every" else 2)


def test_a_prefill_model_by_its_parameter_names_says_so_when_a_call_is_refused():
    class Batched(torch.nn.Module):  # [batch, seq] ids, as most models take them
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(100, 8)

        def forward(self, input_ids, positions):
            return self.emb(input_ids) + positions[..., None]

    m = Batched().to(DEVICE)
    ids = torch.randint(0, 100, (2, 4), device=DEVICE)
    pos = torch.arange(4, device=DEVICE).expand(2, 4)
    r = graphcap.capture(m, "full", buckets=[4, 8])
    with pytest.raises(BadBatch) as info:
        r(ids, pos)
    assert "named input_ids, positions" in str(info.value.__notes__)
    assert "inputs='tensors'" in str(info.value.__notes__)
    torch.testing.assert_close(graphcap.capture(m, "full", buckets=[4, 8],
                                                inputs="tensors")(ids, pos), m(ids, pos))


class RebuiltMask(torch.nn.Module):
    """A mask registered anew from constants on every call, at one size or two (an
    hourglass block): each replay rebuilds it inside the graph."""

    def __init__(self, sizes=1):
        super().__init__()
        self.lin, self.sizes = torch.nn.Linear(8, 8), sizes

    def forward(self, x):
        n = x.shape[0]
        if self.sizes == 2:
            self.register_buffer("mask", torch.tril(torch.ones(n // 2, n // 2,
                                                               device=x.device)))
        self.register_buffer("mask", torch.tril(torch.ones(n, n, device=x.device)))
        return self.mask @ self.lin(x)


@pytest.mark.parametrize("strategy", ["breakable", "full"])  # a size in a branch: no Dynamo
@pytest.mark.parametrize("sizes", [1, 2])
def test_a_buffer_rebuilt_alike_on_every_call_is_captured_and_replays_right(strategy, sizes):
    torch.manual_seed(0)
    m = RebuiltMask(sizes).to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8])
    for n in (8, 4, 8):
        x = torch.randn(n, 8, device=DEVICE)
        with torch.inference_mode():
            want = torch.tril(torch.ones(n, n, device=DEVICE)) @ m.lin(x)
        atol, rtol = tolerance()
        torch.testing.assert_close(r(x), want, atol=atol, rtol=rtol)
