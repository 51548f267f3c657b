"""One call at a time: what a runner's static buffers need when several threads call it.

A captured shape has one set of input, metadata and output buffers, so two calls must not
interleave: :class:`Serial` is a re-entrant lock around a call, and on CUDA it also orders
the devices' work. A call issued on another stream than the previous one waits for the
work that call left on its stream, so its copies into the static buffers cannot overtake
that replay (the lock alone orders the host, not the device).

    serial = Serial(device)
    with serial.held():
        serial.order()
        ...   # copy inputs in, replay, copy outputs out

The lock is taken and given back by its own C methods, in the caller's ``with``
statement, and whether this thread holds it is the lock's own record (no count beside
it): a Ctrl-C, which CPython delivers where a Python function begins or a call returns,
never leaves it held, nor a count that says a call still runs. (A context manager of
Python code would give it back in its ``__exit__``, where a Ctrl-C delivered as it begins
keeps it held while the traceback lives, or for good.)
"""

from __future__ import annotations

import threading

import torch

from graphcap import compat
from graphcap.core import graphs
from graphcap.errors import BadBatch, CaptureError


class Serial:
    """A re-entrant lock that, on CUDA, also orders consecutive holders' streams."""

    def __init__(self, device: torch.device):
        self._lock = threading.RLock()
        self._index = None
        if device.type == "cuda":
            self._index = device.index if device.index is not None else \
                torch.cuda.current_device()
        self._stream: tuple | None = None  # where the last holder issued its work

    def held(self) -> threading.RLock:
        """The lock, re-entrant, to hold in a ``with`` statement; a holder that replays
        or copies calls :meth:`order` first."""
        return self._lock

    def only(self, what: str) -> threading.RLock:
        """:meth:`held`, but refusing ``what`` (a runner's call or capture) where it would
        corrupt another: made while a graph captures (a captured model calls a runner),
        the outer graph would replay the runner's buffers with none of its checks
        (``CaptureError``); made inside a call of the same runner (an eager break or op of
        the model makes it), it would overwrite the buffers the outer call's graphs read
        (``BadBatch``)."""
        if graphs.capturing():
            raise CaptureError(
                f"{what} was made while a graph captures (a captured model calls a "
                "runner): the outer graph would replay the runner's buffers without its "
                "checks, and miss its recaptures. Call the runner's model itself in the "
                "captured forward")
        if self._lock._is_owned():  # this thread holds it: inside a call of the runner
            raise BadBatch(
                f"{what} was made inside a call of the same runner (an eager break or "
                "op of its model makes it): it would overwrite the input and output "
                "buffers the outer call's graphs read. Call the model itself there, or "
                "capture it a second time for the inner calls")
        return self._lock

    def order(self) -> None:
        """On CUDA, this holder's stream waits for the last holder's work, where it is
        another (a no-op elsewhere)."""
        if self._index is None:
            return
        stream = compat.current_stream_key(self._index)
        if self._stream is not None and stream != self._stream and \
                not torch.cuda.is_current_stream_capturing():
            # (A capture already began after the last holder's work: its stream waited
            # for the caller's, and it may not wait on work outside it.)
            compat.stream_of(stream).wait_stream(compat.stream_of(self._stream))
        self._stream = stream
