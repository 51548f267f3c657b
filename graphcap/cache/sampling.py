"""Per-request sampling parameters (:class:`Sampling`) and the draw of one token per row
from them (``graphcap::sample``: greedy, or seeded temperature / top-k / top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from graphcap.core.batch import staged
from graphcap.opsdb.sample import SAMPLE


@dataclass(frozen=True)
class Sampling:
    """How a request draws its tokens: ``temperature`` 0 (or at most 1e-5) is greedy;
    ``top_k`` 0 and ``top_p`` 1 keep every token; ``seed`` makes the draws reproducible
    (two requests with one seed at one position draw the same noise)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: every token), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or \
                not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an int in [0, 2**63), got {self.seed}")


def tensors(params: list[Sampling], device) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p and seed of each row, as device tensors."""
    return tuple(t.to(device, non_blocking=True) for t in host_tensors(params, device))


def host_tensors(params: list[Sampling], device) -> tuple[torch.Tensor, ...]:
    """The same on the host, staged for ``device`` (pinned for CUDA: no host sync)."""
    return (staged([p.temperature for p in params], torch.float32, device),
            staged([p.top_k for p in params], torch.long, device),
            staged([p.top_p for p in params], torch.float32, device),
            staged([p.seed for p in params], torch.long, device))


def draw(logits: torch.Tensor, params: list[Sampling], counters: list[int]) -> list[int]:
    """One token per row of ``logits``, row ``b`` drawn with ``params[b]`` at counter
    ``counters[b]`` (the position the token takes)."""
    counter = torch.tensor(counters, dtype=torch.long, device=logits.device)
    return SAMPLE(logits, *tensors(params, logits.device), counter).tolist()
