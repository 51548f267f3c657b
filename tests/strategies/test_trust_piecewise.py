"""``torch.compile(model, backend="sgl_piecewise")`` on a hostile user's paths: swapped
weights, Parameters passed in, grad mode, ``dynamic=True``, threads; and what dropped
runners of every strategy leave behind (nothing)."""

from __future__ import annotations

import gc
import threading
import weakref
from collections import Counter

import pytest
import torch
from torch import nn

import graphcap
from graphcap.api import STRATEGIES
from graphcap.piecewise import PiecewiseCompiler, counters
from tests.support.runner_helpers import DEVICE, batch

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.scale = 0.5

    def forward(self, ids):
        return self.norm(self.lin(self.emb(ids))) * self.scale


def net():
    torch.manual_seed(0)
    return Net().to(DEVICE)


def compiled(m, **kw):
    # The backend itself: on the GPU machine graphcap runs from the tree, without the
    # entry point that resolves backend="sgl_piecewise".
    return torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4, 8]}), **kw)


def ids(n, seed=0):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def warm(c, n=4):
    for seed in range(3):  # warm-up, capture, replay
        c(ids(n, seed))


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


def test_a_parameter_passed_in_is_never_overwritten_by_a_replay():
    class Prompted(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, prompt, x):
            return self.lin(prompt + x)

    torch.manual_seed(0)
    m = Prompted().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4]}))
    prompts = [nn.Parameter(torch.randn(4, 8, device=DEVICE)) for _ in range(3)]
    kept = [p.detach().clone() for p in prompts]
    x = torch.randn(4, 8, device=DEVICE)
    with torch.no_grad():
        for _ in range(2):
            for p in prompts:
                torch.testing.assert_close(c(p, x), m(p, x))
    assert all(torch.equal(p, k) for p, k in zip(prompts, kept, strict=True))


class Writes(nn.Module):
    """Writes its buffer, or the caller's tensor, each way a K/V cache is written."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cache", torch.zeros(16, 4))

    def forward(self, x, acc):
        y = self.lin(x)
        n = x.shape[0]
        if self.how == "setitem":
            self.cache[:n] = y
        elif self.how == "view-copy":
            self.cache.narrow(0, 0, n).copy_(y)
        elif self.how == "view-method":
            self.cache[:n].add_(y)
        elif self.how == "float-view":
            self.cache.float()[:n].add_(y)  # float() of a float tensor is itself
        elif self.how == "out":
            torch.add(y, 1, out=acc)
        elif self.how == "out-view":
            torch.mul(y[:, :2], 3, out=acc[:, :2].unsqueeze(0).squeeze(0))
        return y * 2


@pytest.mark.parametrize("how", ["setitem", "view-copy", "view-method", "float-view", "out",
                                 "out-view"])
def test_every_write_of_a_buffer_or_an_input_reaches_it_on_every_replay(how):
    torch.manual_seed(0)
    m, twin = Writes(how).to(DEVICE), Writes(how).to(DEVICE)
    twin.load_state_dict(m.state_dict())
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [8]}))
    with torch.no_grad():
        for seed in range(4):  # warm-up, capture, replays
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
            acc, acc_twin = torch.zeros(8, 4, device=DEVICE), torch.zeros(8, 4, device=DEVICE)
            torch.testing.assert_close(c(x, acc), twin(x, acc_twin))
            torch.testing.assert_close(m.cache, twin.cache, msg=f"call {seed}: the cache")
            torch.testing.assert_close(acc, acc_twin, msg=f"call {seed}: the caller's tensor")


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


def test_a_split_op_writing_a_view_of_the_callers_tensor_writes_that_tensor():
    """The piece before the split returns a view of the caller's tensor; the split op
    writes it, the piece after reads it: as eager, on every replay."""
    class SplitWrites(nn.Module):
        def forward(self, x, acc):
            view = acc[:, :2]
            torch.ops.graphcap_trust.split_b(x[:, :2] * 2, view)
            return view.sum(1) + x.sum(1)

    c = torch.compile(SplitWrites(), backend=PiecewiseCompiler(
        {"capture_sizes": [8], "split_ops": ["graphcap_trust::split_b"]}))
    with torch.no_grad():
        for seed in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
            acc, want = torch.zeros(8, 4, device=DEVICE), torch.zeros(8, 4, device=DEVICE)
            torch.testing.assert_close(c(x, acc), SplitWrites()(x, want))
            torch.testing.assert_close(acc, want, msg=f"call {seed}")


def test_one_backend_instance_refuses_a_second_device_naming_what_to_do():
    compiler = PiecewiseCompiler({"capture_sizes": [4]})
    lin = nn.Linear(4, 4)
    c = torch.compile(lin, backend=compiler)
    with torch.no_grad():
        c(torch.randn(4, 4))
        lin.to("meta")  # Dynamo compiles again, with the same backend instance
        with pytest.raises(Exception, match="captures its graphs on cpu, and a call on meta"):
            c(torch.randn(4, 4, device="meta"))


class Converts(nn.Module):
    """Conversions of its inputs that copy them here (bf16 to float32): no alias."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale):
        s = scale.float()  # a copy of a bf16 scale, written in place: not a write of it
        s.mul_(2.0)
        return self.lin(x.float()) * s, x.float(), x.view(torch.int16)


def test_conversions_that_copy_are_neither_aliases_nor_writes_of_the_inputs():
    # Outputs kept across calls stay their own (a copy is returned, not the static
    # buffer); a view of another dtype keeps it; an expanded input is never written back.
    torch.manual_seed(0)
    m = Converts().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4]}))
    kept = []
    with torch.no_grad():
        for seed in range(4):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(4, 8, generator=gen).to(DEVICE, torch.bfloat16)
            scale = torch.rand(1, 8, generator=gen).to(DEVICE, torch.bfloat16).expand(4, 8)
            got, want = c(x, scale), m(x, scale)
            for g, w in zip(got, want, strict=True):
                assert g.dtype == w.dtype and torch.equal(g, w), seed
            kept.append((got, want))
    for got, want in kept:  # later calls changed nothing returned before
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


class Strided(nn.Module):
    """Reads inputs of any layout (a column slice, an expanded scale) and writes one."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, scale, acc):
        y = self.lin(x) * scale
        acc.add_(y[:, :2])
        return y


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_inputs_of_any_layout_are_captured_read_and_written_as_eager(compiler):
    # Inductor's code checks each input's traced sizes and strides: a dense static copy
    # of a strided or expanded input failed its capture (AssertionError) on every call.
    torch.manual_seed(0)
    m = Strided().to(DEVICE)
    compiler = PiecewiseCompiler({"capture_sizes": [4], "compiler": compiler})
    c = torch.compile(m, backend=compiler, fullgraph=True)
    with torch.no_grad():
        for seed in range(4):
            gen = torch.Generator().manual_seed(seed)
            x = torch.randn(4, 16, generator=gen).to(DEVICE)[:, ::2]
            scale = torch.rand(1, 8, generator=gen).to(DEVICE).expand(4, 8)
            acc, want = torch.zeros(2, 4, 6, device=DEVICE), torch.zeros(2, 4, 6, device=DEVICE)
            torch.testing.assert_close(c(x, scale, acc[1, :, 3:5]),
                                       m(x, scale, want[1, :, 3:5]))
            torch.testing.assert_close(acc, want, msg=f"call {seed}: the caller's tensor")
    assert compiler.stats["captures"] == 1 and not compiler.stats["eager_runs"]


_LIB = torch.library.Library("graphcap_trust", "FRAGMENT")
_LIB.define("split_b(Tensor x, Tensor(a!) out) -> ()")


def _split_b(x, out):
    out.copy_(x * 3 + 1)


_LIB.impl("split_b", _split_b, "CompositeExplicitAutograd")


def test_under_grad_mode_the_forward_runs_eagerly_and_backward_gives_eagers_gradients():
    m = net()
    c = compiled(m)
    before = counters()
    x = ids(4)
    for _ in range(3):
        out = c(x)
    out.sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, m.parameters(), strict=True))
    after = counters()
    assert after["grad_runs"] - before["grad_runs"] == 3
    assert after["captures"] == before["captures"]
    with torch.no_grad():  # a compile of its own, with graphs
        warm(c)
    assert counters()["captures"] > before["captures"]


def test_a_parameter_an_op_returns_as_is_is_no_autograd_history_under_inference_mode():
    class Scaled(Net):  # Gemma's RMSNorm: (1 + weight.float()), weight already float32
        def forward(self, ids):
            return super().forward(ids) * (1.0 + self.norm.weight.float())

    torch.manual_seed(0)
    m = Scaled().to(DEVICE)
    c = compiled(m)
    before = counters()
    with torch.inference_mode():
        warm(c)
        got = c(ids(4, 7))
    after = counters()
    assert after["grad_runs"] == before["grad_runs"]
    assert after["captures"] > before["captures"]
    with torch.no_grad():
        torch.testing.assert_close(got, m(ids(4, 7)))


def test_dynamic_shapes_with_float_attributes_capture_and_see_a_changed_float():
    m = net()
    c = compiled(m, dynamic=True)
    with torch.no_grad():
        for n, seed in ((4, 0), (4, 1), (4, 2), (8, 3), (8, 4), (8, 5), (5, 6)):
            torch.testing.assert_close(c(ids(n, seed)), m(ids(n, seed)))
        m.scale = 3.0
        torch.testing.assert_close(c(ids(4, 7)), m(ids(4, 7)))


def test_a_compiled_model_called_from_several_threads_gives_eager_results():
    m = net()
    c = compiled(m)
    xs = [ids(4 if i % 2 else 8, i) for i in range(32)]
    with torch.no_grad():
        warm(c, 4)
        warm(c, 8)  # a recompile, dynamic: its size 4 is warmed up and captured in threads
        want = [m(x) for x in xs]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    failures = []

    def work(mine):
        with torch.no_grad():
            for i in mine:
                try:
                    if not torch.allclose(c(xs[i]), want[i], atol=1e-5):
                        failures.append(f"{i}: differs")
                except Exception as exc:  # noqa: BLE001 - collected, asserted below
                    failures.append(f"{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(range(k, 32, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_an_exception_of_the_models_own_is_raised_as_it_is_not_as_a_tracing_failure():
    class Refuses(nn.Module):
        graphcap_inputs = "prefill"

        def __init__(self):
            super().__init__()
            self.inner = graphcap.models.build_model("tiny", device=DEVICE)

        def forward(self, input_ids, positions):
            if input_ids.shape[0] > 6:
                raise ValueError("inputs longer than 6 tokens are refused")
            return self.inner(input_ids, positions)

    with pytest.raises(ValueError, match="longer than 6"):
        graphcap.capture(Refuses(), "tc_piecewise", buckets=[4, 8], max_requests=2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_dropped_runner_frees_its_graphs_and_pool(strategy):
    m = graphcap.models.build_model("tiny", device=DEVICE)
    keep = graphcap.capture(m, strategy, buckets=[4, 8], max_requests=2,
                            attention="torch_masked")
    i, p = batch([3])
    for _ in range(3):
        r = graphcap.capture(m, strategy, buckets=[4, 8], max_requests=2,
                             attention="torch_masked")
        r(i, p, seq_lens=[3])
        runner, pool = weakref.ref(r), weakref.ref(r.pool)
        del r
        gc.collect()
        assert runner() is None and pool() is None
    with graphcap.packed([3], DEVICE, "torch_masked"):
        torch.testing.assert_close(keep(i, p, seq_lens=[3]), m(i, p))


@pytest.mark.skipif(DEVICE != "cuda", reason="device memory")
def test_dropped_runners_leave_the_device_memory_where_it_was():
    m = graphcap.models.build_model("tiny", device="cuda")
    i, p = batch([3])

    def once():
        r = graphcap.capture(m, "tc_piecewise", buckets=[4, 8], max_requests=2,
                             attention="torch_masked")
        r(i, p, seq_lens=[3])
        del r
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()

    readings = [once() for _ in range(5)]  # the first runner's build leaves some cache
    assert readings[2:] == [readings[1]] * 3 and readings[1] <= readings[0]


class WritesOneOfTwo(torch.nn.Module):
    def forward(self, a, b):
        a.mul_(2)  # b overlapping a sees it, eagerly
        return a + b


class WritesTheMiddleOfThree(torch.nn.Module):
    def forward(self, a, b, c):
        t = a + 1  # a first among the piece's inputs, then b and c
        b.mul_(2)  # c overlaps a (read only) and b
        return t + c


def test_an_input_overlapping_a_written_one_is_found_past_a_read_only_overlap():
    compiled = torch.compile(WritesTheMiddleOfThree(), backend=PiecewiseCompiler(
        {"capture_sizes": [4]}), fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for _ in range(3):
            x, y = torch.arange(12.0, device=DEVICE), torch.arange(12.0, device=DEVICE)
            torch.testing.assert_close(compiled(x[0:4], x[5:9], x[3:7]),
                                       WritesTheMiddleOfThree()(y[0:4], y[5:9], y[3:7]))


def test_inputs_sharing_memory_that_a_piece_writes_run_eagerly_as_eager_gives():
    compiled = torch.compile(WritesOneOfTwo(), backend=PiecewiseCompiler(
        {"capture_sizes": [4]}), fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for overlap in (False, False, True, True, False):
            x, y = torch.arange(8.0, device=DEVICE), torch.arange(8.0, device=DEVICE)
            cut = 2 if overlap else 4  # b from x[2:6] overlaps a = x[:4]
            got = compiled(x[:4], x[cut:cut + 4])
            torch.testing.assert_close(got, WritesOneOfTwo()(y[:4], y[cut:cut + 4]))
            torch.testing.assert_close(x, y)  # the caller's tensor written as eagerly


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


class WritesItsCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, view):
        self.cache.add_(x)  # the buffer, written in place
        return view * 2  # the caller's view of it, read after the write


def test_a_callers_view_of_a_buffer_the_piece_writes_runs_eagerly_as_eager_gives():
    m, twin = WritesItsCache().to(DEVICE), WritesItsCache().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4]}), fullgraph=True)
    with torch.inference_mode():
        for seed in range(4):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
            torch.testing.assert_close(c(x, m.cache[:, :2]), twin(x, twin.cache[:, :2]))
            torch.testing.assert_close(m.cache, twin.cache, msg=f"call {seed}")


def _calls(module, args_of, calls: int, **options):
    """``module`` compiled (capture size 4, ``split_b`` a split op) beside an eager twin,
    each call's outputs and buffers compared; the counters' change at each call."""
    torch.manual_seed(0)
    m = module().to(DEVICE)
    twin = module().to(DEVICE)
    twin.load_state_dict(m.state_dict())
    c = torch.compile(m, backend=PiecewiseCompiler({
        "capture_sizes": [4], "split_ops": ["graphcap_trust::split_b"], **options}),
        fullgraph=True)
    changes = []
    with torch.no_grad():
        for k in range(calls):
            before = counters()
            torch.testing.assert_close(c(*args_of(m, k)), twin(*args_of(twin, k)),
                                       msg=lambda s, k=k: f"call {k}: {s}")
            changes.append({key: n for key, n in (counters() - before).items() if n})
            for (name, got), (_, want) in zip(m.named_buffers(), twin.named_buffers(),
                                              strict=True):
                torch.testing.assert_close(got, want, msg=f"call {k}: buffer {name}")
    return changes


class WritesAfterAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, 3))

    def forward(self, x, u):
        head = self.cache[:2]  # the first piece's output: a view of the buffer
        out = torch.empty_like(x)
        torch.ops.graphcap_trust.split_b(x, out)
        self.cache.add_(out)  # the piece after the split writes the buffer
        return u * 2 + head.sum()  # and reads the caller's u, after the write


def test_an_input_captured_as_a_copy_stays_one_when_it_aliases_a_buffer_the_piece_writes():
    # The size was captured with u a copy; u a view of the buffer later must not be taken
    # for a tensor read in place (the buffer's address is an earlier piece's output's).
    def args_of(m, k):
        u = torch.full((4, 3), float(k), device=DEVICE) if k < 3 else m.cache.view(4, 3)
        return torch.ones(4, 3, device=DEVICE), u

    _calls(WritesAfterAView, args_of, calls=5)


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


class Marked(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(64, 3))
        self.lin = nn.Linear(3, 3)

    def forward(self, pos, x):
        out = torch.empty(pos.shape[0], 3, device=pos.device)
        torch.ops.graphcap_trust.split_b(self.table[pos] + x, out)
        return self.lin(out) + self.table[pos]


def test_inputs_marked_static_are_still_the_calls_size_and_are_read_in_place():
    # mark_static_address, as torch suggests to CUDA-graph users: the caller's batch.
    held = {}

    def args_of(m, k):
        pos, x = held.setdefault(id(m), (torch.zeros(4, dtype=torch.long, device=DEVICE),
                                         torch.zeros(4, 3, device=DEVICE)))
        torch._dynamo.mark_static_address(pos)
        torch._dynamo.mark_static_address(x)
        pos.copy_(torch.arange(4) * 2 + k)
        x.fill_(k)
        return pos, x

    changes = _calls(Marked, args_of, calls=5)
    assert not any(c.get("eager_runs") for c in changes)
    assert all(not c for c in changes[2:])  # replays, nothing captured again


class NamedLikeAttributes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, scratch_buffers):
        out = torch.empty_like(x)
        torch.ops.graphcap_trust.split_b(self.lin(x), out)
        return out * scratch_buffers


def test_an_argument_named_like_a_modules_buffers_is_the_callers_and_copied():
    changes = _calls(NamedLikeAttributes, lambda m, k: (
        torch.ones(4, 3, device=DEVICE), torch.full((4, 3), float(k), device=DEVICE)), calls=5)
    assert all(not c for c in changes[2:])  # no capture per call


class WritesAList(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("a", torch.zeros(4, 3))

    def forward(self, x, u):
        torch._foreach_add_([self.a, u], [x, x])  # a buffer and the caller's tensor
        out = torch.empty_like(x)
        torch.ops.graphcap_trust.split_b(self.lin(x), out)
        return out + self.a + u


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_tensors_written_through_a_list_are_written_on_every_replay(compiler):
    held = {}

    def args_of(m, k):
        u = held.setdefault(id(m), torch.zeros(4, 3, device=DEVICE))
        return torch.full((4, 3), k + 1.0, device=DEVICE), u

    _calls(WritesAList, args_of, calls=5, compiler=compiler)
    torch.testing.assert_close(*held.values())  # the caller's tensor, as eager wrote it


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
