"""Typed errors of graphcap. Each message names what was wrong and what to do."""

from __future__ import annotations


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


class UnsupportedStrategy(GraphcapError):
    """A strategy, backend or device combination that graphcap cannot run."""


class BadBatch(GraphcapError, ValueError):
    """A runner call rejected before any replay; the runner stays usable."""


class OpInputError(GraphcapError, ValueError):
    """Bad input to an op, caught before any kernel launch."""


class BackendUnavailable(GraphcapError, RuntimeError):
    """A requested kernel or attention backend cannot run here; the message says why."""
