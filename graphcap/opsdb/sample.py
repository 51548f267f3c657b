"""Token sampling from logits, seeded per request so that eager and every graph draw the
same tokens: ``sample``.

Per row ``b``: ``temperature[b] <= 1e-5`` takes the argmax (greedy); otherwise the logits
are divided by the temperature, restricted to the ``top_k[b]`` most likely tokens (0:
all; tokens tied with the k-th are kept too, as transformers' top-k keeps them) and to
the smallest set whose probability reaches ``top_p[b]`` (1: all), and one
token is drawn by the Gumbel-max trick with noise from a counter-based hash of
``(seed[b], counter[b], token id)``: the same inputs give the same token on any device,
in any strategy, with no generator state. A request's counter is its position, so each
step draws fresh noise. Every parameter is a device tensor: they change between calls
without a recapture, and nothing reads the device on the host.

Non-finite logits give a defined draw, found on the device (no error can be raised
inside a graph, nor the logits read on the host): a NaN logit counts as ``+inf``, as
``torch.argmax`` (greedy) ranks it first; a row whose largest scaled logit is ``+inf`` (or
overflows to it) draws one of its ``+inf`` tokens, each equally likely, as transformers'
``remove_invalid_values=True`` does (its plain softmax is NaN, and ``multinomial``
raises); a row of ``-inf`` only draws any token, each equally likely.
"""

from __future__ import annotations

import torch

from graphcap.opsdb import checks
from graphcap.opsdb.spec import register_op

OP = "sample"
_LANE = 0xFFFFFFFF  # 32-bit lanes in int64: a lane times a constant below 2**31 fits
_GOLDEN = 0x61C88647  # 2**32 / golden ratio, negated: spreads consecutive token ids
GREEDY_BELOW = 1e-5  # a temperature at most this is greedy (dividing by it would overflow)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijection of 32-bit lanes that spreads every input bit over every output bit
    (xor-shifts and odd multipliers, each invertible modulo 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _LANE
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _LANE
    return x ^ (x >> 16)


def uniform_noise(seed: torch.Tensor, counter: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[B, vocab]`` float64 in (0, 1) from a hash of (seed, counter, token id).

    Every bit of the 64-bit seed and counter counts: their low and high halves key two
    32-bit lanes, each a bijection of its half of the seed (and of the counter), and a
    token's value is ``mix(mix(low + id * golden) ^ high)``, a bijection of each lane.
    So two seeds (or counters) that differ only in one half draw different noise for
    every token; two that differ in both halves, for every token but about one in 2**32
    by chance."""
    ids = torch.arange(vocab, device=seed.device, dtype=torch.int64)
    seed, counter = seed.long(), counter.long()
    low = _mix((seed & _LANE) ^ _mix(counter & _LANE))
    high = _mix(((seed >> 32) & _LANE) ^ _mix(((counter >> 32) & _LANE) ^ _GOLDEN))
    x = _mix((low[:, None] + ids[None, :] * _GOLDEN) & _LANE)
    x = _mix(x ^ high[:, None])
    return (x.double() + 0.5) / (_LANE + 1)


def _ranked(logits, temperature, top_k, top_p):
    """Each row's tokens by scaled logit, most likely first (``order``), the scaled logits
    in that order, and which of them top-k and top-p keep."""
    V = logits.shape[1]
    t = temperature.float().clamp_min(GREEDY_BELOW)[:, None]
    scaled = logits.float() / t
    # Non-finite logits (the module docstring), without a host sync: NaN ranks as
    # torch.argmax ranks it, first; where a row's top is infinite, the tokens at it are
    # equally likely and the others not at all (softmax would give NaN everywhere)
    scaled = scaled.masked_fill(scaled.isnan(), float("inf"))
    top = scaled.amax(dim=-1, keepdim=True)
    at_top = torch.zeros_like(scaled).masked_fill_(scaled != top, float("-inf"))
    scaled = torch.where(top.isinf(), at_top, scaled)
    order = scaled.argsort(dim=-1, descending=True, stable=True)
    ranked = scaled.gather(1, order)
    rank = torch.arange(V, device=logits.device)[None, :]
    kth = ranked.gather(1, (top_k.long().clamp(1, V) - 1)[:, None])  # ties with it are kept too
    keep = (top_k[:, None] <= 0) | (rank < top_k[:, None]) | (ranked >= kth)
    probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
    # The mass of each token and the less likely ones, as a share of the whole: a sum of
    # small numbers (exact where top-p cuts the tail), not 1 minus a sum rounded near 1
    after = probs.flip(-1).cumsum(dim=-1).flip(-1)
    tail = after > (1 - top_p.float()[:, None]) * after[:, :1]
    keep &= tail | (rank == 0) | (top_p[:, None] >= 1)
    return order, ranked, keep


def probabilities(logits, temperature, top_k, top_p) -> torch.Tensor:
    """``[B, V]`` float32: the distribution :func:`sample_reference` draws each row's
    token from (the kept tokens' softmax of the scaled logits, zero elsewhere; a greedy
    row's argmax with probability 1); never NaN, whatever the logits (the module
    docstring)."""
    order, ranked, keep = _ranked(logits, temperature, top_k, top_p)
    ranked_probs = torch.softmax(ranked.masked_fill(~keep, float("-inf")), dim=-1)
    probs = torch.zeros_like(ranked_probs).scatter_(1, order, ranked_probs)
    greedy = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1)[:, None], 1.0)
    return torch.where((temperature > GREEDY_BELOW)[:, None], probs, greedy)


def sample_reference(logits, temperature, top_k, top_p, seed, counter):
    """logits [B, V] -> tokens [B] int64 (see the module docstring)."""
    V = logits.shape[1]
    greedy = logits.argmax(dim=-1)
    order, ranked, keep = _ranked(logits, temperature, top_k, top_p)
    noise = uniform_noise(seed, counter, V).gather(1, order)
    gumbel = -torch.log(-torch.log(noise))
    pick = (ranked.double() + gumbel).masked_fill(~keep, float("-inf")).argmax(dim=-1)
    drawn = order.gather(1, pick[:, None])[:, 0]
    return torch.where(temperature > GREEDY_BELOW, drawn, greedy)


def check_sample(logits, temperature, top_k, top_p, seed, counter) -> None:
    checks.tensor(OP, "logits", logits, ndim=2)
    device, rows = logits.device, logits.shape[0]
    for name, t, dtypes in (("temperature", temperature, checks.FLOATS),
                            ("top_k", top_k, (torch.int32, torch.int64)),
                            ("top_p", top_p, checks.FLOATS),
                            ("seed", seed, (torch.int32, torch.int64)),
                            ("counter", counter, (torch.int32, torch.int64))):
        checks.tensor(OP, name, t, ndim=1, dtypes=dtypes, device=device)
        checks.same(OP, "the row count", t.shape[0], rows, name, "logits")
    if logits.shape[1] == 0:
        raise checks.OpInputError(f"{OP}: logits have no token to sample")


def sample_inputs(device, dtype, max_rows: int = 4):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        b, v = d(st.integers(1, max_rows)), d(st.integers(1, 40))
        (logits,) = tensors(d, device, dtype, (b, v), scale=3.0)
        temperature = torch.tensor(d(st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]),
                                              min_size=b, max_size=b)), device=device)
        top_k = torch.tensor(d(st.lists(st.integers(0, v), min_size=b, max_size=b)),
                             device=device)
        top_p = torch.tensor(d(st.lists(st.sampled_from([0.1, 0.5, 0.9, 1.0]),
                                        min_size=b, max_size=b)), device=device)
        seed = torch.tensor(d(st.lists(st.integers(0, 2**40), min_size=b, max_size=b)),
                            device=device)
        counter = torch.tensor(d(st.lists(st.integers(0, 10**6), min_size=b, max_size=b)),
                               device=device)
        return logits, temperature, top_k, top_p, seed, counter

    return draw()


SAMPLE = register_op(
    f"graphcap::{OP}",
    "(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor seed, "
    "Tensor counter) -> Tensor",
    reference=sample_reference, check=check_sample, inputs=sample_inputs,
    doc="greedy or temperature / top-k / top-p sampling per row, seeded by a counter-based "
        "hash (the same tokens eagerly and in any graph)",
)
