"""``torch.compile(model, backend="sgl_piecewise")`` on the caller's tensors and the model's
buffers: Parameters passed in, every way a buffer or an input is written (through a view,
``out=``, a list, a split op), inputs of any layout, conversions that copy, inputs sharing
memory with each other or with a buffer a piece writes, inputs marked static: read and
written as eager, on every replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphcap.piecewise import PiecewiseCompiler
from tests.support.runner_helpers import DEVICE
from tests.support.trust_piecewise import calls_beside_eager as _calls

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


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


class ReturnsViewsOfOneTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y, y[1:], y.t(), y * 2


def test_outputs_sharing_memory_are_returned_as_views_of_one_copy_as_eager_returns_them():
    torch.manual_seed(0)
    m = ReturnsViewsOfOneTensor().to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4]}), fullgraph=True)
    with torch.no_grad():
        for call in range(4):  # warm-up, capture, replays
            x = torch.randn(4, 4, generator=torch.Generator().manual_seed(call)).to(DEVICE)
            got, want = c(x), m(x)
            torch.testing.assert_close(got, want)
            got[0][1].fill_(7.0)  # through y: reaches y[1:] and y.t(), not y * 2
            want[0][1].fill_(7.0)
            torch.testing.assert_close(got, want, msg=lambda s, n=call: f"{n}: {s}")
