"""What a captured forward may return: the check of a shape's outputs against its rows
and the static output buffers."""

from __future__ import annotations

import dataclasses

import torch

from graphcap.errors import UnsupportedStrategy


def check_outputs(flat: list, bucket: int, inputs, outputs: list) -> None:
    """Outputs a graph can return for shape ``bucket``: tensors with its rows along dim
    0 and, after the first shape, the same count, dtypes and trailing sizes as the
    first shape's (``outputs``: the static output buffers, empty before it)."""
    rows = inputs.rows(bucket)
    bad = [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
           for o in flat if not isinstance(o, torch.Tensor)
           or o.dim() == 0 or o.shape[0] != rows]
    if bad:
        raise UnsupportedStrategy(
            f"the model returned {bad} for {bucket} tokens: a captured model must "
            f"return tensors with {inputs.row_unit} along dim 0 ({rows} here; rows "
            "are padded and sliced), each row depending only on its own request's "
            f"tokens{_opaque(flat)}")
    if not outputs:
        return
    got = [(o.dtype, tuple(o.shape[1:])) for o in flat]
    want = [(b.dtype, tuple(b.shape[1:])) for b in outputs]
    if got != want:
        raise UnsupportedStrategy(
            f"the model returned outputs of (dtype, trailing sizes) {got} for {bucket} "
            f"tokens but {want} for the first shape: a captured model must return the "
            "same outputs for every shape, only their rows differing")


def _opaque(flat: list) -> str:
    """What to do with outputs that are objects holding tensors that torch's pytree does
    not look into (a dataclass): they reach the check whole, as one leaf."""
    opaque = sorted({type(o).__name__ for o in flat if not isinstance(o, torch.Tensor) and (
        dataclasses.is_dataclass(o) or any(isinstance(v, torch.Tensor)
                                           for v in getattr(o, "__dict__", {}).values()))})
    if not opaque:
        return ""
    what = "is a class" if len(opaque) == 1 else "are classes"
    return (f"; {', '.join(opaque)} {what} torch's pytree does not look into: return "
            "a tuple, list, dict or namedtuple of tensors, or register the class "
            "(torch.utils._pytree.register_dataclass for a dataclass)")
