"""``runner(*tensors)``: :class:`TensorInputs`, tensors sharing dim 0 (the token dim),
their shapes taken from the first call."""

from __future__ import annotations

import torch

from graphcap.core import checks
from graphcap.core.inputs import Batch, Inputs, call_copies
from graphcap.errors import BadBatch, CaptureError


class TensorInputs(Inputs):
    """``runner(*tensors)``: tensors along dim 0, their dtypes and trailing sizes those of
    the first call."""

    kind = "tensors"
    needs_batch = True

    def __init__(self, device: torch.device, captured: bool = True, placed: bool = True):
        super().__init__(device)
        self.placed = placed  # False: a model of no tensors, no example: the CPU, guessed
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
        for i, a in enumerate(args if not self.specs else ()):  # the shapes it will take
            if not isinstance(a, torch.Tensor):
                raise BadBatch(f"argument {i} must be a tensor, got {type(a).__name__}: a "
                               "model of tensors is called as runner(*tensors)")
        specs = self.specs or [(a.dtype, tuple(a.shape[1:])) for a in args]
        if not self.placed and any(isinstance(a, torch.Tensor) and a.device != self.device
                                   for a in args):
            raise BadBatch(f"the model has no parameters or buffers to say where it runs, "
                           f"so its runner captures on {self.device}: give "
                           "graphcap.capture(..., example_inputs=(...)) on the device it "
                           "runs on")
        return Batch(tuple(args), checks.check_tensors(args, specs, self.device))

    def forget(self) -> list:
        kept, self.specs = self.specs, []
        return kept

    def remember(self, kept: list) -> None:
        if not self.specs:
            self.specs = kept

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
        if not self.strict:  # the eager strategy: the model itself, on the call's tensors
            return lambda: model(*batch.args, **batch.kwargs)
        # A fallback: copies, as a replay's buffers are (a forward that writes an input in
        # place writes graphcap's copy on both paths, never the caller's tensor).
        args = call_copies(batch.args)
        return lambda: model(*args)

    def describe(self, batch: Batch) -> str:
        """Each argument's dtype and shape (another type: its name): ranks that pass
        tensors of one dim 0 but other trailing sizes or dtypes would capture (or run)
        other shapes, their collectives of other sizes (NCCL: undefined; gloo: an abort,
        or a dtype of the same width silently reinterpreted)."""
        def one(a) -> str:
            if isinstance(a, torch.Tensor):
                return f"{str(a.dtype).removeprefix('torch.')}{list(a.shape)}"
            return type(a).__name__
        parts = [one(a) for a in batch.args]
        parts += [f"{k}={one(v)}" for k, v in sorted(batch.kwargs.items())]
        return f"{batch.tokens} tokens ({', '.join(parts)})"
