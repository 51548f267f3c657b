"""The interface both graph kinds implement (see :mod:`graphcap.core.graphs`)."""

from __future__ import annotations

import abc


class Graph(abc.ABC):
    """One captured graph: ``begin``/``end`` around a region (or ``capture(fn)``), then
    ``replay``. Both kinds share this contract; :mod:`graphcap.core.graphs` states it."""

    emulated: bool

    @abc.abstractmethod
    def begin(self) -> None:
        """Start capturing on the pool's stream and memory."""

    @abc.abstractmethod
    def end(self) -> None:
        """Finish the capture started by ``begin``."""

    @abc.abstractmethod
    def abort(self, exc: BaseException) -> BaseException:
        """End a capture whose region raised ``exc``; return the error to raise."""

    @abc.abstractmethod
    def replay(self) -> None:
        """Run the captured device work again on the captured tensors."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Drop the capture and the memory it held."""

    _segments = 0  # captures ended since the last reset
    _bytes = 0  # CUDA: memory the pool reserved during capture; emulator: new storages

    @property
    def captured(self) -> bool:
        """True once a capture has ended."""
        return self._segments > 0

    @property
    def bytes_held(self) -> int:
        """Memory this graph's capture added to its pool."""
        return self._bytes

    def capture(self, fn, *args, **kwargs):
        """Capture ``fn(*args, **kwargs)`` as this graph and return its outputs.

        The outputs hold garbage until the first ``replay()``; each replay overwrites
        them. On a host synchronisation the capture is abandoned, memory is left as it
        was, and ``CaptureError`` names the operation and the source line.
        """
        self.begin()
        try:
            out = fn(*args, **kwargs)
        except BaseException as exc:
            err = self.abort(exc)
            if err is exc:
                raise
            raise err from exc
        self.end()
        return out
