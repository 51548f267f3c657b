"""The graph primitive every strategy builds on: real CUDA graphs, or the CPU emulator.

A :class:`GraphPool` is one generation of graphs: a shared memory pool and one capture
stream. ``pool.graph()`` makes a graph of the pool's kind; ``graph.capture(fn, *args)``
records ``fn`` and returns its outputs; ``graph.replay()`` runs the recorded device work
again. ``begin()``/``end()`` capture a segment around arbitrary code (breakable capture
uses them to close and reopen segments around eager breaks).

Contract, the same for both kinds (``tests/core/test_graph_semantics.py`` pins it):

- replay reads the tensors the region read at capture: copy new contents into them
  (static inputs); a tensor object created later is never seen;
- the outputs are the tensors returned at capture, overwritten by every replay, and
  hold garbage until the first replay;
- Python in the region (side effects, scalars, control flow) runs at capture only;
- every tensor a graph uses must stay alive as long as the graph (the emulator holds
  them; a CUDA graph does not: keep them);
- graphs of one pool replay one at a time, in any order, but on CUDA share memory: a
  later capture may put its outputs in blocks an earlier graph of the pool uses as
  scratch, so read (or copy) a graph's outputs before another graph of the pool replays
  (the emulator never reuses a block, so it cannot show this);
- random ops draw fresh values on each replay (from the device's default generator: a
  random op given another one raises :class:`graphcap.errors.CaptureError`);
- host synchronisations in the region raise :class:`graphcap.errors.CaptureError`,
  and leave the tensors and the model as they were before the capture (a region that
  catches the error fails at ``end()``: the capture was invalidated); a tensor the
  region made and kept (on a module) holds garbage, as nothing of the capture ran.

Example::

    pool = new_pool(x.device)
    graph = pool.graph()
    with pool.warmup():
        model(x)                      # lazy init and autotuning happen outside capture
    y = graph.capture(model, x)       # x is now a static input
    x.copy_(next_x); graph.replay()   # y holds model(next_x)
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from graphcap import compat, env
from graphcap.core import emulated
from graphcap.core.cuda_graph import CudaGraph, before_capture, touch_blas
from graphcap.core.emulated import EmulatedGraph
from graphcap.core.graph_base import Graph
from graphcap.errors import UnsupportedStrategy

__all__ = ["CudaGraph", "EmulatedGraph", "GraphPool", "before_capture", "graph_kind", "new_pool"]

_KINDS = ("cuda", "emulated")


def capturing() -> bool:
    """Whether this thread is inside a graph capture: a CUDA capture on its current
    stream, or the emulator's."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return True
    return emulated.recording()


def graph_kind(device: torch.device | str) -> str:
    """'cuda' for CUDA tensors, else 'emulated'; ``GRAPHCAP_GRAPH`` overrides."""
    device = torch.device(device)
    forced = env.settings().graph
    if forced and forced not in _KINDS:
        raise UnsupportedStrategy(
            f"GRAPHCAP_GRAPH={forced!r} is not a graph kind: use one of {_KINDS} or unset it")
    if forced == "cuda" and device.type != "cuda":
        raise UnsupportedStrategy(
            f"GRAPHCAP_GRAPH=cuda needs CUDA tensors, got device {device}: unset it to "
            "use the emulator")
    if forced:
        return forced
    return "cuda" if device.type == "cuda" else "emulated"


def _one_block_splits() -> bool:
    """Whether the allocator splits one large free block among smaller requests: not
    with ``max_split_size_mb`` (it gives no block past that size to a smaller request)
    nor ``expandable_segments`` (segments grow in place) in PYTORCH_CUDA_ALLOC_CONF."""
    conf = env.settings().alloc_conf
    settings = dict(part.split(":", 1) for part in conf.replace(" ", "").split(",")
                    if ":" in part)
    return ("max_split_size_mb" not in settings
            and settings.get("expandable_segments", "False").lower() != "true")


class GraphPool:
    """One memory pool and one capture stream shared by a generation of graphs.

    Graphs of one pool may share memory (on CUDA, blocks a capture freed are reused by
    later captures of the pool, for their scratch and their outputs alike): replay them
    one at a time, read a graph's outputs before another graph of the pool replays (an
    earlier graph's replay may overwrite a later one's), and keep every output alive as
    long as its graph (a dropped one's blocks go to later captures, which its replays
    then overwrite).
    """

    def __init__(self, device: torch.device | str | None = None, kind: str | None = None):
        device = torch.device(device if device is not None else "cpu")
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.kind = kind or graph_kind(device)
        if self.kind not in _KINDS:
            raise UnsupportedStrategy(f"graph kind {self.kind!r}: use one of {_KINDS}")
        if self.kind == "cuda" and device.type != "cuda":
            raise UnsupportedStrategy(f"CUDA graphs need a CUDA device, got {device}")
        self._graphs: weakref.WeakSet = weakref.WeakSet()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._mempools: list = []
        self._anchors: list = []
        self._captured_into = False
        self._left_cache = False  # a warm-up after a capture left blocks outside the pool
        self.handle = None
        self._workspace_pool = None
        self.sized_bytes = 0  # the block the first warm-up gave the pool (_size_from)
        if self.kind == "cuda":
            self._new_cuda_pool()

    @property
    def emulated(self) -> bool:
        return self.kind == "emulated"

    def _new_cuda_pool(self) -> None:
        # The MemPool keeps the device allocator's pool alive between graphs; the anchor
        # graph does the same for the host allocator's record of it (torch 2.11 asserts
        # on a capture into a pool all of whose graphs have died).
        self._mempools.append(compat.new_mempool(self.device))
        self.handle = compat.mempool_id(self._mempools[-1])
        self._anchors.append(compat.anchor_graph(self.device, self.handle, self.stream))
        self._captured_into = False  # no graph of ours has captured into this pool yet
        self.sized_bytes = 0

    def begin_capture(self) -> None:
        """A graph of this pool begins a capture (on the pool's stream): the pool's
        cuBLAS workspace is its own from now on, and later warm-ups allocate outside it."""
        self.own_cublas_workspace()
        self._captured_into = True

    def capture_failed(self) -> None:
        """A capture CUDA refused: torch 2.11's host allocator refuses later captures on
        that pool id ("already recording", "use_count > 0"), so the pool moves on to a
        fresh one (graphs captured before keep theirs)."""
        self._new_cuda_pool()

    def own_cublas_workspace(self) -> None:
        """Before the first capture into a memory pool: make cuBLAS allocate the
        workspace its captured matmuls use inside that pool.

        cuBLAS keeps one workspace per stream and a captured matmul bakes in its
        address. Left to itself, the workspace of the capture stream is born in eager
        warm-up, outside the pool, and anyone who clears cuBLAS's workspaces later
        (torch.compile's ``mode="reduce-overhead"``, on every recording) frees it under
        the graphs. Cleared here, once per pool (again would free the workspace the
        pool's earlier graphs use), the workspace lives in the pool, which outlives its
        graphs.
        """
        if self._workspace_pool != self.handle:
            compat.clear_cublas_workspaces()
            self._workspace_pool = self.handle

    def graph(self) -> Graph:
        """A new, empty graph of this pool's kind."""
        graph = CudaGraph(self) if self.kind == "cuda" else EmulatedGraph(self)
        self._graphs.add(graph)
        return graph

    def graphs(self) -> list[Graph]:
        """The graphs of this pool still alive."""
        return list(self._graphs)

    @contextlib.contextmanager
    def warmup(self, sizes: bool = False):
        """Run eager warm-up on the capture stream (lazy init, autotuning, JIT).

        On CUDA graphs, until the pool's first capture, its allocations come from the
        pool too: the blocks the first (largest) warm-up frees are the ones the capture
        that follows takes, instead of a second cache of that size held for the capture
        stream outside the pool. Not after: a tensor a later warm-up keeps (a library's
        lazily made buffer, an eager break's output) could sit in blocks an earlier graph
        uses as scratch and be overwritten by its replay.

        ``sizes=True`` (the warm-up of the first, largest shape, before the pool's first
        capture): the warm-up runs outside the pool instead, and sizes it
        (:meth:`_size_from`). The peak is read from the allocator's statistics, so the
        pool is sized only when the warm-up's peak is the process's highest since its
        last ``torch.cuda.reset_peak_memory_stats()``; otherwise ``sized_bytes`` stays 0
        and the pool grows as its captures ask."""
        if self.stream is None:
            yield
            return
        sizes = (sizes and self.kind == "cuda" and not self._captured_into
                 and compat.routes_to(self._mempools[-1]) and _one_block_splits())
        before = self._before_sizing() if sizes else None
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        into = compat.allocate_to(self._mempools[-1], self.device) \
            if self._mempools and not self._captured_into and not sizes \
            else contextlib.nullcontext()
        try:
            with torch.cuda.stream(self.stream), into:
                yield
        finally:  # a warm-up that raised still orders later work after what it launched
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        if sizes:
            self._size_from(before)
        elif self._captured_into:
            self._left_cache = True  # its freed blocks stay cached outside the pool

    def release_cache(self) -> None:
        """After a build: hand back to the device the blocks that warm-ups after the
        pool's first capture left cached outside it (for the capture stream, which no
        later eager work uses): tc_piecewise and ``warmup="every"`` warm every shape
        (performance-history item 36). The pool's own blocks stay: its graphs hold them.
        A no-op when no such warm-up ran (and on the emulator)."""
        if not self._left_cache:
            return
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        self._left_cache = False

    _LARGE = "allocated_bytes.large_pool."

    def _before_sizing(self) -> dict:
        """The allocator's large-block figures before a sizing warm-up, and the bytes of
        the capture stream's cuBLAS workspace (made here by a tiny matmul if the stream
        has none yet: the capture makes it again, inside the pool)."""
        stats = torch.cuda.memory_stats(self.device)
        with torch.cuda.stream(self.stream):
            touch_blas(self.device)
        made = torch.cuda.memory_stats(self.device)[self._LARGE + "current"]
        return {"peak": stats[self._LARGE + "peak"],
                "workspace": made - stats[self._LARGE + "current"]}

    def _size_from(self, before: dict) -> None:
        """After the first warm-up: empty the allocator cache the warm-up left, then give
        the pool one free block of the warm-up's transient peak of large allocations
        (over 1 MiB: what the pool serves from large segments) plus the capture
        stream's cuBLAS workspace. The captures split it (best fit), so the pool holds
        about the peak its graphs need, not the allocator's eager layout of segments
        (performance-history item 30). When an earlier, higher peak hides the
        warm-up's, the pool is left to grow as the captures ask; so it does for what a
        capture keeps that its warm-up did not free (large outputs it returns).

        cuBLAS's workspaces are dropped here (once per pool, as
        :meth:`own_cublas_workspace` would at the first capture) and, where the pool is
        sized, the capture stream's is made anew at the head of the block: made by the
        capture's first matmul, it would sit wherever that matmul finds the block,
        splitting the rest in two (unsized, that matmul makes it, inside the pool)."""
        stats = torch.cuda.memory_stats(self.device)
        transient = stats[self._LARGE + "peak"] - stats[self._LARGE + "current"]
        measured = stats[self._LARGE + "peak"] > before["peak"]
        self.own_cublas_workspace()  # the first capture then clears them no more
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        nbytes = transient + before["workspace"]
        if not measured or nbytes <= 0:
            return
        with torch.cuda.stream(self.stream), \
                compat.allocate_to(self._mempools[-1], self.device):
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        del block  # a free block of the pool, on the capture stream
        self.sized_bytes = nbytes
        self.make_blas_workspace()  # the block's head

    def make_blas_workspace(self) -> None:
        """This thread's cuBLAS handles (a handle made inside a capture fails) and the
        capture stream's workspace, inside the pool where torch can route allocations
        to it (:func:`touch_blas` on the capture stream): made on another stream, a
        workspace would stay outside the pool, held for the process."""
        with torch.cuda.stream(self.stream), \
                compat.allocate_to(self._mempools[-1], self.device):
            touch_blas(self.device)

    def _segments(self) -> list[dict]:
        ids = {compat.mempool_id(p) for p in self._mempools}
        return [seg for seg in torch.cuda.memory.memory_snapshot()
                if tuple(seg.get("segment_pool_id", ())) in ids]

    def bytes(self) -> int:
        """Memory held by this pool's graphs (CUDA: the pool's segments)."""
        if self.kind == "cuda":
            return sum(seg["total_size"] for seg in self._segments())
        return sum(g.bytes_held for g in self._graphs)

    def breakdown(self) -> dict:
        """CUDA: where the pool's bytes are: ``segments`` (count), ``reserved`` (their
        bytes), ``live`` (bytes of blocks a tensor still holds, e.g. a workspace or a
        buffer a graph keeps; the rest is graph scratch), ``largest_segment``."""
        if self.kind != "cuda":
            return {"reserved": self.bytes()}
        segs = self._segments()
        return {"segments": len(segs), "reserved": sum(s["total_size"] for s in segs),
                "live": sum(b["size"] for s in segs for b in s["blocks"]
                            if b["state"].startswith("active")),
                "largest_segment": max((s["total_size"] for s in segs), default=0)}


def new_pool(device: torch.device | str | None = None, kind: str | None = None) -> GraphPool:
    """A pool for graphs of tensors on ``device`` (kind from the device and GRAPHCAP_GRAPH)."""
    return GraphPool(device, kind)
