"""A CUDA graph whose capture set-up fails (out of memory making the pool's cuBLAS
workspace) gives back what it took: the garbage collector and the current stream. The
CUDA calls are replaced here so that the failure can be made on a machine without one."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch

from graphcap.core import cuda_graph


class _Pool:
    device = torch.device("cuda", 0)

    class stream:  # noqa: N801 (a stream object's one method begin() calls)
        @staticmethod
        def wait_stream(other):
            pass

    def begin_capture(self):
        raise torch.OutOfMemoryError("CUDA out of memory (the pool's cuBLAS workspace)")


def test_a_failed_set_up_leaves_the_garbage_collector_as_it_was(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def stream(s):
        entered.append(s)
        yield
        entered.remove(s)

    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: None)
    monkeypatch.setattr(cuda_graph, "_blas_handles", lambda pool: None)
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    graph = cuda_graph.CudaGraph(_Pool())
    with pytest.raises(torch.OutOfMemoryError):
        graph.begin()
    assert (gc.isenabled(), gc.get_freeze_count()) == (enabled, frozen)
    assert not entered and not graph.capturing
