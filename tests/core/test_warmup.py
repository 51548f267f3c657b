"""Warm-up before capture: by default only the first (largest) shape runs an eager warm-up
forward; the others are captured directly, and a shape whose direct capture fails (its
first launch does something a capture refuses) is warmed up and captured again.

Each test runs on the CPU emulator, and with ``-m gpu`` on real CUDA graphs."""

from __future__ import annotations

import contextlib
import weakref

import pytest
import torch

import graphcap
from graphcap.core.graphs import GraphPool
from graphcap.errors import UnsupportedStrategy
from graphcap.models import MLP
from tests.conftest import requires_cuda

BUCKETS = [4, 8, 16]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda])]


class LazyPerShape(torch.nn.Module):
    """An MLP that, the first time it sees a row count, sets up a per-shape constant by
    reading a device value on the host, as a library's lazy set-up or a kernel's first
    launch might: a capture refuses that, a warm-up does not mind."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.mlp = MLP(width, depth=2)
        self.scales: dict[int, torch.Tensor] = {}

    def forward(self, x):
        n = x.shape[0]
        if n not in self.scales:
            norm = float(self.mlp.net[0].weight.norm().item())  # a host read: not in a graph
            self.scales[n] = torch.full((1,), 1.0 + norm / 10, device=x.device)
        return self.mlp(x) * self.scales[n]


def check_every_bucket(r, model, width, device):
    for rows in (3, 4, 7, 8, 16):
        x = torch.randn(rows, width, device=device)
        with torch.no_grad():
            torch.testing.assert_close(r(x), model(x), atol=1e-5, rtol=1e-5)
    assert sum(r.stats.replays.values()) == 5 and r.stats.fallbacks == {}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_only_the_first_shape_is_warmed_up_and_every_shape_replays_like_eager(strategy, device):
    torch.manual_seed(0)
    m = MLP(16, depth=2).to(device)
    r = graphcap.capture(m, strategy, buckets=BUCKETS, example_inputs=(torch.randn(4, 16,
                         device=device),))
    rep = r.report()
    assert rep["shapes"] == BUCKETS
    assert (rep["warmups"], rep["warmup_retries"]) == (1, 0)
    check_every_bucket(r, m, 16, device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_a_shape_whose_direct_capture_fails_is_warmed_up_and_captured_again(strategy, device):
    torch.manual_seed(0)
    m = LazyPerShape().to(device)
    r = graphcap.capture(m, strategy, buckets=BUCKETS, example_inputs=(torch.randn(4, 16,
                         device=device),))
    rep = r.report()
    # 16 is warmed first; 8 and 4 fail their direct capture on the host read, then warm up.
    assert (rep["warmups"], rep["warmup_retries"]) == (3, 2)
    assert sorted(m.scales) == BUCKETS
    check_every_bucket(r, m, 16, device)


@pytest.mark.parametrize("device", DEVICES)
def test_warmup_every_warms_each_shape(device):
    m = MLP(16, depth=2).to(device)
    r = graphcap.capture(m, "full", buckets=BUCKETS, warmup="every",
                         example_inputs=(torch.randn(4, 16, device=device),))
    assert (r.report()["warmups"], r.report()["warmup_retries"]) == (3, 0)
    check_every_bucket(r, m, 16, device)


def test_tc_piecewise_warms_every_shape_since_its_warm_ups_compile():
    m = MLP(8, depth=1)
    r = graphcap.capture(m, "tc_piecewise", buckets=[4, 8],
                         example_inputs=(torch.randn(8, 8),))
    assert r.report()["warmups"] == 2


def test_an_unknown_warmup_mode_is_an_error_naming_the_modes():
    with pytest.raises(ValueError, match="warmup='some'.*'first'.*'every'"):
        graphcap.capture(MLP(8, depth=1), "full", buckets=[4], warmup="some",
                         example_inputs=(torch.randn(4, 8),))


class ChangesAtFour(torch.nn.Module):
    """Fine at 8 rows; at 4 rows drops a row (``rows``) or returns float64 (``dtype``)."""

    def __init__(self, how: str):
        super().__init__()
        self.mlp, self.how = MLP(8, depth=1), how

    def forward(self, x):
        out = self.mlp(x)
        if x.shape[0] != 4:
            return out
        return out[:3] if self.how == "rows" else out.double()


@pytest.mark.parametrize("how, needle", [
    ("rows", r"\[\(3, 8\)\] for 4 tokens.*row per token"),
    ("dtype", r"torch.float64.*for 4 tokens.*torch.float32.*first shape"),
])
def test_wrong_outputs_of_a_directly_captured_shape_are_an_error_without_a_retry(how,
                                                                                 needle):
    # 8 rows are warmed up and fine; 4 is captured directly, and its outputs are checked
    # inside that capture: no warm-up can fix them, so nothing is retried.
    r = graphcap.capture(ChangesAtFour(how), "full", buckets=[4, 8])
    with pytest.raises(UnsupportedStrategy, match=needle):
        r(torch.randn(8, 8))
    assert (r.stats.warmups, r.stats.warmup_retries) == (1, 0)
    assert r.entries == {}  # nothing half-built is kept


def test_capturing_again_starts_over_with_the_first_shape_warmed_up():
    m = MLP(16, depth=2)
    r = graphcap.capture(m, "full", buckets=BUCKETS, example_inputs=(torch.randn(4, 16),))
    r.capture_all((torch.randn(4, 16),))
    assert (r.report()["warmups"], r.report()["warmup_retries"]) == (2, 0)
    check_every_bucket(r, m, 16, "cpu")


class RemembersOutputs(torch.nn.Module):
    """An MLP keeping a weak reference to each output it returns."""

    def __init__(self):
        super().__init__()
        self.mlp, self.outputs = MLP(16, depth=1), []

    def forward(self, x):
        out = self.mlp(x)
        self.outputs.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("device", DEVICES)
def test_a_warm_up_frees_its_outputs_before_it_ends(device, monkeypatch):
    # A sizing warm-up reads the allocator as it ends: outputs still held there would
    # count as kept, not transient, and the pool would be sized short of the capture,
    # which makes them in the pool before copying them into the static outputs.
    model, alive = RemembersOutputs().to(device), []
    warmup = GraphPool.warmup

    @contextlib.contextmanager
    def watched(pool, sizes=False):
        with warmup(pool, sizes):
            yield
            alive.extend(ref() is not None for ref in model.outputs)

    monkeypatch.setattr(GraphPool, "warmup", watched)
    graphcap.capture(model, "full", buckets=BUCKETS,
                     example_inputs=(torch.randn(16, 16, device=device),))
    assert alive == [False]


class LazyConstant(torch.nn.Module):
    """Builds a per-shape constant on first sight of each row count, without reading the
    device: under a direct capture it is made inside the graph (its contents exist only
    once that shape has replayed); a warm-up makes it eagerly."""

    def __init__(self):
        super().__init__()
        self.mlp = MLP(16, depth=1)
        self.scales: dict[int, torch.Tensor] = {}

    def forward(self, x):
        n = x.shape[0]
        if n not in self.scales:
            self.scales[n] = torch.full((1,), 2.0, device=x.device)
        return self.mlp(x) * self.scales[n]


@pytest.mark.parametrize("device", DEVICES)
def test_warmup_every_builds_lazy_per_shape_state_before_any_replay(device):
    m = LazyConstant().to(device)
    r = graphcap.capture(m, "full", buckets=BUCKETS, warmup="every",
                         example_inputs=(torch.randn(4, 16, device=device),))
    assert {n: float(t) for n, t in m.scales.items()} == {n: 2.0 for n in BUCKETS}
    check_every_bucket(r, m, 16, device)


@pytest.mark.gpu
@requires_cuda
def test_a_triton_kernel_first_launched_in_a_direct_capture_replays_correctly():
    """Each shape below compiles a Triton kernel variant of its own (its block size is a
    constant), so its first launch comes inside that shape's direct capture. On the H200
    (CUDA 13) the module loads under capture; a driver that refuses it fails the capture
    and the shape is warmed up and captured again. Either way every shape replays right."""
    import triton
    import triton.language as tl

    @triton.jit
    def scale_kernel(x, out, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(out + offs, tl.load(x + offs, mask=offs < n) * 3.0, mask=offs < n)

    class TritonScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("unused", torch.zeros(1, device="cuda"))  # its device

        def forward(self, x):
            out = torch.empty_like(x)
            block = triton.next_power_of_2(x.numel()) * 2  # a fresh variant per shape
            scale_kernel[(1,)](x, out, x.numel(), BLOCK=block)
            return out

    r = graphcap.capture(TritonScale(), "full", buckets=[8, 16, 32],
                         example_inputs=(torch.randn(8, 16, device="cuda"),))
    rep = r.report()
    assert rep["shapes"] == [8, 16, 32] and rep["graph_kind"] == "cuda"
    for rows in (5, 8, 16, 32):
        x = torch.randn(rows, 16, device="cuda")
        torch.testing.assert_close(r(x), x * 3.0)
    assert sum(r.stats.replays.values()) == 4


class BigTransient(torch.nn.Module):
    """An MLP whose forward also makes a large temporary: what a warm-up outside the
    pool leaves in the allocator's cache once it is freed."""

    def __init__(self, width: int = 16, temp_mib: int = 64):
        super().__init__()
        self.mlp = MLP(width, depth=2)
        self.temp_bytes = temp_mib << 20

    def forward(self, x):
        temp = torch.ones(self.temp_bytes // 4, device=x.device)
        return self.mlp(x) + temp[: x.shape[1]]


@pytest.mark.gpu
@requires_cuda
def test_the_cache_later_warm_ups_leave_outside_the_pool_is_released_after_the_build():
    # warmup="every" warms each shape, the later ones after the pool's first capture,
    # outside the pool: their freed temporaries would stay cached for the capture stream.
    model = BigTransient().cuda()
    x = torch.randn(16, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    r = graphcap.capture(model, "full", buckets=BUCKETS, warmup="every",
                         example_inputs=(x,))
    outside = torch.cuda.memory_reserved() - r.pool.bytes() - before
    assert outside < 64 << 20, outside  # not one 64 MiB temporary kept outside the pool
    with torch.no_grad():
        torch.testing.assert_close(r(x), model(x))  # the pool's graphs are intact


class SplitsTheBlock(torch.nn.Module):
    """A 24 MiB temporary alive across the forward's first matmul, then a 48 MiB one:
    the block the first warm-up sizes (48 MiB and cuBLAS's workspace) holds both only
    if the workspace is not made between them, where the first matmul would make it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(16, 16))

    def forward(self, x):
        early = torch.ones(24 << 18, device=x.device)  # 24 MiB of float32
        y = x @ self.weight + early[:1]
        del early
        late = torch.ones(48 << 18, device=x.device)
        return y + late[:1]


@pytest.mark.gpu
@requires_cuda
def test_the_sized_block_holds_the_capture_the_workspace_at_its_head():
    model = SplitsTheBlock().cuda()
    x = torch.randn(16, 16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()  # the pool is sized from the warm-up's new peak
    r = graphcap.capture(model, "full", buckets=[16], example_inputs=(x,))
    assert r.pool.sized_bytes >= 48 << 20
    large = [s for s in r.pool._segments() if s["total_size"] > 2 << 20]
    # One segment: the sized block. A workspace made by the capture's first matmul sits
    # after the 24 MiB temporary and leaves no 48 MiB hole: a second segment.
    assert len(large) == 1, [s["total_size"] for s in large]
    assert large[0]["blocks"][0]["state"].startswith("active")  # the workspace, first
    with torch.no_grad():
        torch.testing.assert_close(r(x), model(x))
