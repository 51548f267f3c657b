"""Breakable CUDA graph: capture op by op, close the segment at each eager break.

During capture a break handler is installed (``graphcap.core.breaks``). Each call of an
``@eager_on_graph`` function, or of a split op such as attention, ends the current graph
segment, runs the function once eagerly, records it, and begins a new segment on the same
pool and stream. Replay walks the record: segment, break, segment, ...

A break replays by calling its function again on the very argument objects of capture
(held strongly here: a weak reference let later captures reuse their memory and gave
silent wrong output in the field) and copying the fresh result into the output retained
at capture, so the next segment reads it at the address it captured.

A break whose function is *graphable* (a split op whose per-batch state lives in static
buffers: attention under a backend that runs with the runner's prepared metadata) does not
break at all: it runs inside the open segment and is captured with it, so a forward whose
every break is graphable is one graph per shape, as under full capture. The segment then
reads the state object the split op read at capture (the prepared metadata): the capture
lists each such object (``Captured.states``), and the runner replays the graphs only while
every one is still the current one (else it runs the forward eagerly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from graphcap.core.backend import CaptureBackend, Captured, note_state, states_current
from graphcap.core.breaks import break_handler
from graphcap.core.graphs import GraphPool
from graphcap.core.trees import tensor_leaves
from graphcap.errors import CaptureError


@dataclass
class Break:
    fn: Callable
    args: tuple
    kwargs: dict
    output: Any

    def replay(self) -> None:
        fresh = self.fn(*self.args, **self.kwargs)
        for kept, new in zip(tensor_leaves(self.output), tensor_leaves(fresh), strict=True):
            kept.copy_(new)


class BreakableCapture:
    """The segments and breaks of one shape, captured by running ``fn`` once."""

    def __init__(self, pool: GraphPool):
        self.pool = pool
        self.items: list = []  # Graph segments and Breaks, in replay order
        self.states: list[tuple[Callable[[], object], object]] = []  # (graphable, its state)
        self.in_graph = 0  # graphable split ops captured inside a segment
        self._segment = None
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None

    def _open(self) -> None:
        self._segment = self.pool.graph()
        self._segment.begin()

    def _close(self) -> None:
        segment, self._segment = self._segment, None
        segment.end()
        self.items.append(segment)

    def _on_break(self, fn, args, kwargs, graphable=None):
        state = graphable() if graphable is not None else None
        if state is not None:  # static state: captured inside the open segment
            self.in_graph += 1
            note_state(self.states, graphable, state)
            with break_handler(None):
                return fn(*args, **kwargs)
        self._close()
        # No handler inside a break: a break calling another marked function just runs it.
        with self.pool.warmup(), break_handler(None):  # the capture stream, no capture
            output = fn(*args, **kwargs)
        leaves = tree_flatten(output)[0]
        if any(not isinstance(x, torch.Tensor) and x is not None for x in leaves):
            name = getattr(fn, "__qualname__", repr(fn))
            raise CaptureError(
                f"eager break {name} returned a host value ({[type(x).__name__ for x in leaves]}"
                "): replay could only reuse the value of capture. Return tensors (e.g. "
                "torch.tensor on the device, or write into an out= tensor) instead")
        self.items.append(Break(fn, args, kwargs, output))
        self._open()
        return output

    def run(self, fn: Callable[[], Any]) -> Any:
        self._fn = fn
        self._open()
        try:
            with break_handler(self._on_break):
                out = fn()
        except BaseException as exc:
            if self._segment is not None:
                err = self._segment.abort(exc)
                self._segment = None
                if err is not exc:
                    raise err from exc
            raise
        self._close()
        self._outputs = out
        return out

    def current(self) -> bool:
        """True while every static state the segments read is the one they captured."""
        return states_current(self.states)

    def replay(self) -> None:
        """Segment, break, segment, ...; under another state object than the captured
        one (the segments would read its buffers) the function runs eagerly instead and
        its results are copied into the captured outputs."""
        if not self.current():
            fresh = self._fn()
            for kept, new in zip(tensor_leaves(self._outputs), tensor_leaves(fresh),
                                 strict=True):
                kept.copy_(new)
            return
        for item in self.items:
            item.replay()

    @property
    def graphs(self) -> list:
        """The segments."""
        return [i for i in self.items if not isinstance(i, Break)]


class BreakableBackend(CaptureBackend):
    """``strategy="breakable"``: segments between eager breaks, no compiler involved."""

    strategy = "breakable"

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        bcg = BreakableCapture(pool)
        out = bcg.run(fn)
        graphs = bcg.graphs
        return Captured(key, out, bcg.replay, segments=len(graphs),
                        breaks=len(bcg.items) - len(graphs), graphs=graphs,
                        states=bcg.states, splits_in_graph=bcg.in_graph)


class DebugBackend(CaptureBackend):
    """``debug=True`` / ``GRAPHCAP_DEBUG_CUDA_GRAPH=1``: the whole forward is one eager
    break, through the same runner path (padding, metadata, slicing) as a capture."""

    strategy = "breakable"
    captures_into_pool = False

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        out = fn()
        brk = Break(fn, (), {}, out)
        return Captured(key, out, brk.replay, segments=0, breaks=1)
