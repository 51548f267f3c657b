"""Input checks shared by opsdb ops: cheap, host-only, run before any kernel launch."""

from __future__ import annotations

import torch

from graphcap.core.trees import repeats_memory
from graphcap.opsdb.spec import OpInputError

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def tensor(op: str, name: str, t, *, ndim: int | None = None, dtypes=FLOATS,
           device: torch.device | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise OpInputError(f"{op}: {name} must be a tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise OpInputError(
            f"{op}: {name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise OpInputError(f"{op}: {name} has dtype {t.dtype}; supported: {names}")
    if device is not None and t.device != device:
        raise OpInputError(
            f"{op}: {name} is on {t.device} but the other inputs are on {device}; "
            "move them to one device")


def same(op: str, what: str, a, b, name_a: str, name_b: str) -> None:
    if a != b:
        raise OpInputError(f"{op}: {what} of {name_a} ({a}) and {name_b} ({b}) must match")


def last_dim_contiguous(op: str, name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise OpInputError(f"{op}: {name} must be contiguous in its last dim; "
                           "call .contiguous() first")


def writable(op: str, name: str, t: torch.Tensor) -> None:
    """``t``, which ``op`` writes in place, has no two elements at one place (an
    ``expand``ed tensor: several writes would race there)."""
    if repeats_memory(t):
        raise OpInputError(f"{op}: {name} is written in place but repeats its memory "
                           f"(strides {t.stride()}, an expanded tensor); pass a copy "
                           "(.contiguous())")


def vector_rows(t: torch.Tensor, vec: int) -> bool:
    """Whether every row of ``t`` starts on a ``vec``-element vector: its pointer a
    multiple of ``vec`` elements' bytes and its row stride of ``vec`` elements (what a
    vendor kernel loading rows in such vectors, from the pointer and the stride alone,
    needs; elsewhere it reads misaligned addresses, which poison the CUDA context)."""
    return t.data_ptr() % (vec * t.element_size()) == 0 and (
        t.dim() < 2 or t.shape[0] <= 1 or t.stride(0) % vec == 0)


def rows_for(op: str, table: torch.Tensor, indices: torch.Tensor, refusal: str) -> None:
    """Refuse (``refusal``) a ``table`` of no rows where ``indices`` index it: a kernel
    would read outside it (its indices clamp into the rows there are)."""
    if table.shape[0] == 0 and indices.numel():
        raise OpInputError(f"{op}: {refusal}")

