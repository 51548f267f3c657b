"""What a capture backend gives the runner: one replayable entry per shape key."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphcap.core.graphs import GraphPool


@dataclass
class Captured:
    """One shape's capture: ``replay()`` reruns it; ``outputs`` are what the captured
    function returned (rewritten by every replay).

    ``segments``: graphs replayed per call; ``breaks``: functions run eagerly between
    them; ``splits_in_graph``: split ops (attention) captured inside a graph. Those read
    per-batch state from static buffers: ``states`` lists ``(graphable, state)``, the
    state object each returned at capture, and the capture is valid only while every one
    is still current (:meth:`current`); else the caller runs the forward eagerly."""

    key: Any
    outputs: Any
    replay: Callable[[], None]
    segments: int = 1
    breaks: int = 0
    graphs: list = field(default_factory=list)
    states: list = field(default_factory=list)
    splits_in_graph: int = 0

    def current(self) -> bool:
        """True while every static state the graphs read is the one they captured."""
        return states_current(self.states)

    @property
    def bytes_held(self) -> int:
        return sum(g.bytes_held for g in self.graphs)


def states_current(states: list) -> bool:
    """True while each ``(graphable, state)`` pair's graphable still returns its state."""
    return all(graphable() is state for graphable, state in states)


def note_state(states: list, graphable: Callable[[], object], state: object) -> None:
    """Add ``(graphable, state)`` to a capture's ``states`` unless it is there already
    (every attention layer of a forward reads the same metadata object)."""
    if not any(g is graphable and s is state for g, s in states):
        states.append((graphable, state))


class CaptureBackend:
    """How one forward is captured for one shape; the runner owns everything else.
    ``captures = False`` (eager) makes the runner run the model on every call."""

    strategy = "base"
    captures = True
    # True when ``watch`` needs the runner's warm-up forward of every shape (the runner
    # then warms each one); otherwise only the first shape is warmed up.
    watches_warmup = False
    # False when ``capture`` records no CUDA graph into the pool (debug runs the capture
    # function eagerly): the runner then does not size the pool.
    captures_into_pool = True

    def watch(self, key: Any):
        """A context around the runner's warm-up forward of shape ``key``, the call just
        before ``capture``: a backend may observe it (default: nothing)."""
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], Any], key: Any, pool: GraphPool) -> Captured:
        raise NotImplementedError


class EagerBackend(CaptureBackend):
    """No graphs: every call runs the model (the baseline)."""

    strategy = "eager"
    captures = False
