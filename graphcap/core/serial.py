"""One call at a time: what a runner's static buffers need when several threads call it.

A captured shape has one set of input, metadata and output buffers, so two calls must not
interleave: :class:`Serial` is a re-entrant lock around a call, and on CUDA it also orders
the devices' work. A call issued on another stream than the previous one waits for the
work that call left on its stream, so its copies into the static buffers cannot overtake
that replay (the lock alone orders the host, not the device).

    serial = Serial(device)
    with serial:
        ...   # copy inputs in, replay, copy outputs out
"""

from __future__ import annotations

import contextlib
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
        self._depth = 0  # how often its holder holds it

    @contextlib.contextmanager
    def only(self, what: str):
        """Held as ``with serial``, but refusing ``what`` (a runner's call or capture)
        where it would corrupt another: made inside a call of the same runner (an eager
        break or op of the model makes it), it would overwrite the buffers the outer call's
        graphs read (``BadBatch``); made while a graph captures (a captured model calls a
        runner), the outer graph would replay the runner's buffers with none of its checks
        (``CaptureError``)."""
        with self:
            if graphs.capturing():
                raise CaptureError(
                    f"{what} was made while a graph captures (a captured model calls a "
                    "runner): the outer graph would replay the runner's buffers without its "
                    "checks, and miss its recaptures. Call the runner's model itself in the "
                    "captured forward")
            if self._depth > 1:
                raise BadBatch(
                    f"{what} was made inside a call of the same runner (an eager break or "
                    "op of its model makes it): it would overwrite the input and output "
                    "buffers the outer call's graphs read. Call the model itself there, or "
                    "capture it a second time for the inner calls")
            yield self

    def __enter__(self):
        self._lock.acquire()
        self._depth += 1
        if self._index is not None:
            try:
                stream = compat.current_stream_key(self._index)
                if self._stream is not None and stream != self._stream and \
                        not torch.cuda.is_current_stream_capturing():
                    # (A capture already began after the last holder's work: its stream
                    # waited for the caller's, and it may not wait on work outside it.)
                    compat.stream_of(stream).wait_stream(compat.stream_of(self._stream))
                self._stream = stream
            except BaseException:
                self.__exit__()
                raise
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        self._lock.release()
