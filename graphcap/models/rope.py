"""The rotary cache of a reference decoder: plain neox rotary, or with its frequencies
scaled as Hugging Face configs name it (``rope_type``): ``linear``, ``llama3`` (Llama 3.1
to 3.3), ``yarn`` (gpt-oss, long-context Qwen), in the ``[max_position, rot_dim]`` cos/sin
layout ``graphcap::qkv_norm_rope`` reads. Each computes what transformers does."""

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
    attention: float | None = None  # the cos/sin scale a config gives (else the formula)

    @property
    def attention_factor(self) -> float:
        return self.attention if self.attention is not None else mscale(self.factor)

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
        # Written as transformers writes it (1 - keep, not ramp): the same bits
        return (1.0 / (self.factor * base)) * (1 - keep) + (1.0 / base) * keep


def mscale(factor: float, scale: float = 1.0) -> float:
    """YaRN's cos/sin scale for a context ``factor`` times longer: ``0.1 scale ln(factor)
    + 1`` (1 where nothing is stretched)."""
    return 0.1 * scale * math.log(factor) + 1.0 if factor > 1 else 1.0


def _plain(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)


@dataclass(frozen=True)
class Linear:
    """Every frequency divided by ``factor`` (positions interpolated)."""

    factor: float
    attention_factor = 1.0

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        return _plain(dim, theta) / self.factor


@dataclass(frozen=True)
class Llama3:
    """Llama 3.1's scaling: wavelengths longer than ``original_max_position /
    low_freq_factor`` divided by ``factor``, those shorter than ``original_max_position /
    high_freq_factor`` kept, a smooth blend between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position: int
    attention_factor = 1.0

    def inv_freq(self, dim: int, theta: float) -> torch.Tensor:
        plain = _plain(dim, theta)
        wavelen = 2 * math.pi / plain
        old = self.original_max_position
        scaled = torch.where(wavelen > old / self.low_freq_factor, plain / self.factor, plain)
        smooth = (old / wavelen - self.low_freq_factor) / \
            (self.high_freq_factor - self.low_freq_factor)
        blend = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelen >= old / self.high_freq_factor) & \
            (wavelen <= old / self.low_freq_factor)
        return torch.where(medium, blend, scaled)


Scaling = Yarn | Linear | Llama3


def rotary_cache(dim: int, max_position: int, theta: float,
                 scaling: Scaling | None = None) -> torch.Tensor:
    """The neox cos/sin cache ``[max_position, dim]`` (cos in the first half, sin in the
    second), float32; with ``scaling``, its frequencies and scale."""
    if scaling is None:
        return rope_cache(dim, max_position, theta)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] \
        * scaling.inv_freq(dim, theta)[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1) * scaling.attention_factor
