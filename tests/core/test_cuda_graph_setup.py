"""A CUDA graph whose capture set-up fails (out of memory making the pool's cuBLAS
workspace) gives back what it took: the garbage collector and the current stream; the
garbage collector stays frozen while any thread's capture runs. The CUDA calls are
replaced here so that the failure can be made on a machine without one."""

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


def test_the_garbage_collector_stays_frozen_until_the_last_of_overlapping_captures_ends():
    # Two threads' captures overlap and the first to begin ends first: gc is the
    # process's, so the other capture must not find it enabled under it.
    enabled, frozen = gc.isenabled(), gc.get_freeze_count()
    first, second = cuda_graph._FrozenGC(), cuda_graph._FrozenGC()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled() and gc.get_freeze_count() > 0
    second.__exit__(None, None, None)
    assert (gc.isenabled(), gc.get_freeze_count()) == (enabled, frozen)
