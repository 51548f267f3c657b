"""Per-request sampling parameters (:class:`Sampling`) and the draw of one token per row
from them (``graphcap::sample``: greedy, or seeded temperature / top-k / top-p)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

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
    """temperature, top_k, top_p and seed of each row, as host or device tensors."""
    return (torch.tensor([p.temperature for p in params], dtype=torch.float32,
                         device=device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            torch.tensor([p.seed for p in params], dtype=torch.long, device=device))


def draw(logits: torch.Tensor, params: list[Sampling], counters: list[int]) -> list[int]:
    """One token per row of ``logits``, row ``b`` drawn with ``params[b]`` at counter
    ``counters[b]`` (the position the token takes)."""
    counter = torch.tensor(counters, dtype=torch.long, device=logits.device)
    return SAMPLE(logits, *tensors(params, logits.device), counter).tolist()
