"""``CudaGraph``: a real CUDA graph of a :class:`~graphcap.core.graphs.GraphPool`, driven
with ``capture_begin``/``capture_end`` directly (see :mod:`graphcap.core.graphs` for the
contract both graph kinds keep)."""

from __future__ import annotations

import contextlib
import gc
import threading
from typing import TYPE_CHECKING

import torch

from graphcap import compat
from graphcap.core import hostsync
from graphcap.core.graph_base import Graph
from graphcap.errors import CaptureError

if TYPE_CHECKING:
    from graphcap.core.graphs import GraphPool

# Per-stream state that captured kernels bake in, as cuBLAS's workspace: functions of the
# device, run on the capture stream before each capture begins (outside the pool, so
# whatever they allocate is no scratch of the pool). The project's split-K counters
# (graphcap.opsdb.triton.counters) register here: a capture that found none for its
# stream would bring counters of its own and zero them inside every replay.
_STREAM_STATE: list = []


def before_capture(make) -> None:
    """Register ``make(device)``, called on the capture stream before every capture of
    a CUDA graph begins; it must be cheap when its state exists already."""
    if make not in _STREAM_STATE:
        _STREAM_STATE.append(make)


_THREAD = threading.local()


def on_replay(fn) -> bool:
    """While this thread captures a CUDA graph, run ``fn()`` on the host after every
    replay of that graph and return True; else return False. For host-side tallies of
    work a graph launches again on each replay (a TP group's count of collectives):
    Python in a captured region runs at capture only."""
    graph = getattr(_THREAD, "capturing", None)
    if graph is None:
        return False
    graph._on_replay.append(fn)
    return True


def touch_blas(device: torch.device) -> None:
    """One tiny matmul of cuBLAS's path and one of cuBLASLt's on the current stream: the
    thread's handles, and the stream's workspace, exist afterwards."""
    dtypes = [torch.float32]
    if torch.cuda.is_bf16_supported():
        dtypes.append(torch.bfloat16)
    for dtype in dtypes:
        probe = torch.ones(16, 16, dtype=dtype, device=device)
        torch.mm(probe, probe)


def _blas_handles(pool: GraphPool) -> None:
    """Make this thread's cuBLAS and cuBLASLt handles for the pool's device (once per
    thread, :meth:`GraphPool.make_blas_workspace`): torch makes them per thread, on a
    thread's first matmul, and creating one inside a capture fails
    (CUBLAS_STATUS_NOT_INITIALIZED), as when another thread did the warm-up."""
    ready = _THREAD.__dict__.setdefault("blas", set())
    if pool.device.index not in ready:
        pool.make_blas_workspace()
        ready.add(pool.device.index)


class _FrozenGC:
    """gc frozen and disabled during capture: a collection mid-capture can unload a
    Triton module a captured kernel still uses. gc is the process's: captures of several
    threads overlap, so the first to begin freezes it and the last to end gives it back
    as it was (the first to end, alone, would enable it under the others)."""

    _lock = threading.Lock()
    _open = 0  # captures inside the guard, of every thread
    _was_enabled = _froze = False

    def __enter__(self):
        with _FrozenGC._lock:
            if _FrozenGC._open == 0:
                _FrozenGC._was_enabled = gc.isenabled()
                # Freeze only if the application has not: unfreeze() would undo its own.
                _FrozenGC._froze = gc.get_freeze_count() == 0
                if _FrozenGC._froze:
                    gc.freeze()
                gc.disable()
            _FrozenGC._open += 1

    def __exit__(self, *exc):
        with _FrozenGC._lock:
            _FrozenGC._open -= 1
            if _FrozenGC._open:
                return
            if _FrozenGC._froze:
                gc.unfreeze()
            if _FrozenGC._was_enabled:
                gc.enable()


class CudaGraph(Graph):
    """``torch.cuda.CUDAGraph`` driven with ``capture_begin``/``capture_end`` directly.

    ``torch.cuda.graph`` synchronises and empties the allocator cache on every enter;
    graphcap captures many segments and shapes, so it calls the primitives itself.
    """

    emulated = False

    def __init__(self, pool: GraphPool):
        self.pool = pool
        self.device = pool.device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._stack: contextlib.ExitStack | None = None
        self._bytes = 0
        self._reserved_before = 0
        self._segments = 0
        self._on_replay: list = []

    @property
    def capturing(self) -> bool:
        return self._stack is not None

    def begin(self) -> None:
        """Begin capture on the pool's stream and memory pool."""
        if self._stack is not None:
            raise CaptureError("begin() called twice: end() the current capture first")
        if self._graph is not None:
            raise CaptureError("this graph is captured already: reset() it or make a new one")
        stack = contextlib.ExitStack()
        try:  # a set-up step that fails (out of memory) gives back the stream and gc
            stack.enter_context(torch.cuda.device(self.device))
            self.pool.stream.wait_stream(torch.cuda.current_stream(self.device))
            stack.enter_context(torch.cuda.stream(self.pool.stream))
            stack.enter_context(_FrozenGC())
            _blas_handles(self.pool)
            self.pool.begin_capture()
            for make in _STREAM_STATE:
                make(self.device)
            self._reserved_before = torch.cuda.memory_reserved(self.device)
            graph = torch.cuda.CUDAGraph()
        except BaseException:
            stack.close()
            raise
        try:
            graph.capture_begin(pool=self.pool.handle, capture_error_mode="thread_local")
        except BaseException:
            # capture_begin can fail after routing allocations to the pool: undo that.
            self._stack = stack
            self._close_failed_capture()
            raise
        self._graph, self._stack = graph, stack
        _THREAD.capturing = self

    def end(self) -> None:
        """End capture; the graph is ready to replay."""
        if self._stack is None:
            raise CaptureError("end() without begin()")
        _THREAD.capturing = None
        try:
            self._graph.capture_end()
        except RuntimeError as exc:
            self._close_failed_capture()
            raise hostsync.translate_cuda_failure(exc) from exc
        self._stack.close()
        self._stack = None
        torch.cuda.current_stream(self.device).wait_stream(self.pool.stream)
        self._bytes = torch.cuda.memory_reserved(self.device) - self._reserved_before
        self._segments = 1

    def abort(self, exc: BaseException) -> BaseException:
        """End a capture whose region raised; return the error to raise (translated
        when CUDA refused an operation, as-is otherwise)."""
        if self._stack is None:
            return exc
        try:
            self._graph.capture_end()
            invalidated = False
        except RuntimeError:
            invalidated = True
        self._close_failed_capture()
        if not isinstance(exc, CaptureError) and (
                invalidated or hostsync.is_capture_failure(exc)):
            err = hostsync.translate_cuda_failure(exc)
            err.__cause__ = exc
            return err
        return exc

    def _close_failed_capture(self) -> None:
        # A refused capture_end returns before the allocator stops routing allocations
        # to the pool: stop it (a no-op when capture_end got that far).
        compat.end_allocate_to_pool(self.device, self.pool.handle)
        self.pool.capture_failed()
        _THREAD.capturing = None
        self._on_replay = []
        self._graph = None
        self._stack.close()
        self._stack = None

    def replay(self) -> None:
        if self._graph is None or self._stack is not None:
            raise CaptureError("replay() needs a finished capture: capture a region first")
        self._graph.replay()
        for fn in self._on_replay:
            fn()

    def reset(self) -> None:
        if self._graph is not None:
            self._graph.reset()
        self._graph = None
        self._on_replay = []
        self._bytes = 0
        self._segments = 0
