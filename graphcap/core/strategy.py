"""What a capture strategy gives the runner: how one shape is captured, and replayed.

The runner owns everything else (shapes, buffers, metadata, padding, fallback). A
strategy captures the runner's forward function of one shape and returns a
:class:`Captured`: the replay and what it is made of. ``graphcap.api.STRATEGIES`` names
them all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from graphcap.core.graphs import GraphPool


@dataclass
class Captured:
    """One shape's capture: ``replay()`` reruns it. ``segments``: graphs replayed per
    call; ``breaks``: functions run eagerly between them (a replay with breaks runs Python,
    in the shape's forward context); ``splits_in_graph``: split ops (attention) captured
    inside a graph."""

    replay: Callable[[], None]
    segments: int = 1
    breaks: int = 0
    splits_in_graph: int = 0


class Strategy:
    """How one forward is captured for one shape (``name`` is what users pass as
    ``strategy=``). ``captures = False`` (eager) makes the runner run the model on every
    call."""

    name = "base"
    debug = False  # the strategy's debug mode (breakable: the forward as one eager break)
    captures = True
    # True when ``watch`` needs the runner's warm-up forward of every shape (the runner
    # then warms each one); otherwise only the first shape is warmed up.
    warms_every_shape = False
    # False when ``capture`` records no CUDA graph into the pool (debug runs the capture
    # function eagerly), or when warm-ups compile (their peak is no graph's): the runner
    # then does not size the pool from the first warm-up.
    sizes_pool = True

    def watch(self, key: Any):
        """A context around the runner's warm-up forward of shape ``key``, the call just
        before ``capture``: a strategy may observe it (default: nothing)."""
        return contextlib.nullcontext()

    def capture(self, fn: Callable[[], Any], key: Any, pool: GraphPool) -> Captured:
        raise NotImplementedError


class EagerStrategy(Strategy):
    """No graphs: every call runs the model (the baseline)."""

    name = "eager"
    captures = False
