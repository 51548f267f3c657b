"""The graph contract, pinned on every graph kind present (see graphcap/core/graphs.py).

Each test runs on the CPU emulator, and with ``-m gpu`` on real CUDA graphs and on the
emulator over CUDA tensors. Every test also fails on a graph that merely re-runs the
function (tests/core/test_semantics_suite_can_fail.py proves it).
"""

from __future__ import annotations

import math
import operator

import pytest
import torch

from graphcap.errors import CaptureError
from tests.support import custom_ops  # noqa: F401  (registers graphcap_test::*)


class Region:
    """A captured function that counts how often its Python body runs."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def full(pool, n, value, dtype=torch.float32):
    return torch.full((n,), float(value), device=pool.device, dtype=dtype)


def another_pool(pool):
    """A second pool of ``pool``'s kind, on its device."""
    if pool.kind == "rerun":  # the stand-in of tests/support/standins.py
        return type(pool)(pool.device)
    return type(pool)(pool.device, pool.kind)


def test_replay_reads_new_contents_of_captured_inputs_but_not_new_tensor_objects(pool):
    x = full(pool, 8, 1.0)
    inputs = {"x": x}
    region = Region(lambda: inputs["x"] * 2 + 1)
    graph = pool.graph()
    y = graph.capture(region)

    x.copy_(full(pool, 8, 5.0))
    graph.replay()
    assert torch.equal(y, full(pool, 8, 11.0))

    inputs["x"] = full(pool, 8, 100.0)  # a new object: the graph never sees it
    graph.replay()
    assert torch.equal(y, full(pool, 8, 11.0))
    assert region.calls == 1


def test_outputs_are_the_same_objects_every_replay_and_overwritten_by_the_next(pool):
    x = full(pool, 16, 1.0)
    region = Region(lambda t: (t * 3, (t + 1)[::2]))
    graph = pool.graph()
    y, z = graph.capture(region, x)
    ptrs = (y.data_ptr(), z.data_ptr())

    graph.replay()
    held_y, held_z = y, z
    assert torch.equal(held_y, full(pool, 16, 3.0)) and torch.equal(held_z, full(pool, 8, 2.0))

    x.fill_(2.0)
    graph.replay()
    assert held_y is y and (y.data_ptr(), z.data_ptr()) == ptrs
    assert torch.equal(held_y, full(pool, 16, 6.0)) and torch.equal(held_z, full(pool, 8, 3.0))
    assert region.calls == 1


def test_python_side_effects_scalars_and_branches_are_fixed_at_capture(pool):
    x = full(pool, 4, 2.0)
    log, cfg = [], {"scale": 3.0, "relu": True}

    def body(t):
        log.append("ran")
        out = t * cfg["scale"]
        return out.neg().relu() if cfg["relu"] else out

    graph = pool.graph()
    y = graph.capture(body, x)
    cfg.update(scale=5.0, relu=False)
    x.fill_(-1.0)
    for _ in range(3):
        graph.replay()
    assert log == ["ran"]
    assert torch.equal(y, full(pool, 4, 3.0))  # relu(-(-1 * 3)), not -1 * 5


def test_in_place_ops_and_views_of_captured_tensors_replay(pool):
    buf = torch.arange(8, device=pool.device, dtype=torch.float32)
    x = full(pool, 8, 1.0)
    region = Region(lambda: (buf.add_(x), buf[2:6].mul_(2), buf.view(2, 4))[-1])
    graph = pool.graph()
    matrix = graph.capture(region)

    # Capture launches nothing: the buffer is as it was.
    assert torch.equal(buf, torch.arange(8, device=pool.device, dtype=torch.float32))
    graph.replay()
    expect = torch.arange(8, device=pool.device, dtype=torch.float32) + 1
    expect[2:6] *= 2
    assert torch.equal(buf, expect) and torch.equal(matrix, expect.view(2, 4))
    assert matrix.data_ptr() == buf.data_ptr()

    x.fill_(10.0)
    graph.replay()
    expect += 10
    expect[2:6] *= 2
    assert torch.equal(buf, expect) and torch.equal(matrix, expect.view(2, 4))
    assert region.calls == 1


def test_ops_that_copy_or_alias_by_layout_replay_with_new_inputs(pool):
    x = torch.arange(12, device=pool.device, dtype=torch.float32).view(3, 4)
    region = Region(lambda t: (t.t().contiguous() * 1, t.t().reshape(12) + 0,
                               t.contiguous().sum(0)))
    graph = pool.graph()
    outs = graph.capture(region, x)
    fresh = torch.randn(3, 4, device=pool.device)
    x.copy_(fresh)
    graph.replay()
    for got, want in zip(outs, (fresh.t().contiguous(), fresh.t().reshape(12),
                                fresh.sum(0)), strict=True):
        torch.testing.assert_close(got, want)
    assert region.calls == 1


def test_a_tensor_reshaped_in_place_keeps_for_each_op_its_shape_of_the_time(pool):
    """``t_()``, ``unsqueeze_()``, ``resize_()`` on tensors the region made change their
    shape in place: the ops before read and write them in the shape they had then."""
    x = torch.arange(12, device=pool.device, dtype=torch.float32).view(3, 4)

    def body(t):
        square = t[:, :3] * 2  # not symmetric: a replay reading it transposed differs
        square.t_()
        mask = (t[:, 0] > 0).to(t.dtype)
        mask.unsqueeze_(-1)
        flat = t + 1
        flat.resize_(12)
        return square @ t[:, :3], t * mask, flat

    region = Region(body)
    graph = pool.graph()
    outs = graph.capture(region, x)
    fresh = torch.randn(3, 4, device=pool.device)
    x.copy_(fresh)
    graph.replay()
    for got, want in zip(outs, body(fresh.clone()), strict=True):
        torch.testing.assert_close(got, want)
    assert region.calls == 1


@pytest.mark.parametrize("other_pool", [False, True], ids=["one pool", "two pools"])
def test_a_tensor_reshaped_in_place_in_a_later_graph_keeps_its_shape_in_earlier_ones(
        pool, other_pool):
    """A tensor one graph made, transposed in place while another records (a breakable
    capture's segments; on two pools, two runners of one model): the first graph still
    writes it as it made it, as CUDA's kernels keep the layout they were launched with."""
    x = torch.arange(12, device=pool.device, dtype=torch.float32).view(3, 4)
    made, reads = Region(lambda t: t[:, :3] * 2), Region(lambda s: s.t_() * 1)
    first, second = pool.graph(), (another_pool(pool) if other_pool else pool).graph()
    square = first.capture(made, x)
    out = second.capture(reads, square)
    fresh = torch.randn(3, 4, device=pool.device)
    x.copy_(fresh)
    first.replay()
    second.replay()
    torch.testing.assert_close(out, (fresh[:, :3] * 2).t())
    assert made.calls == reads.calls == 1


def test_out_variant_ops_write_their_given_buffers_on_replay(pool):
    x = full(pool, 6, 1.0)
    given = torch.zeros(6, device=pool.device)

    def body(t):
        torch.add(t, 1, out=given)
        inner = torch.empty_like(t)
        torch.mul(given, 2, out=inner)
        return inner

    region = Region(body)
    graph = pool.graph()
    inner = graph.capture(region, x)
    assert torch.equal(given, torch.zeros(6, device=pool.device))  # untouched by capture

    x.fill_(4.0)
    graph.replay()
    assert torch.equal(given, full(pool, 6, 5.0)) and torch.equal(inner, full(pool, 6, 10.0))
    assert region.calls == 1


def test_two_graphs_on_one_pool_replay_one_at_a_time_in_any_order(pool):
    # Each graph's output is read before the other replays: on CUDA a later capture may
    # put its output in blocks the earlier graph uses as scratch (graphs.py's contract).
    xa, xb = full(pool, 32, 1.0), full(pool, 32, 1.0)
    ra = Region(lambda t: torch.sin(t) * 2)
    rb = Region(lambda t: torch.cos(t) + 1)
    ga, gb = pool.graph(), pool.graph()
    ya = ga.capture(ra, xa)
    yb = gb.capture(rb, xb)

    for step, order in enumerate(["ab", "ba", "bb", "aa", "ab"]):
        va, vb = float(step), float(-step - 1)
        xa.fill_(va)
        xb.fill_(vb)
        for which in order:
            if which == "a":
                ga.replay()
                assert torch.allclose(ya, torch.sin(full(pool, 32, va)) * 2)
            else:
                gb.replay()
                assert torch.allclose(yb, torch.cos(full(pool, 32, vb)) + 1)
    assert (ra.calls, rb.calls) == (1, 1)


def test_torch_library_custom_ops_replay_inside_the_region(pool):
    x, y = full(pool, 10, 1.0), full(pool, 10, 2.0)
    out = torch.zeros(10, device=pool.device)
    factor = {"a": 3.0}

    def body():
        torch.ops.graphcap_test.axpy_out(x, y, factor["a"], out)
        return torch.ops.graphcap_test.axpy(x, out, 0.5)

    region = Region(body)
    graph = pool.graph()
    z = graph.capture(region)
    factor["a"] = 100.0  # baked at capture
    x.fill_(2.0)
    y.fill_(1.0)
    graph.replay()
    assert torch.equal(out, full(pool, 10, 7.0))  # 3 * 2 + 1
    assert torch.equal(z, full(pool, 10, 8.0))  # 0.5 * 2 + 7
    assert region.calls == 1


def test_an_op_that_writes_an_argument_and_returns_a_new_tensor_replays_both(pool):
    x = full(pool, 4, 1.0)
    acc = torch.zeros(4, device=pool.device)
    region = Region(lambda: torch.ops.graphcap_test.double_and_accumulate(x, acc))
    graph = pool.graph()
    y = graph.capture(region)
    x.fill_(5.0)
    graph.replay()
    assert torch.equal(y, full(pool, 4, 10.0)) and torch.equal(acc, full(pool, 4, 5.0))
    assert region.calls == 1


HOST_SYNCS = {
    "item": ("item", lambda t: t.sum().item()),
    "tolist": ("tolist", lambda t: t.tolist()),
    "cpu": (".cpu()", lambda t: t.cpu()),
    "nonzero": ("nonzero", lambda t: torch.nonzero(t > 2)),
    "tensor_from_list": ("torch.tensor", lambda t: t + torch.tensor([1.0] * 8, device=t.device)),
    "print": ("print", lambda t: print(t)),
    # Python reading a tensor as a number: each is Tensor.item underneath.
    "int": ("item", lambda t: int(t.sum())),
    "float": ("item", lambda t: float(t.sum())),
    "operator.index": ("item", lambda t: operator.index(t.sum().long())),
    "range": ("item", lambda t: range(t.sum().long())),
    "slice": ("item", lambda t: t[: t.sum().long()]),
    "math": ("item", lambda t: math.floor(t.sum())),
    # Ops that size their output from the data, or read it, inside their kernel.
    "where": ("nonzero", lambda t: torch.where(t > 2)),
    "argwhere": ("nonzero", lambda t: torch.argwhere(t > 2)),
    "repeat_interleave": ("host synchronisation",
                          lambda t: t.repeat_interleave(t.long().clamp(max=2))),
    "allclose": ("host synchronisation", lambda t: torch.allclose(t, t + 1)),
    "histc": ("host synchronisation", lambda t: torch.histc(t, bins=4)),
    "linalg.inv": ("host synchronisation", lambda t: torch.linalg.inv(torch.diag(t[:2] + 1))),
    "normal_std_tensor": ("host synchronisation", lambda t: torch.normal(t, t.abs() + 1)),
    "linspace_tensor_ends": ("host synchronisation", lambda t: torch.linspace(t[0], t[1], 4)),
    # Host calls that wait for the device's work: no aten op, torch.cuda.synchronize()
    # even where the model runs on the CPU (as CUDA does, where it runs).
    "synchronize": ("synchronize", lambda t: torch.get_device_module(t.device).synchronize()),
    "cuda.synchronize": ("synchronize", lambda t: torch.cuda.synchronize()),
    "accelerator.synchronize": ("synchronize", lambda t: torch.accelerator.synchronize()),
}
# The runner captures under inference_mode, where a dispatch mode sees composite ops
# (int(t) as aten.item) whole: each sync must be refused there as under no_grad.
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("grad", sorted(GRAD_MODES))
@pytest.mark.parametrize("case", sorted(HOST_SYNCS))
def test_host_syncs_raise_capture_error_naming_the_op_and_leave_state_usable(pool, case,
                                                                              grad):
    needle, sync = HOST_SYNCS[case]
    x = torch.arange(8, device=pool.device, dtype=torch.float32)
    buf = torch.zeros(8, device=pool.device)

    def body(t):
        buf.add_(t)
        return sync(t)

    graph = pool.graph()
    with pytest.raises(CaptureError) as info, GRAD_MODES[grad]():
        graph.capture(body, x)
    assert needle in str(info.value), str(info.value)
    assert torch.equal(buf, torch.zeros(8, device=pool.device))  # nothing of it happened

    # The model and the pool stay usable: eager code, then a fresh capture.
    assert torch.equal(x * 2, torch.arange(8, device=pool.device, dtype=torch.float32) * 2)
    again = pool.graph()
    y = again.capture(lambda t: t + buf, x)
    again.replay()
    assert torch.equal(y, x)


def test_a_tensor_a_failed_capture_made_and_kept_holds_garbage_as_nothing_ran(pool):
    # A model's lazily made constant, then a host read: CUDA ran neither (the constant's
    # memory holds whatever it held); the emulator fills it as it fills a graph's new
    # memory, so a retry that finds the constant made and reads it fails here too.
    if pool.kind == "cuda":
        pytest.skip("CUDA's garbage is whatever the memory held: nothing to compare")
    x = torch.arange(8, device=pool.device, dtype=torch.float32)
    kept = {}

    def body(t):
        kept["scale"] = torch.full((1,), 2.0, device=t.device)
        return t * kept["scale"] + t.sum().item()

    with pytest.raises(CaptureError, match="item"):
        pool.graph().capture(body, x)
    assert torch.isnan(kept["scale"]).all()


@pytest.mark.parametrize("case", ["item", "nonzero", "print", "cuda.synchronize"])
def test_a_host_sync_the_region_catches_still_fails_the_capture(pool, case):
    # CUDA invalidates the capture itself (its next op fails: the error names that line),
    # the emulator names the sync the region caught
    needle, sync = HOST_SYNCS[case]
    cuda = pool.kind == "cuda"
    needle, said = ("operation failed due to a previous error during capture",
                    "CUDA graph capture failed") if cuda else (needle,
                                                               "region caught this error")
    x = torch.arange(8, device=pool.device, dtype=torch.float32)
    buf = torch.zeros(8, device=pool.device)

    def body(t):
        buf.add_(t)
        try:
            sync(t)
        except Exception:  # graphcap's CaptureError, or CUDA's own error in capture
            pass  # a graph would replay the path taken from here on every call
        return t + 1

    graph = pool.graph()
    with pytest.raises(CaptureError, match=said) as info:
        graph.capture(body, x)
    assert needle in str(info.value), str(info.value)
    assert torch.equal(buf, torch.zeros(8, device=pool.device))  # nothing of it happened
    again = pool.graph()  # the pool stays usable
    y = again.capture(lambda t: t + buf, x)
    again.replay()
    assert torch.equal(y, x)


def test_waiting_for_the_stream_the_region_runs_on_is_refused(pool):
    if pool.device.type != "cuda":
        pytest.skip("streams are CUDA's")
    x = torch.arange(8, device=pool.device, dtype=torch.float32)
    with pytest.raises(CaptureError, match="synchroni"):
        pool.graph().capture(lambda t: (torch.cuda.current_stream().synchronize(), t + 1), x)
    y = pool.graph().capture(lambda t: t + 1, x)  # the pool stays usable
    assert y.shape == x.shape


def test_a_copy_into_the_device_that_waits_for_the_host_is_refused(pool):
    # A blocking copy from the host (.to(device) of a host tensor, copy_ of one without
    # non_blocking=True, pinned or not) syncs the stream after it
    if pool.device.type != "cuda":
        pytest.skip("on the CPU the host is the device: there is no copy to make")
    x = torch.arange(8, device=pool.device, dtype=torch.float32)
    pageable, pinned = torch.ones(8), torch.ones(8).pin_memory()
    for copy in (lambda t: t + pageable.to(t.device), lambda t: t + pinned.to(t.device),
                 lambda t: torch.empty_like(t).copy_(pinned)):
        with pytest.raises(CaptureError, match="host synchronisation"):
            pool.graph().capture(copy, x)
    y = pool.graph().capture(lambda t: t + 1, x)  # the pool stays usable
    assert y.shape == x.shape


def test_synchronising_outside_the_captured_region_is_allowed(pool):
    x = full(pool, 4, 1.0)
    region = Region(lambda t: t * 2)
    graph = pool.graph()
    torch.get_device_module(pool.device).synchronize()  # looked up at each call
    y = graph.capture(region, x)
    torch.get_device_module(pool.device).synchronize()
    x.fill_(3.0)
    graph.replay()
    torch.get_device_module(pool.device).synchronize()
    assert torch.equal(y, full(pool, 4, 6.0)) and region.calls == 1


def test_random_ops_draw_fresh_values_on_every_replay(pool):
    region = Region(lambda: (torch.rand(4096, device=pool.device),
                             torch.randn(4096, device=pool.device)))
    graph = pool.graph()
    u, n = graph.capture(region)
    seen = []
    for _ in range(3):
        graph.replay()
        assert 0.0 <= float(u.min()) and float(u.max()) < 1.0
        assert abs(float(n.mean())) < 0.1
        seen.append(u.clone())
    assert not torch.equal(seen[0], seen[1]) and not torch.equal(seen[1], seen[2])
    assert region.calls == 1


@pytest.mark.parametrize("samples,replacement", [(1, True), (1, False), (3, False), (3, True)])
def test_sampling_with_multinomial_captures_and_draws_on_every_replay(pool, samples,
                                                                       replacement):
    # Its check of the probabilities is an asynchronous assert on the supported torch
    # versions (2.11 on CUDA: no host read), so it is not refused.
    probs = torch.zeros(64, 32, device=pool.device)
    probs[:, :8] = 1.0  # only the first 8 categories can be drawn
    region = Region(lambda p: torch.multinomial(p, samples, replacement=replacement))
    graph = pool.graph()
    drawn = graph.capture(region, probs)
    seen = []
    for _ in range(3):
        graph.replay()
        assert drawn.shape == (64, samples) and int(drawn.max()) < 8
        if not replacement:  # distinct categories in each row
            assert all(len(set(row)) == samples for row in drawn.tolist())
        seen.append(drawn.clone())
    assert not torch.equal(seen[0], seen[1]) or not torch.equal(seen[1], seen[2])
    assert region.calls == 1  # drawn by the graph, not by its Python again


def test_a_capture_draws_nothing_from_the_generator_its_replays_draw_from(pool):
    # CUDA's capture launches nothing: eager draws after it are those it would have made
    torch.manual_seed(0)
    eager = torch.rand(64, device=pool.device)
    torch.manual_seed(0)
    graph = pool.graph()
    drawn = graph.capture(lambda: torch.rand(64, device=pool.device))
    assert torch.equal(torch.rand(64, device=pool.device), eager)
    graph.replay()  # and replays draw from it, moving it on
    assert not torch.equal(torch.rand(64, device=pool.device), drawn)


def _default_generator(device) -> torch.Generator:
    device = torch.device(device)
    if device.type == "cpu":
        return torch.default_generator
    return torch.cuda.default_generators[device.index or 0]


def test_a_random_op_given_a_generator_of_its_own_is_refused(pool):
    # CUDA capture registers the device's default generator alone; another raises at its
    # first draw (the error names "a CUDA generator"); the default's draws replay fresh
    own = torch.Generator(device=pool.device).manual_seed(0)
    x = full(pool, 8, 1.0)
    with pytest.raises(CaptureError, match="generator"):
        pool.graph().capture(lambda t: t + torch.rand(8, device=t.device, generator=own), x)

    default = _default_generator(pool.device)
    region = Region(lambda t: t + torch.rand(8, device=t.device, generator=default))
    graph = pool.graph()
    y = graph.capture(region, x)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y) and region.calls == 1


def test_a_refused_generator_the_region_catches_leaves_the_capture_valid(pool):
    # CUDA refuses the draw before launching anything: the capture goes on
    own = torch.Generator(device=pool.device).manual_seed(0)
    x = full(pool, 8, 1.0)

    def body(t):
        try:
            torch.rand(8, device=t.device, generator=own)
        except Exception:  # graphcap's CaptureError, or CUDA's own error in capture
            pass
        return t + 1

    region = Region(body)
    graph = pool.graph()
    y = graph.capture(region, x)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(y, full(pool, 8, 3.0)) and region.calls == 1


def test_a_captured_mlp_matches_eager_on_new_inputs(pool):
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32)).to(pool.device)
    x = torch.randn(8, 32, device=pool.device)
    region = Region(mlp)
    with torch.inference_mode():
        with pool.warmup():  # lazy init (cuBLAS handles) outside capture
            mlp(x)
        graph = pool.graph()
        y = graph.capture(region, x)
        for _ in range(3):
            fresh = torch.randn(8, 32, device=pool.device)
            x.copy_(fresh)
            graph.replay()
            torch.testing.assert_close(y, mlp(fresh))
    assert region.calls == 1
    # On CUDA the capture may add nothing: it reuses the warm-up's blocks in the pool.
    assert pool.bytes() > 0 and pool.bytes() >= graph.bytes_held >= 0


def test_a_captured_matmul_survives_others_clearing_cublas_workspaces(pool):
    """torch.compile's reduce-overhead clears cuBLAS's workspaces on every recording;
    a graph captured earlier must not depend on the workspace it freed."""
    from graphcap import compat

    torch.manual_seed(0)
    # No bias: addmm with a bias goes through cuBLASLt and its own workspace.
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 1024, bias=False),
                              torch.nn.Linear(1024, 256, bias=False))
    mlp = mlp.to(pool.device)
    x = torch.randn(64, 256, device=pool.device)
    with torch.inference_mode():
        with pool.warmup():  # on a CUDA pool: cuBLAS makes the capture stream's workspace
            mlp(x)
        graph, region = pool.graph(), Region(mlp)
        y = graph.capture(region, x)
        if pool.device.type == "cuda":
            peer = torch.compile(torch.nn.Linear(256, 256).to(pool.device),
                                 mode="reduce-overhead")
            for _ in range(3):
                peer(x)
        compat.clear_cublas_workspaces()
        if pool.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
        clutter = torch.full((64 << 20,), float("nan"), device=pool.device)
        for _ in range(2):
            fresh = torch.randn(64, 256, device=pool.device)
            x.copy_(fresh)
            graph.replay()
            torch.testing.assert_close(y, mlp(fresh))
        del clutter
    assert region.calls == 1


def test_a_warmup_allocates_from_the_pool_so_the_capture_reuses_its_blocks(pool):
    """On CUDA graphs the warm-up before a pool's first capture draws on the pool: its
    freed blocks are the capture's, and the capture stream keeps no second cache outside
    the pool. Later warm-ups do not (what they keep could sit in a graph's scratch)."""
    if pool.kind != "cuda":
        pytest.skip("the emulator has no memory pool")
    x = torch.randn(1024, 1024, device=pool.device)

    def region():
        return (x @ x).relu().sum(0)  # 4 MiB intermediates

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    outside = torch.cuda.memory_reserved(pool.device) - pool.bytes()
    with pool.warmup():
        want = region()
    inside = pool.bytes()
    y = pool.graph().capture(region)
    torch.cuda.synchronize()
    assert inside > 4 << 20  # the warm-up's intermediates (and cuBLAS's workspace)
    assert torch.cuda.memory_reserved(pool.device) - pool.bytes() == outside
    pool_after = pool.bytes()
    assert pool_after <= inside + (2 << 20)  # the capture reused the warm-up's blocks
    assert y.shape == want.shape
    with pool.warmup():
        kept = torch.empty(4 << 20, dtype=torch.uint8, device=pool.device)
    assert pool.bytes() == pool_after  # after a capture, warm-ups allocate outside
    del kept


def test_the_first_warm_up_sizes_the_pool_to_its_peak(pool):
    """A sizing warm-up (the runner's first, largest shape) runs outside the pool, then
    gives the pool one free block of its transient peak of large allocations plus the
    capture stream's cuBLAS workspace: the capture splits that block instead of growing
    the allocator's eager layout of segments, and no cache of the warm-up's stays
    outside the pool."""
    if pool.kind != "cuda":
        pytest.skip("the emulator has no memory pool")
    x = torch.randn(2048, 1024, device=pool.device)
    w1 = torch.randn(1024, 3000, device=pool.device)
    w2 = torch.randn(3000, 1024, device=pool.device)

    def region():  # intermediates of 24 MiB and 8 MiB, freed as it goes; a small output
        h = torch.relu(x @ w1)
        return ((h * 2) @ w2).sum(0)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(pool.device)  # earlier tests' peaks hide the warm-up's
    outside = torch.cuda.memory_reserved(pool.device)
    with pool.warmup(sizes=True):
        want = region()
    assert pool.sized_bytes >= 2 * 2048 * 3000 * 4  # h and h * 2 live together

    def large():
        return [s["total_size"] for s in pool._segments() if s["segment_type"] == "large"]

    assert len(large()) == 1 and large()[0] - pool.sized_bytes < 2 << 20  # the block
    graph = pool.graph()
    y = graph.capture(region)
    assert len(large()) == 1, large()  # the capture fitted in it
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, want)
    # Outside the pool: what was there and the warm-up's small output, no cache of the
    # warm-up's intermediates.
    extra = torch.cuda.memory_reserved(pool.device) - pool.bytes() - outside
    assert extra <= 2 << 20


def test_a_warm_up_whose_peak_an_earlier_one_hides_leaves_the_pool_to_grow(pool):
    if pool.kind != "cuda":
        pytest.skip("the emulator has no memory pool")
    x = torch.randn(1024, 1024, device=pool.device)
    torch.cuda.reset_peak_memory_stats(pool.device)
    high = torch.empty(256 << 20, dtype=torch.uint8, device=pool.device)  # a higher peak
    del high
    with pool.warmup(sizes=True):
        want = (x @ x).relu()
    assert pool.sized_bytes == 0  # nothing measured, nothing reserved
    graph = pool.graph()
    y = graph.capture(lambda: (x @ x).relu())
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, want)
