"""Helpers for the hypothesis input strategies of opsdb ops (hypothesis is imported by
the callers, lazily: it is a test dependency)."""

from __future__ import annotations

import torch


def tensors(draw, device, dtype, *shapes, scale: float = 1.0):
    """Random normal tensors of ``shapes`` from a drawn seed (shrinkable, reproducible)."""
    from hypothesis import strategies as st

    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    return tuple(
        (torch.randn(shape, generator=gen) * scale).to(device=device, dtype=dtype)
        for shape in shapes)
