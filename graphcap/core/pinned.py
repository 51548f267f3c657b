"""Host rows that asynchronous copies read, rewritten in turn with no host sync a call.

A call writes its host values (request offsets, positions, request slots) into the next
of ``rows`` pinned buffers of one shape, through numpy (no torch op, no allocation), and
copies that buffer to the device. A round of buffers shares one CUDA event, recorded
once the round's last copy is issued and waited for before the next round's first
write, so a buffer is never rewritten while a copy that reads it may be pending; one
event a call cost more host time than the replay it fed (performance-history item 34).
On the CPU there is one buffer and copies are synchronous.

The copies that read a :class:`HostRows` are issued on its device's current stream, as
one runner's calls and replays are, and the event is recorded there; a round whose last
buffer was taken but never copied (its call raised first) is covered by an event recorded
when the next round starts.
"""

from __future__ import annotations

import torch

HOST_BUFFERS = 8  # buffers a round, which shares one event


class HostRows:
    """``rows`` host buffers of ``shape`` and ``dtype`` for copies to ``device``, pinned
    there when it is CUDA: ``take()`` the next one's index, write ``arrays[i]`` (or read
    ``tensors[i]``), issue its copies, then ``copied()``."""

    def __init__(self, rows: int, shape: tuple[int, ...], dtype: torch.dtype, device):
        device = torch.device(device)
        pinned = device.type == "cuda"
        host = torch.zeros(rows if pinned else 1, *shape, dtype=dtype, pin_memory=pinned)
        self.device = device  # its copies run on this device's current stream
        self.tensors = list(host)
        self.arrays = list(host.numpy())  # written in place, no torch op
        self._event = torch.cuda.Event() if pinned else None
        self._turn = 0  # the buffer the next take() hands out
        self._open = False  # a round's last buffer handed out, its copies not issued yet
        self._heads: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def head(self, turn: int, count: int) -> tuple[torch.Tensor, ...]:
        """Buffer ``turn``'s rows along its first dim, each cut to its first ``count``
        columns: views made once (slicing costs host time a launch waits for)."""
        key = (turn, count)
        views = self._heads.get(key)
        if views is None:
            views = self._heads[key] = tuple(row[:count] for row in self.tensors[turn])
        return views

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensors[0].shape)

    def take(self) -> int:
        """The next buffer's index; a round's first waits for the round before's copies."""
        turn = self._turn
        if turn == 0 and self._event is not None:
            if self._open:  # the last round's last copy was never issued: cover the rest
                self._record()
            self._event.synchronize()
        self._turn = (turn + 1) % len(self.tensors)
        self._open = self._turn == 0 and self._event is not None
        return turn

    def copied(self) -> None:
        """The copies reading the buffer taken last are issued: at a round's end, the
        round's event is recorded after them."""
        if self._open:
            self._record()

    def _record(self) -> None:
        # On the stream the copies to the device ran on, whichever device is current.
        self._event.record(torch.cuda.current_stream(self.device))
        self._open = False


__all__ = ["HOST_BUFFERS", "HostRows"]
