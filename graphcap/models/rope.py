"""The rotary cache of a reference decoder: plain neox rotary, or scaled by YaRN
(gpt-oss), in the ``[max_position, rot_dim]`` cos/sin layout ``graphcap::qkv_norm_rope``
reads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from graphcap.opsdb.reference import rope_cache


@dataclass(frozen=True)
class Yarn:
    """YaRN's rotary scaling (https://arxiv.org/abs/2309.00071), as transformers computes
    it: frequencies that turn fewer than ``beta_slow`` times over the
    ``original_max_position`` positions are divided by ``factor`` (interpolated), those
    turning more than ``beta_fast`` times are kept (extrapolated), a linear ramp between;
    cos and sin are scaled by ``0.1 ln(factor) + 1``. gpt-oss: factor 32 over 4096
    positions, beta_fast 32, beta_slow 1, ``truncate=False``."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        """The ``dim / 2`` scaled inverse frequencies of a ``dim``-wide rotation."""
        def dim_of(rotations: float) -> float:  # the dim that turns `rotations` times
            return dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) \
                / (2 * math.log(theta))

        low, high = dim_of(self.beta_fast), dim_of(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
        base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
        keep = 1 - ramp  # the share of each frequency extrapolated
        return (1.0 / (self.factor * base)) * ramp + (1.0 / base) * keep


def rotary_cache(dim: int, max_position: int, theta: float,
                 yarn: Yarn | None = None) -> torch.Tensor:
    """The neox cos/sin cache ``[max_position, dim]`` (cos in the first half, sin in the
    second), float32; with ``yarn``, its frequencies and scale."""
    if yarn is None:
        return rope_cache(dim, max_position, theta)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] \
        * yarn.inv_freq(dim, theta)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * yarn.attention_factor
