"""Typed errors of graphcap. Each message names what was wrong and what to do."""

from __future__ import annotations

import traceback

import torch


class GraphcapError(Exception):
    """Base class of every error graphcap raises on purpose."""


class CaptureError(GraphcapError):
    """A region could not be captured in a graph (host sync, CUDA capture failure, misuse).

    ``op`` names the offending operation when it is known (``"aten.nonzero"``,
    ``"Tensor.item"``); ``site`` is the user's source line that issued it.
    """

    def __init__(self, message: str, *, op: str | None = None, site: str | None = None):
        super().__init__(message)
        self.op = op
        self.site = site


class RankError(CaptureError):
    """The ranks of a tensor-parallel group could not go on together: they disagreed on a
    call or a capture (the group stays usable), or a rank raised, closed the group or did
    not come in time (the group is closed: the message names which rank and why)."""


class UnsupportedStrategy(GraphcapError):
    """A strategy, backend or device combination that graphcap cannot run."""


class BadBatch(GraphcapError, ValueError):
    """A runner call rejected before any replay; the runner stays usable."""


class OpInputError(GraphcapError, ValueError):
    """Bad input to an op, caught before any kernel launch."""


class BackendUnavailable(GraphcapError, RuntimeError):
    """A requested kernel or attention backend cannot run here; the message says why."""


class KernelUnavailable(BackendUnavailable):
    """An op's kernel (``triton``, ``composite``, ...) cannot run here, or is no kernel
    of that op; the message names the kernels there are."""


class UnsupportedModel(GraphcapError, ValueError):
    """A model (or a feature of it) that graphcap cannot run as written: the message says
    what to change in the model."""


class ModelChanged(GraphcapError, RuntimeError):
    """The model is not the one the runner captured (a parameter or buffer replaced,
    moved or converted, a submodule swapped): its graphs would read memory the model no
    longer uses. ``changes`` lists what differs. Capture again (``runner.recapture()``)
    or update weights in place, which replays see."""

    def __init__(self, message: str, changes: list[str]):
        super().__init__(message)
        self.changes = changes


class ReplayError(GraphcapError, RuntimeError):
    """A replay could not reproduce its capture (an eager break returned tensors of other
    shapes or dtypes than at capture); nothing was written past the failing step, and the
    runner stays usable for calls that fit."""


class CacheFull(GraphcapError, RuntimeError):
    """A paged K/V cache has too few free pages (or request slots) for a request: the
    message says how many it needs and has. Release finished requests, or build the cache
    with more pages."""


class CacheTooLarge(GraphcapError, torch.OutOfMemoryError):
    """A paged K/V cache the device's memory cannot hold, refused before anything is
    allocated where the device says what is free (CUDA): the message says the bytes it
    needs, those free and what fits. ``need`` and ``free`` are bytes (``free`` None where
    the device does not say), ``pages`` the pages that fit (None where unknown). An
    ``OutOfMemoryError`` too, as torch's own allocation would have raised."""

    def __init__(self, message: str, *, need: int, free: int | None, pages: int | None):
        super().__init__(message)
        self.need, self.free, self.pages = need, free, pages


def clear_frames(error: BaseException, outside: BaseException | None = None) -> None:
    """Clear the locals of the frames ``error`` and the errors it was raised from or
    during (``__cause__``, ``__context__``, a group's) passed through, up to ``outside``
    (one the caller was handling, whose frames are the caller's): what they held goes
    now, while the tracebacks keep their lines."""
    seen, todo = {id(outside)}, [error]
    while todo:
        if (e := todo.pop()) is not None and id(e) not in seen:
            seen.add(id(e))
            traceback.clear_frames(e.__traceback__)
            todo += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
