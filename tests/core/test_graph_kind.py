"""Choosing the graph kind, and misuse of the graph primitive."""

from __future__ import annotations

import pytest
import torch

from graphcap.core import CudaGraph, EmulatedGraph, graph_kind, new_pool
from graphcap.errors import CaptureError, UnsupportedStrategy
from tests.conftest import requires_cuda


def test_cpu_tensors_get_the_emulator(environ):
    environ.unset("GRAPHCAP_GRAPH")
    assert graph_kind("cpu") == "emulated"
    assert isinstance(new_pool("cpu").graph(), EmulatedGraph)


def test_an_unknown_graphcap_graph_value_is_rejected_by_name(environ):
    environ.set("GRAPHCAP_GRAPH", "cudagraphs")
    with pytest.raises(UnsupportedStrategy, match="GRAPHCAP_GRAPH='cudagraphs'"):
        graph_kind("cpu")


def test_forcing_cuda_graphs_without_cuda_tensors_is_rejected(environ):
    environ.set("GRAPHCAP_GRAPH", "cuda")
    with pytest.raises(UnsupportedStrategy, match="needs CUDA tensors"):
        new_pool("cpu")


@pytest.mark.gpu
@requires_cuda
def test_cuda_tensors_get_cuda_graphs_unless_the_emulator_is_forced(environ):
    environ.unset("GRAPHCAP_GRAPH")
    assert isinstance(new_pool("cuda").graph(), CudaGraph)
    environ.set("GRAPHCAP_GRAPH", "emulated")
    assert isinstance(new_pool("cuda").graph(), EmulatedGraph)


def test_replay_before_capture_is_an_error():
    with pytest.raises(CaptureError, match="capture"):
        new_pool("cpu").graph().replay()


def test_beginning_a_capture_twice_is_an_error():
    graph = new_pool("cpu").graph()
    graph.begin()
    with pytest.raises(CaptureError, match="begin"):
        graph.begin()
    graph.end()


def test_emulated_outputs_hold_garbage_until_the_first_replay_as_on_cuda():
    x = torch.ones(4)
    graph = new_pool("cpu").graph()
    y = graph.capture(lambda t: t * 2, x)
    assert torch.isnan(y).all()
    graph.replay()
    assert torch.equal(y, torch.full((4,), 2.0))


def test_an_emulated_mask_holds_garbage_until_the_first_replay_too():
    x = torch.arange(6.0)
    graph = new_pool("cpu").graph()
    mask = graph.capture(lambda t: t > 2, x)
    assert mask.all()  # not the capture's values
    graph.replay()
    assert mask.tolist() == [False, False, False, True, True, True]


def test_an_in_place_view_changes_a_shape_once_as_on_cuda():
    # unsqueeze_ and t_ change metadata only: a replay runs kernels and leaves shapes.
    x, w = torch.ones(4), torch.ones(2, 3)
    graph = new_pool("cpu").graph()
    graph.begin()
    y = x * 2
    y.unsqueeze_(0)
    w.t_()
    z = w * 3
    graph.end()
    for _ in range(3):
        graph.replay()
    assert y.shape == (1, 4) and w.shape == (3, 2) and torch.equal(z, torch.full((3, 2), 3.0))


def test_begin_and_end_capture_the_code_between_once_as_on_cuda():
    x = torch.ones(4)
    graph = new_pool("cpu").graph()
    graph.begin()
    z = (x + 1) * 10
    graph.end()
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(z, torch.full((4,), 30.0))
    with pytest.raises(CaptureError, match="captured already"):
        graph.begin()
    with pytest.raises(CaptureError, match="end\\(\\) without begin"):
        new_pool("cpu").graph().end()


def test_reset_releases_the_record():
    graph = new_pool("cpu").graph()
    graph.capture(lambda: torch.zeros(1024) + 1)
    assert graph.bytes_held >= 4096
    graph.reset()
    assert graph.bytes_held == 0 and not graph.captured


@pytest.mark.gpu
@requires_cuda
def test_a_sync_cuda_refuses_is_translated_into_a_capture_error_naming_the_line():
    pool = new_pool("cuda", kind="cuda")
    x = torch.ones(8, device="cuda")

    def body(t):
        y = t * 2
        torch.cuda.synchronize()
        return y

    with pytest.raises(CaptureError, match="torch.cuda.synchronize"):
        pool.graph().capture(body, x)
    graph = pool.graph()
    y = graph.capture(lambda t: t * 3, x)
    graph.replay()
    assert torch.equal(y, torch.full((8,), 3.0, device="cuda"))


@pytest.mark.gpu
@requires_cuda
def test_a_pool_captures_again_after_all_its_graphs_died():
    pool = new_pool("cuda", kind="cuda")
    x = torch.ones(8, device="cuda")
    for factor in (2.0, 3.0, 4.0):
        graph = pool.graph()
        y = graph.capture(lambda t, f=factor: t * f, x)
        graph.replay()
        assert torch.equal(y, torch.full((8,), factor, device="cuda"))
        del graph, y


def test_an_op_returning_an_arguments_memory_leaves_that_memory_as_it_was():
    pool = new_pool("cpu")
    # aten._unsafe_view returns a new tensor by its schema, on its argument's memory: the
    # emulator must not take that memory for the capture's own (and fill it with NaN).
    w = torch.arange(6.0, device=pool.device).reshape(2, 3)
    x = torch.ones(2, 3, device=pool.device)
    graph = pool.graph()
    with torch.inference_mode():
        out = graph.capture(lambda t: t.sum() + torch.ops.aten._unsafe_view(w, [3, 2]).sum(),
                            x)
        graph.replay()
    assert torch.equal(w, torch.arange(6.0, device=pool.device).reshape(2, 3))
    assert out.item() == 21.0


def test_a_number_assigned_through_indexing_is_captured_on_the_cpu_as_on_cuda():
    # On the CPU, x[i] = 0.0 lifts the number into a tensor (a fill on CUDA); a tensor
    # made from Python data is still refused.
    x = torch.arange(8.0).view(2, 4)
    graph = new_pool("cpu").graph()

    def region(t):
        y = t * 2
        y[:, 0] = 0.0
        y[1] = 5
        return y

    y = graph.capture(region, x)
    x.fill_(1.0)
    graph.replay()
    assert y.tolist() == [[0.0, 2.0, 2.0, 2.0], [5.0] * 4]
    with pytest.raises(CaptureError, match="torch.tensor"):
        new_pool("cpu").graph().capture(lambda t: t + torch.tensor(3.0), x)
