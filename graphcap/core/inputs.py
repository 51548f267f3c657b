"""Kinds of input: what a runner needs to know of a model's arguments, behind one seam.

The runner captures shapes, picks a bucket, replays and slices; everything that depends
on what the model takes lives in an :class:`Inputs` object:

- :class:`PrefillInputs`: ``model(input_ids, positions)`` over requests packed along dim
  0, called as ``runner(input_ids, positions, seq_lens=[...])``: request slots whose
  unused ones are zero-length sentinels, per-shape attention metadata rewritten before
  each replay, and for a model whose ``output_rows`` is ``"requests"`` the row of each
  request's last token (``model(input_ids, positions, last_rows)``).
- :class:`TensorInputs`: ``runner(*tensors)``, tensors sharing dim 0 (the token dim),
  their shapes taken from the first call.

A kind of input of one's own subclasses :class:`Inputs` and is passed as
``graphcap.capture(model, inputs=MyInputs(...))``; the runner calls it through these
methods only:

- ``bind(model)``: the model the runner captures, once, before anything else (what a
  kind reads of it, e.g. its ``output_rows``);
- ``check(args, kwargs) -> Batch``: validate a call (``BadBatch`` before anything runs);
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
- ``eager(model, batch) -> run``: the model on the call's own tensors, without graphs,
  prepared outside any mode (``run()`` runs it);
- ``commit(batch)``: after the call's replay or eager run returned, what it wrote is
  state now (a paged cache counts the tokens written); a call that raised commits nothing;
- ``describe(batch)``: what the ranks of a split model agree on before a call;
- ``captured(states)``, ``report()``: what a capture showed, for ``runner.report()``;
  ``forget()``: after a capture that failed, what it took from the call it came from.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch

from graphcap.core import batch as batching
from graphcap.core.context import forward_context
from graphcap.errors import BadBatch, CaptureError, UnsupportedModel


@dataclass
class Batch:
    """One validated call: its arguments, token count and request lengths (or None)."""

    args: tuple
    tokens: int
    lens: list[int] | None = None
    kwargs: dict = field(default_factory=dict)  # what the eager strategy passes on as is
    host: Any = None  # what a kind of input keeps of the call on the host, beside args


class Inputs:
    """Static input buffers sliced per bucket, and the seam's defaults (no state)."""

    kind = "base"
    row_unit = "one row per token"
    needs_batch = False  # allocate() needs the first call's batch (its shapes)
    strategies: tuple[str, ...] | None = None  # the strategies it runs under (None: all)
    why_not = ""  # what the others lack, for the error

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

    def forget(self) -> None:
        """After a capture that failed: forget what it learned of the call it came from."""

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

    def describe(self, batch: Batch) -> str:
        """What of a call makes a split model's ranks run different graphs or kernels:
        the ranks of a TP group agree on it before each call."""
        lens = f", requests {batch.lens}" if batch.lens is not None else ""
        return f"{batch.tokens} tokens{lens}"

    def limits(self) -> str:
        """What, beside the buckets, bounds a batch that replays (for messages)."""
        return ""

    def captured(self, states: list) -> None:
        pass

    def report(self) -> dict:
        return {}

    def copy_in(self, batch: Batch, bucket: int) -> None:
        """The call's tensors into the buffers' first rows, the rest of the bucket zero
        (padding rows: finite, and never stale)."""
        key = (batch.tokens, bucket)
        cached = self._rows_of.get(key)
        if cached is None:
            cached = ([b[:batch.tokens] for b in self.buffers],
                      [b[batch.tokens:bucket] for b in self.buffers]
                      if batch.tokens < bucket else [])
            self._rows_of[key] = cached
        rows, padding = cached
        # Host tensors among the args are pinned (batching.staged): no host sync.
        torch._foreach_copy_(rows, list(batch.args[:len(rows)]), non_blocking=True)
        for buf in padding:
            buf.zero_()


class TensorInputs(Inputs):
    """``runner(*tensors)``: tensors along dim 0, their dtypes and trailing sizes those of
    the first call."""

    kind = "tensors"
    needs_batch = True

    def __init__(self, device: torch.device, captured: bool = True):
        super().__init__(device)
        self.specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
        # False (the eager strategy): nothing is captured, so a call may pass the model
        # anything it takes.
        self.strict = captured

    def check(self, args: tuple, kwargs: dict) -> Batch:
        if "seq_lens" in kwargs:
            raise BadBatch(
                "seq_lens given, but this runner captured a model of tensors along dim 0: "
                "declare a model of packed requests with graphcap.capture(model, "
                "inputs='prefill') (or graphcap_inputs = 'prefill' on its class) and call "
                "runner(input_ids, positions, seq_lens=[...])")
        if not self.strict:
            return Batch(tuple(args), 0, kwargs=kwargs)
        if kwargs:
            raise BadBatch(f"unexpected keyword arguments {sorted(kwargs)}: a model of "
                           "tensors is called as runner(*tensors)")
        specs = self.specs or [(a.dtype, tuple(a.shape[1:])) for a in args
                               if isinstance(a, torch.Tensor)]
        return Batch(tuple(args), batching.check_tensors(args, specs, self.device))

    def forget(self) -> None:
        self.specs = []

    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        if batch is not None:
            self.specs = [(a.dtype, tuple(a.shape[1:])) for a in batch.args]
        if not self.specs:
            raise CaptureError("nothing to capture from: this runner takes its shapes "
                               "from a call; call it (or capture_all(example)) first")
        self.buffers = [torch.zeros((max_tokens, *tail), dtype=dtype, device=self.device)
                        for dtype, tail in self.specs]

    def forward(self, model, bucket: int, state):
        return model(*(buf[:bucket] for buf in self.buffers))

    def stage(self, batch: Batch, bucket: int, state) -> None:
        self.copy_in(batch, bucket)

    def eager(self, model, batch: Batch):
        return lambda: model(*batch.args, **batch.kwargs)


class PrefillInputs(Inputs):
    """``runner(input_ids, positions, seq_lens=[...])``: requests packed along dim 0, in
    request slots of one attention backend's per-shape metadata."""

    kind = "prefill"

    def __init__(self, device: torch.device, attention, slots: int,
                 output_rows: str = "tokens", bounds: tuple[int, int | None] | None = None,
                 name: str = "the model"):
        super().__init__(device)
        self.attention, self.slots, self.bounds, self.name = attention, slots, bounds, name
        self.per_request = output_rows == "requests"
        if self.per_request:
            self.row_unit = "one row per request slot (output_rows='requests')"
        self.last_rows: torch.Tensor | None = None  # per_request: [slots]
        # Whether graphcap attention ran in the captured forward (None: nothing captured),
        # and, with nothing captured (the eager strategy), in a call.
        self.attends: bool | None = None
        self.called = False

    def check(self, args: tuple, kwargs: dict) -> Batch:
        unknown = sorted(set(kwargs) - {"seq_lens"})
        if unknown or len(args) != 2:
            raise BadBatch("a prefill model is called as runner(input_ids, positions, "
                           f"seq_lens=[...]); got {len(args)} arguments"
                           + (f" and keywords {unknown}" if unknown else ""))
        lens = batching.check_prefill(*args, kwargs.get("seq_lens"), self.device)
        if self.per_request and 0 in lens:
            raise BadBatch(
                f"seq_lens {lens} has a zero-length request, which has no last token: "
                "this model returns one row per request; drop empty requests")
        if self.bounds is not None:
            batching.check_ranges(*args, *self.bounds)
        if self.attends is False:
            self.check_packing(lens)
        return Batch(tuple(args), args[0].shape[0], lens)

    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        self.buffers = [ids, torch.zeros_like(ids)]
        if self.per_request:
            self.last_rows = torch.zeros(self.slots, dtype=torch.long, device=self.device)

    def reset(self) -> None:
        super().reset()
        self.last_rows, self.attends = None, None

    def prepare(self, bucket: int):
        meta = self.attention.metadata(bucket, self.slots, self.device).update([bucket])
        if self.per_request:
            meta.last_token_rows(out=self.last_rows)
        return meta

    def forward(self, model, bucket: int, meta):
        args = [buf[:bucket] for buf in self.buffers]
        if self.per_request:
            args.append(self.last_rows)
        with forward_context(attention=meta):
            return model(*args)

    def derive(self, meta) -> None:
        meta.derive()  # per-batch buffers derived on the device, in the graph
        if self.per_request:
            meta.last_token_rows(out=self.last_rows)

    def stage(self, batch: Batch, bucket: int, meta) -> None:
        self.copy_in(batch, bucket)
        meta.update(batch.lens, derive=False, checked=True)  # routed: they fit the shape

    def context(self, meta):
        return forward_context(attention=meta)

    def rows(self, bucket: int) -> int:
        return self.slots if self.per_request else bucket

    def out_rows(self, batch: Batch) -> int:
        return len(batch.lens) if self.per_request else batch.tokens

    def fits(self, batch: Batch) -> str | None:
        return "too_many_requests" if len(batch.lens) > self.slots else None

    def limits(self) -> str:
        return f", {self.slots} request slots"

    def eager(self, model, batch: Batch):
        # Host work, and tensors made outside whatever mode the call then runs in (a
        # compiled forward traced with ordinary tensors would recompile for others).
        meta = self.attention.prepare(batch.lens, self.device)
        args = (*batch.args, meta.last_token_rows()) if self.per_request else batch.args

        def run():
            with forward_context(attention=meta):
                out = model(*args)
            if self.attends is None:  # nothing captured: this call tells
                self.called |= meta.attended
                if not meta.attended:
                    self.check_packing(batch.lens)
            return out
        return run

    def captured(self, states: list) -> None:
        self.attends = any(meta.attended for meta in states)

    def report(self) -> dict:
        # The attention backend the captured forward called (None: it called none).
        return {"attention": self.attention.name if self.attends or self.called else None}

    def check_packing(self, lens: list[int]) -> None:
        check_packing(self.name, self.attention.name, lens)


def check_packing(name: str, backend: str, lens: list[int]) -> None:
    """Packed requests need graphcap attention, which alone sees their boundaries: a call
    of several into a forward that ran none is refused."""
    if sum(n > 0 for n in lens) > 1:
        raise UnsupportedModel(
            f"{name} ran no graphcap attention (graphcap::attention, backend {backend!r}) "
            f"in its forward, so its attention cannot see where the {len(lens)} packed "
            f"requests {lens} begin and end, and they would attend to each other. Route its "
            "attention through graphcap.opsdb.attention.ATTENTION (docs/models.md, 'Bring "
            "your own model'), or call it with one request per call")
