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
    """:func:`storage_key` of every tensor among the leaves of ``value`` that has memory."""
    return {storage_key(t) for t in tensor_leaves(value) if t.untyped_storage().nbytes()}


def repeats_memory(t: torch.Tensor) -> bool:
    """Whether ``t`` has two elements at one place (an expanded tensor): nothing may write
    it in place."""
    return any(size > 1 and stride == 0 for size, stride in zip(t.shape, t.stride(),
                                                                strict=True))
