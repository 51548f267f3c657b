"""``runner(input_ids, positions, seq_lens=[...])``: :class:`PrefillInputs`, requests
packed along dim 0 in request slots of one attention backend's per-shape metadata."""

from __future__ import annotations

import torch

from graphcap.core import checks
from graphcap.core.context import forward_context
from graphcap.core.inputs import Batch, Inputs, call_copies, check_packing
from graphcap.errors import BadBatch
from graphcap.opsdb.attention import check_serves


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
        self.guessed = False  # a prefill model by its forward's parameter names alone

    def bind(self, model) -> None:
        """Its attention backend computes the options the model's layers use (before
        anything is built, not at their first call)."""
        check_serves(self.attention, getattr(model, "graphcap_attention_options", ()),
                     device=self.device, whose=f"{type(model).__name__}'s layers")

    def check(self, args: tuple, kwargs: dict) -> Batch:
        try:
            lens = checks.check_packed_call(args, kwargs, set(), self.device,
                                            self.per_request)
        except BadBatch as exc:  # ids not 1-D, or no seq_lens: a model of tensors?
            ids = args[0] if args else None
            if self.guessed and (getattr(ids, "ndim", 1) != 1 or "seq_lens" not in kwargs):
                exc.add_note(f"graphcap: {self.name} is taken for a model of packed requests "
                             "because its forward's first parameters are named input_ids, "
                             "positions; a model of tensors along dim 0 (a [batch, seq] "
                             "one) is captured with graphcap.capture(..., inputs='tensors')")
            raise
        if self.bounds is not None:
            checks.check_ranges(*args, *self.bounds)
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
        # A fallback (buffers allocated: the runner captured) gets int64 copies, as a
        # replay reads its buffers: a forward that writes its ids or positions writes
        # neither the caller's, and int32 ones give what a replay gives. The eager
        # strategy runs the model on the call's own.
        args = call_copies(batch.args, torch.long) if self.buffers else batch.args
        if self.per_request:
            args = (*args, meta.last_token_rows())

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
