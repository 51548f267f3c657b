"""The breakable strategy: graph segments with eager breaks (``@eager_on_graph``)."""

from __future__ import annotations

import functools

import torch

from graphcap.breakable.graph import BreakableCapture, BreakableStrategy, DebugStrategy
from graphcap.core.breaks import run_maybe_as_break


def eager_on_graph(fn):
    """Mark ``fn`` to run eagerly between graph segments under ``strategy="breakable"``.

    Outside a breakable capture (and under torch.compile's tracing) it is a plain call.
    During capture it closes the current segment, runs ``fn`` once, and opens a new one;
    every replay calls ``fn`` again on the same argument tensors and copies its result
    into graphcap's copies of what it returned at capture, which the next segment reads.
    So ``fn`` must return tensors of the same shapes each time (or write into an ``out``
    it is given, or a module's tensor, and return it), and may do anything a graph cannot:
    host syncs, Python control flow on data, host-side libraries. A replay runs none of
    the forward's Python: ``fn`` reads Python state (a module's attribute) as the capture
    left it, and the forward reads what ``fn`` leaves in Python at capture only; pass
    what varies as arguments and results (docs/strategies.md, breakable).

        @graphcap.eager_on_graph
        def route(logits):
            return logits.argmax(-1).cpu().cuda()   # a host round trip, fine here
    """

    if isinstance(fn, (staticmethod, classmethod)):  # marked above the descriptor
        return type(fn)(eager_on_graph(fn.__func__))
    if not callable(fn):
        raise TypeError(f"eager_on_graph marks a function, got {fn!r}: write "
                        "@graphcap.eager_on_graph above a def")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.compiler.is_compiling():  # Dynamo traces it; no breakable capture there
            return fn(*args, **kwargs)
        return run_maybe_as_break(fn, args, kwargs)

    wrapper.__graphcap_eager_on_graph__ = True
    return wrapper


__all__ = ["BreakableCapture", "BreakableStrategy", "DebugStrategy", "eager_on_graph"]
