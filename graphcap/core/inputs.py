"""The seam between the runner and what a model takes: :class:`Inputs` (and a validated
call, :class:`Batch`).

The runner captures shapes, picks a bucket, replays and slices; everything that depends
on what the model takes lives in an :class:`Inputs` object. graphcap's own kinds are in
:mod:`graphcap.inputs`, one file each: ``TensorInputs`` (``runner(*tensors)``, tensors
sharing dim 0, their shapes taken from the first call), ``PrefillInputs`` (requests
packed along dim 0, ``runner(input_ids, positions, seq_lens=[...])``, in request slots
whose unused ones are zero-length sentinels, per-shape attention metadata rewritten
before each replay), ``DecodeInputs`` and ``CachePrefillInputs`` (decode steps, and
prefill or extend, over a paged cache).

A kind of input of one's own subclasses :class:`Inputs` and is passed as
``graphcap.capture(model, inputs=MyInputs(...))``; the runner calls it through these
methods only:

- ``bind(model)``: the model the runner captures, once, before anything else (what a
  kind reads of it, e.g. its ``output_rows``);
- ``check(args, kwargs) -> Batch``: validate a call (``BadBatch`` before anything runs);
  ``check_example(args) -> Batch``: validate a capture's example, whose dtypes and
  shapes it then takes;
- ``allocate(max_tokens, batch)``: the static buffers, from the first call's batch when a
  kind needs one (``needs_batch``);
- ``prepare(bucket) -> state``: a shape's own state (prefill: its attention metadata);
- ``forward(model, bucket, state)``: the model on the static buffers (warm-up, capture);
- ``derive(state)``: device work on those buffers inside the captured region;
- ``stage(batch, bucket, state)``: a call's inputs into the buffers, before a replay;
- ``context(state)``: the forward context of what a replay runs eagerly;
- ``rows(bucket)`` and ``out_rows(batch)``: output rows of a shape and of a call;
- ``fits(batch)``: why a batch cannot replay a graph (or None); ``limits()`` says what
  bounds it, beside the buckets;
- ``eager(model, batch) -> run``: the model on the call, without graphs, prepared
  outside any mode (``run()`` runs it); graphcap's kinds pass a fallback copies of the
  call's tensors (:func:`call_copies`), as a replay passes its buffers, and the eager
  strategy the call's own;
- ``commit(batch)``: after the call's replay or eager run returned, what it wrote is
  state now (a paged cache counts the tokens written); a call that raised commits nothing;
- ``abandon(batch)``: a call that raised once staged or running (a replay, an eager run,
  its commit): part of it may have run (a paged cache keeps each request's tokens before
  the call's only);
- ``describe(batch)``: what the ranks of a split model agree on before a call;
- ``captured(states)``, ``report()``: what a capture showed, for ``runner.report()``;
  ``reset()``: before a capture, no static buffers; ``forget()``: after a capture that
  failed, or for a changed model, what it took from the call it came from, which
  ``remember(kept)`` takes back where a call refused before a recapture.

``graphcap.capture`` also asks it ``default_buckets(max_tokens)``: the shapes to capture
where no ``buckets`` are given, up to ``max_tokens`` where given (None: the token ladder),
and warns of buckets larger than its ``most_tokens``, which no call fills.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap.errors import UnsupportedModel


@dataclass
class Batch:
    """One validated call: its arguments, token count and request lengths (or None)."""

    args: tuple
    tokens: int
    lens: list[int] | None = None
    kwargs: dict = field(default_factory=dict)  # what the eager strategy passes on as is
    host: Any = None  # what a kind of input keeps of the call on the host, beside args
    staged: Any = None  # a kind's host tensor of the call's values, copied to it as one


class Inputs:
    """Static input buffers sliced per bucket, and the seam's defaults (no state)."""

    kind = "base"
    row_unit = "one row per token"
    needs_batch = False  # allocate() needs the first call's batch (its shapes)
    strategies: tuple[str, ...] | None = None  # the strategies it runs under (None: all)
    why_not = ""  # what the others lack, for the error
    most_tokens: int | None = None  # the most tokens a call brings (None: no bound)
    _runner: weakref.ref | None = None  # the live runner graphcap.capture made of it

    def __init__(self, device: torch.device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # as tensors name it: cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.buffers: list[torch.Tensor] = []
        # Per (live tokens, bucket): the buffers' rows a call fills and its padding rows
        # (slicing costs host microseconds, which the GPU waits for at small buckets).
        self._rows_of: dict[tuple[int, int], tuple[list, list]] = {}

    def bind(self, model) -> None:
        pass

    def reset(self) -> None:
        """No static buffers (what the inputs learned of the model's arguments stays)."""
        self.buffers = []
        self._rows_of.clear()

    def forget(self) -> Any:
        """After a capture that failed, or for a changed model: forget what it learned of
        the call it came from; returns that, for :meth:`remember`."""

    def remember(self, kept: Any) -> None:
        """Take back what :meth:`forget` returned, where nothing was learned since."""

    def check_example(self, args: tuple) -> Batch:
        """``check`` of the arguments of a call that a capture is to take its shapes from
        (``capture_all(example)``), not those of the last capture: refused, it leaves
        those, which the graphs of the last capture take."""
        kept = self.forget()
        try:
            return self.check(args, {})
        except BaseException:
            self.remember(kept)
            raise

    def prepare(self, bucket: int) -> Any:
        return None

    def derive(self, state) -> None:
        pass

    def context(self, state):
        return contextlib.nullcontext()

    def rows(self, bucket: int) -> int:
        return bucket

    def out_rows(self, batch: Batch) -> int:
        return batch.tokens

    def fits(self, batch: Batch) -> str | None:
        return None

    def commit(self, batch: Batch) -> None:
        pass

    def check_free(self) -> None:
        """``ValueError`` while a live runner holds this inputs object: its graphs read
        the object's buffers, which another capture would replace under them."""
        owner = self._runner() if self._runner is not None else None
        if owner is not None:
            raise ValueError(f"this {type(self).__name__} already serves a live runner "
                             f"({owner.strategy.name}), whose graphs read its buffers: "
                             "make one inputs object per runner (or drop that runner first)")

    def claim(self, runner) -> None:
        """``runner`` (made of this object by ``graphcap.capture``) holds it now."""
        self._runner = weakref.ref(runner)

    def abandon(self, batch: Batch) -> None:
        """A call of ``batch`` raised once it was checked: part of it may have run."""

    def describe(self, batch: Batch) -> str:
        """What of a call makes a split model's ranks run different graphs or kernels:
        the ranks of a TP group agree on it before each call."""
        lens = f", requests {batch.lens}" if batch.lens is not None else ""
        return f"{batch.tokens} tokens{lens}"

    def limits(self) -> str:
        """What, beside the buckets, bounds a batch that replays (for messages)."""
        return ""

    def default_buckets(self, max_tokens: int | None = None) -> list[int] | None:
        """The shapes ``graphcap.capture`` captures where no ``buckets`` are given: those
        its calls can fill, up to ``max_tokens`` where given (None: the token ladder to
        ``max_tokens``, else 2048)."""
        return None

    def captured(self, states: list) -> None:
        pass

    def report(self) -> dict:
        return {}

    def rows_of(self, tokens: int, bucket: int) -> tuple[list, list]:
        """The buffers' first ``tokens`` rows and their rows up to ``bucket`` (none where
        ``tokens`` fills it), as views made once."""
        key = (tokens, bucket)
        cached = self._rows_of.get(key)
        if cached is None:
            cached = ([b[:tokens] for b in self.buffers],
                      [b[tokens:bucket] for b in self.buffers] if tokens < bucket else [])
            self._rows_of[key] = cached
        return cached

    def copy_in(self, batch: Batch, bucket: int) -> None:
        """The call's tensors into the buffers' first rows, the rest of the bucket zero
        (padding rows: finite, and never stale)."""
        rows, padding = self.rows_of(batch.tokens, bucket)
        # Host tensors among the args are pinned (checks.staged): no host sync.
        torch._foreach_copy_(rows, list(batch.args[:len(rows)]), non_blocking=True)
        for buf in padding:
            buf.zero_()


def call_copies(args, dtype: torch.dtype | None = None) -> tuple:
    """A call's tensors as fresh contiguous copies (in ``dtype``, where given), anything
    else as is: what a fallback passes the model in place of the caller's tensors, as a
    replay passes copies in its static buffers. A forward that writes an input in place
    then writes graphcap's copy on either path, never the caller's tensor, and sees the
    same layout (and dtype) as a replay's."""
    return tuple(a.to(dtype or a.dtype, copy=True, memory_format=torch.contiguous_format)
                 if isinstance(a, torch.Tensor) else a for a in args)


NO_ATTENTION = "ran no graphcap attention"  # check_packing's refusal (graphcap check)


def check_packing(name: str, backend: str, lens: list[int]) -> None:
    """Packed requests need graphcap attention, which alone sees their boundaries: a call
    of several into a forward that ran none is refused."""
    if sum(n > 0 for n in lens) > 1:
        raise UnsupportedModel(
            f"{name} {NO_ATTENTION} (graphcap::attention, backend {backend!r}) "
            f"in its forward, so its attention cannot see where the {len(lens)} packed "
            f"requests {lens} begin and end, and they would attend to each other. Route its "
            "attention through graphcap.opsdb.attention.ATTENTION (docs/models.md, 'Bring "
            "your own model'), or call it with one request per call")
