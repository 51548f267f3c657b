"""Per-request sampling parameters (:class:`Sampling`) and the draw of one token per row
from them (``graphcap::sample``: greedy, or seeded temperature / top-k / top-p; a batch of
greedy rows only, the argmax alone)."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from graphcap.core.checks import staged
from graphcap.errors import BadBatch
from graphcap.opsdb.sample import GREEDY_BELOW, SAMPLE

FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # temperature and top_p go as float32
INT64_END = 2**63  # top_k and seed go as int64


def _real(name: str, value) -> float:
    """``value`` as a float: any real number but a bool, finite in float32."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or \
            not abs(value) <= FLOAT32_MAX:  # NaN included
        raise ValueError(f"Sampling.{name} must be a real number finite in float32, got "
                         f"{value!r} ({type(value).__name__})")
    return float(value)


def _integer(name: str, value, meaning: str) -> int:
    """``value`` as an int in [0, 2**63): any integer but a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or \
            not 0 <= value < INT64_END:
        raise ValueError(f"Sampling.{name} must be an int in [0, 2**63){meaning}, got "
                         f"{value!r} ({type(value).__name__})")
    return int(value)


@dataclass(frozen=True)
class Sampling:
    """How a request draws its tokens: ``temperature`` 0 (or at most 1e-5) is greedy;
    ``top_k`` 0 and ``top_p`` 1 keep every token; ``seed`` makes the draws reproducible
    (two requests with one seed at one position draw the same noise), and every one of
    its 63 bits counts. Each field takes any real (integer) number but a bool, stored as
    a Python float (int); anything else raises ValueError naming the field."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        temperature = _real("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"Sampling.temperature must be >= 0, got {temperature}")
        top_p = _real("top_p", self.top_p)
        if not 0 < top_p <= 1:
            raise ValueError(f"Sampling.top_p must be in (0, 1], got {top_p}")
        top_k = _integer("top_k", self.top_k, " (0: every token)")
        seed = _integer("seed", self.seed, "")
        for name, value in (("temperature", temperature), ("top_k", top_k),
                            ("top_p", top_p), ("seed", seed)):
            object.__setattr__(self, name, value)  # frozen: the checked value, plain


def per_row(given, rows: int) -> list[Sampling]:
    """A step's sampling argument: one :class:`Sampling` per row, or None (greedy)."""
    if isinstance(given, Sampling):  # one for all would give every row one seed's noise
        raise BadBatch(f"sampling must be {rows} graphcap.Sampling in a list (one per row, "
                       f"each with its own seed) or None (greedy), got one: {given!r}")
    try:
        params = [Sampling()] * rows if given is None else list(given)
    except TypeError:  # not iterable
        params = None
    if params is None or len(params) != rows or \
            not all(isinstance(p, Sampling) for p in params):
        raise BadBatch(f"sampling must be {rows} graphcap.Sampling (one per row) or None "
                       f"(greedy), got {given!r}")
    return params


def tensors(params: list[Sampling], device) -> tuple[torch.Tensor, ...]:
    """temperature, top_k, top_p and seed of each row, as device tensors."""
    return tuple(t.to(device, non_blocking=True) for t in host_tensors(params, device))


def host_tensors(params: list[Sampling], device) -> tuple[torch.Tensor, ...]:
    """The same on the host, staged for ``device`` (pinned for CUDA: no host sync)."""
    return (staged([p.temperature for p in params], torch.float32, device),
            staged([p.top_k for p in params], torch.long, device),
            staged([p.top_p for p in params], torch.float32, device),
            staged([p.seed for p in params], torch.long, device))


def pick(logits: torch.Tensor, params: list[Sampling], counters: list[int]) -> torch.Tensor:
    """One token per row of ``logits`` on the device, without a host sync: row ``b``
    drawn with ``params[b]`` at counter ``counters[b]`` (the position the token takes).
    Where every row is greedy, the argmax, which is what ``graphcap::sample`` gives such
    rows without its cost (it ranks every row's whole vocabulary, for top-k and top-p)."""
    if all(p.temperature <= GREEDY_BELOW for p in params):
        return logits.argmax(dim=-1)
    counter = staged(counters, torch.long, logits.device).to(logits.device,
                                                             non_blocking=True)
    return SAMPLE(logits, *tensors(params, logits.device), counter)


def draw(logits: torch.Tensor, params: list[Sampling], counters: list[int]) -> list[int]:
    """:func:`pick`'s tokens, read on the host."""
    return pick(logits, params, counters).tolist()
