"""Pytree helpers shared by the capture machinery."""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten


def tensor_leaves(value) -> list[torch.Tensor]:
    """The tensors among the leaves of a (nested) value, in order."""
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
