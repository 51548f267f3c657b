"""Arrival counters that outlive a launch: zero between launches, so that a split launch
(the split-K linear, split decode attention) needs no zeroing kernel before it.

A split launch's programs count their arrivals per block (a linear's column block, a
decode row's head block); the last to arrive merges the partials and sets its block's
counter back to zero. One int32 buffer per (device,
stream) serves every launch on that stream, one after another, as cuBLAS's workspace
does. A graph captured on a stream keeps that stream's buffer, so graphs captured on one
stream must not replay concurrently on two (graphs sharing a pool must not either). torch
hands out its side streams from a small pool, so two graph pools may capture on one
stream: replaying graphs of different runners concurrently on two streams is then unsafe,
as it is for cuBLAS's per-stream workspace.

Where the buffer lives matters. Made inside a graph pool (a capture, a warm-up routed to
the pool, torch.compile's cudagraph trees), it would be scratch of earlier graphs of that
pool or a live block the pool's owner does not know of (cudagraph trees refuse those).
So it is made once, zeroed, on a helper thread's default stream: pools route only the
capturing stream's or the routing thread's allocations, never those of another thread.
graphcap's captures make their stream's buffer before they begin
(:func:`graphcap.core.graphs.before_capture`), whatever shapes ran before; a capture by
other means (``torch.cuda.graph``, cudagraph trees) on a stream that has no buffer yet
makes the caller fall back to counters of its own, zeroed in the graph.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from graphcap.compat.imports import sigint_held
from graphcap.core import graphs
from graphcap.opsdb.triton.common import pdl_start

CAPACITY = 1024  # column blocks a launch may count: split launches have fewer than the SMs

_BUFFERS: dict[tuple, torch.Tensor] = {}
_LOCK = threading.Lock()


def _where(device: torch.device) -> tuple[torch.device, tuple]:
    """``device`` with its index, and the key of its current stream's buffer."""
    if device.type != "cuda":
        return device, (device.type, device.index)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index), (index, torch.cuda.current_stream(index).cuda_stream)


def _made_elsewhere(device: torch.device) -> torch.Tensor:
    """A zeroed buffer allocated on a fresh thread (outside every pool of this one)."""
    made: list = []

    def make() -> None:
        try:
            buffer = torch.zeros(CAPACITY, dtype=torch.int32, device=device)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            made.append(buffer)
        except BaseException as error:  # re-raised on the calling thread
            made.append(error)

    # Ctrl-C held back until the worker is done: on Python 3.11 a join it interrupts can
    # mark the thread stopped while it still runs, and a process exiting then aborts
    # inside the worker's torch call.
    with sigint_held():
        worker = threading.Thread(target=make, name="graphcap-counters")
        worker.start()
        worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    return made[0]


def persistent(device: torch.device, blocks: int) -> torch.Tensor | None:
    """The current stream's zeroed counters for a launch of ``blocks`` column blocks, or
    None where the caller must bring its own: more blocks than :data:`CAPACITY`, or a
    capture in progress on a stream that has none yet (making them there would put them
    in the capture's pool)."""
    if blocks > CAPACITY:
        return None
    device, key = _where(device)
    buffer = _BUFFERS.get(key)
    if buffer is not None:
        return buffer
    if device.type == "cuda":
        with torch.cuda.device(device):
            if torch.cuda.is_current_stream_capturing():
                return None
    with _LOCK:
        if key not in _BUFFERS:
            _BUFFERS[key] = _made_elsewhere(device)
    return _BUFFERS[key]


@triton.jit
def _zero_kernel(C, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """C[:n] = 0: the counters of a PDL launch (a memset node between two kernels would
    end their programmatic edge)."""
    pdl_start(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(C + offs, tl.zeros([BLOCK], dtype=tl.int32), mask=offs < n)


def zeroed(device: torch.device, blocks: int, launch: dict) -> torch.Tensor:
    """Zeroed counters for a launch of ``blocks`` blocks with keyword arguments
    ``launch`` (``common.pdl_args``): the stream's persistent ones, else (a capture's
    first split launch on its stream, or very many blocks) counters of this launch's own,
    zeroed before it (by a PDL kernel under PDL)."""
    counts = persistent(device, blocks)
    if counts is not None:
        return counts
    if launch["PDL"]:
        counts = torch.empty(blocks, dtype=torch.int32, device=device)
        _zero_kernel[(triton.cdiv(blocks, 1024),)](counts, blocks, BLOCK=1024, **launch)
        return counts
    return torch.zeros(blocks, dtype=torch.int32, device=device)


def check_zero() -> list[str]:
    """The buffers holding a non-zero counter (a launch that did not finish, or a misuse):
    for tests, never on a hot path (it reads the device)."""
    return [str(key) for key, buffer in _BUFFERS.items() if bool(buffer.any())]


def _for_capture(device: torch.device) -> None:
    """Before a graphcap capture on the current stream: its buffer, made now, outside
    the capture. Without it a capture whose first shape ran no split launch (a largest
    shape with too many rows for the fused kernel) zeroed counters in every replay."""
    persistent(device, 1)


graphs.before_capture(_for_capture)

__all__ = ["CAPACITY", "check_zero", "persistent", "zeroed"]
