"""Pytree helpers shared by the capture machinery."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def tensor_leaves(value) -> list[torch.Tensor]:
    """The tensors among the leaves of a (nested) value, in order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def storage_key(t: torch.Tensor) -> int:
    """The address of ``t``'s storage: the same for a tensor and all its views."""
    return t.untyped_storage().data_ptr()


def storages(value) -> set[int]:
    """:func:`storage_key` of every tensor among the leaves of ``value`` that has memory
    (none: an empty one, a lazy module's uninitialised parameter, a wrapper subclass)."""
    return {storage_key(t) for t in tensor_leaves(value) if _has_memory(t)}


def _has_memory(t: torch.Tensor) -> bool:
    try:
        return t.untyped_storage().nbytes() > 0
    except (RuntimeError, TypeError, ValueError):  # no storage to read
        return False


def repeats_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` has two elements at one place (an expanded tensor, overlapping
    windows of ``unfold``): nothing may write it in place."""
    if t.numel() == 0:
        return False
    dims = sorted((stride, size) for size, stride in zip(t.shape, t.stride(), strict=True)
                  if size > 1)
    if any(stride == 0 for stride, _ in dims):  # expanded
        return True
    if t.numel() > sum((size - 1) * stride for stride, size in dims) + 1:
        return True  # more elements than places they reach
    reach = 0  # the furthest element offset the dims of smaller strides reach
    for stride, size in dims:
        if stride <= reach:
            break
        reach += (size - 1) * stride
    else:
        return False
    # Strides that interleave (or repeat): count the distinct offsets.
    offsets = torch.zeros((), dtype=torch.int64)
    for stride, size in dims:
        offsets = (offsets[..., None] + torch.arange(size) * stride).flatten()
    return bool(offsets.unique().numel() < offsets.numel())


def reach(t: torch.Tensor) -> int:
    """How many elements past ``t``'s first its last lies, in memory (of a non-empty ``t``)."""
    return sum((n - 1) * stride for n, stride in zip(t.shape, t.stride(), strict=True))


def span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``t``'s elements lie within: [first, past the last)."""
    start = t.data_ptr()
    return start, start + (reach(t) + 1) * t.element_size()


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the elements of ``a`` and ``b`` lie within some of the same bytes (an
    overlapping slice, a transpose of the other)."""
    if not (a.numel() and b.numel()):
        return False
    (a_start, a_end), (b_start, b_end) = span(a), span(b)
    return a_start < b_end and b_start < a_end
