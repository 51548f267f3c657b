"""What ``graphcap.capture`` takes besides the model and the strategy: :class:`CaptureConfig`.

    config = graphcap.CaptureConfig(max_tokens=512, max_requests=4, attention="triton")
    runner = graphcap.capture(model, "full", config)
    other = graphcap.capture(model, "breakable", config, debug=True)  # one field changed

Each option may also be given as a keyword of ``capture`` (``capture(model, "full",
max_tokens=512)``); keywords replace the config's fields. A config is checked where
it is made for what needs no model (values of ``warmup`` and ``on_change``); what an
option means for a strategy or a kind of input is checked by ``capture``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from graphcap.core.checks import boolean, progress_option
from graphcap.core.inputs import Inputs

WARMUP = ("first", "every")
ON_CHANGE = ("recapture", "error")


@dataclass(frozen=True)
class CaptureConfig:
    """The options of a capture (docs/strategies.md says what each does).

    Shapes: ``buckets`` (default the ladder to ``max_tokens``, 2048; for an inputs object
    over a paged cache, the shapes its calls can fill: for steps of ``k`` tokens per
    request ``k`` times the decode batch ladder to the request slots, or to ``max_tokens
    // k`` requests where given; for prefill the ladder to ``max_tokens``, else to what
    its slots hold, at most 2048). Prefill models:
    ``max_requests`` slots (default ``max_tokens // 512``), ``attention`` backend,
    ``check_inputs`` (token ids and positions checked on every call). ``inputs``: what the
    model takes (default: its declaration, :func:`graphcap.api.inputs_of`), or an
    :class:`~graphcap.core.inputs.Inputs` object. ``debug`` (breakable): the forward as one
    eager break; ``compiler`` (tc_piecewise): ``"eager"`` or ``"inductor"`` pieces.
    ``example_inputs`` (models of tensors): capture now, from these. ``fallback``: run a
    batch no shape holds eagerly (else refuse it); ``copy_outputs``: return copies of the
    static outputs; ``warmup``: ``"first"`` or ``"every"`` shape warmed up before its
    capture; ``on_change``: a model changed since capture is ``"recapture"``\\ d or an
    ``"error"``; ``progress``: a bar (True) or a callback ``(done, total)``."""

    max_tokens: int | None = None
    buckets: Any = None
    max_requests: int | None = None
    attention: str | None = None
    debug: bool = False
    fallback: bool = True
    copy_outputs: bool = True
    example_inputs: tuple | None = None
    compiler: str | None = None
    warmup: str = "first"
    progress: Any = None
    inputs: str | Inputs | None = None
    on_change: str = "recapture"
    check_inputs: bool = False

    def __post_init__(self):
        for name in ("debug", "fallback", "copy_outputs", "check_inputs"):
            boolean(getattr(self, name), name)
        progress_option(self.progress)
        if self.example_inputs is not None and not isinstance(self.example_inputs,
                                                              (tuple, list)):
            raise ValueError(f"example_inputs must be a tuple of the model's arguments "
                             f"(tensors), got {type(self.example_inputs).__name__}: write "
                             "(x,) for one")
        if self.warmup not in WARMUP:
            raise ValueError(f"warmup={self.warmup!r}: use 'first' (warm up the first shape, "
                             "capture the rest directly) or 'every' (warm up every shape)")
        if self.on_change not in ON_CHANGE:
            raise ValueError(f"on_change={self.on_change!r}: use 'recapture' (capture every "
                             "shape again when the model changed) or 'error' (raise "
                             "ModelChanged)")

    def with_options(self, options: dict) -> CaptureConfig:
        """This config with ``options`` (capture's keywords) replacing its fields; a name
        that is not a field is a ``TypeError`` naming the fields."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"capture() got unexpected options {unknown}: its options are "
                            f"CaptureConfig's fields, {sorted(names)}")
        return dataclasses.replace(self, **options) if options else self
