"""What a capture backend gives the runner: one replayable entry per shape key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from graphcap.core.graphs import GraphPool


@dataclass
class Captured:
    """One shape's capture: ``replay()`` reruns it; ``outputs`` are what the captured
    function returned (rewritten by every replay)."""

    key: Any
    outputs: Any
    replay: Callable[[], None]
    segments: int = 1
    breaks: int = 0
    graphs: list = field(default_factory=list)

    @property
    def bytes_held(self) -> int:
        return sum(g.bytes_held for g in self.graphs)


class CaptureBackend:
    """How one forward is captured for one shape; the runner owns everything else.
    ``captures = False`` (eager) makes the runner run the model on every call."""

    strategy = "base"
    captures = True

    def capture(self, fn: Callable[[], Any], key: Any, pool: GraphPool) -> Captured:
        raise NotImplementedError


class EagerBackend(CaptureBackend):
    """No graphs: every call runs the model (the baseline)."""

    strategy = "eager"
    captures = False
