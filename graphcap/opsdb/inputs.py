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


def rope_heads(draw) -> tuple[int, int, int, int]:
    """A drawn head layout for the rotary ops' input strategies: head size, rotary dims
    (all of the head or half), kv heads, and query heads (1, 2 or 4 per kv head)."""
    from hypothesis import strategies as st

    head = draw(st.sampled_from([16, 32, 64, 128]))
    rot = draw(st.sampled_from([head, head // 2]))
    hk = draw(st.sampled_from([1, 2]))
    hq = hk * draw(st.sampled_from([1, 2, 4]))
    return head, rot, hk, hq


def positions_and_rope_cache(draw, device, tokens: int, rot_dim: int, max_pos: int = 128):
    """Random positions [tokens] below ``max_pos`` (from a drawn seed) and the neox cos/sin
    cache [max_pos, rot_dim] they index, for the rotary ops' input strategies."""
    from hypothesis import strategies as st

    from graphcap.opsdb.reference import rope_cache

    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    positions = torch.randint(0, max_pos, (tokens,), generator=gen).to(device)
    return positions, rope_cache(rot_dim, max_pos, 10000.0).to(device)
