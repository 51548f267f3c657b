"""What the compiled forward is doing now: one phase, set around each call.

``torch.compile(model, backend="sgl_piecewise")`` on its own runs in no phase: each piece
warms up, captures and replays per token count by itself (:class:`Phase.PIECES`'s
behaviour). Under ``graphcap.capture(..., strategy="tc_piecewise")`` the strategy sets the
phase of each call of the compiled forward:

- ``WARMUP``: the runner's warm-up of a shape; the call is recorded (a :class:`Watch`) to
  decide whether the shape can be captured as one graph;
- ``CAPTURE_WHOLE``: the shape captured as one graph, every piece inline
  (:class:`~graphcap.piecewise.whole.WholeCapture`);
- ``PIECES``: the shape captured, and replayed, piece by piece;
- ``EAGER``: any other call of the runner (its fallbacks): every piece runs eagerly.
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from typing import Any


class Phase(enum.Enum):
    PIECES = "pieces"
    WARMUP = "warmup"
    CAPTURE_WHOLE = "capture_whole"
    EAGER = "eager"


class Watch:
    """The record of a warm-up call: the compiled graph's ``Call`` once it ran."""

    call: Any = None


_PHASE: contextvars.ContextVar[tuple[Phase, Any] | None] = contextvars.ContextVar(
    "graphcap_piecewise_phase", default=None)
# The token count of the compiled graph's call running now (set by its forward).
_SIZE: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "graphcap_piecewise_size", default=None)


def current() -> tuple[Phase | None, Any]:
    """The phase and its detail (a Watch, a WholeCapture), or (None, None) outside any."""
    return _PHASE.get() or (None, None)


@contextlib.contextmanager
def phase(which: Phase, detail: Any = None):
    token = _PHASE.set((which, detail))
    try:
        yield detail
    finally:
        _PHASE.reset(token)


def current_size() -> int | None:
    return _SIZE.get()


def enter_size(size: int | None) -> contextvars.Token:
    """Set the token count of the compiled graph's call now running (:func:`exit_size`
    after it): a token, not a context manager, on every call's path."""
    return _SIZE.set(size)


def exit_size(token: contextvars.Token) -> None:
    _SIZE.reset(token)
