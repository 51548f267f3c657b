"""Where eager breaks hook in: the breakable strategy installs a handler during capture;
``@eager_on_graph`` functions and split ops (attention) call through it.

Kept in core so that opsdb (split ops) and user code (``@eager_on_graph``) reach the
breakable strategy without importing it. Outside a breakable capture, calls run plainly.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable

from graphcap.errors import ModelChanged

_HANDLER: contextvars.ContextVar[Callable | None] = contextvars.ContextVar(
    "graphcap_break_handler", default=None)


def run_maybe_as_break(fn: Callable, args: tuple, kwargs: dict,
                       static_state: Callable[[], object] | None = None):
    """Call ``fn`` as a break when a breakable capture is running, else plainly.

    ``static_state()`` (split ops) returns the object holding the static per-batch state
    ``fn`` reads now (attention: the runner's prepared metadata), or None when there is
    none: then the break may be captured as its own small graph, replayed while the same
    state object is current, instead of running eagerly."""
    handler = _HANDLER.get()
    if handler is None:
        return fn(*args, **kwargs)
    return handler(fn, args, kwargs, static_state)


def breakable_capture() -> bool:
    """Whether a breakable capture's handler is installed here (calls become breaks)."""
    return _HANDLER.get() is not None


def clear_handler() -> None:
    """Remove the handler from the current context (for contexts copied to replay later)."""
    _HANDLER.set(None)


@contextlib.contextmanager
def break_handler(handler: Callable | None):
    """Install ``handler(fn, args, kwargs, static_state)`` (None: none) for a block."""
    token = _HANDLER.set(handler)
    try:
        yield
    finally:
        _HANDLER.reset(token)


def changed_by_a_break(snapshot, on_change: str) -> Exception:
    """The refusal of a replay during which an eager break assigned a tensor to a slot of
    the model (``snapshot``, a ``ModelSnapshot``, no longer current): the graphs after it
    read the tensor of capture, so the call's result would be stale."""
    changes = snapshot.changes()
    return ModelChanged(
        f"an eager break changed {type(snapshot.model).__name__} during this call "
        f"({'; '.join(changes)}): the graphs after it read the tensors of capture, so its "
        "result would be theirs. Write such state in place (copy_); " + (
            "the next call captures again" if on_change == "recapture" else
            "then call runner.recapture()"), changes)
