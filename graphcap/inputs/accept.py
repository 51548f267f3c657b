"""Acceptance of a verify step's proposals, greedy or sampled, on the device (no host
sync: it runs inside the step's graph).

A verify step brings ``1 + k`` tokens per request: the request's last accepted token,
then ``k`` proposed ones. Row ``j`` of a request's logits predicts its token ``j + 1``.
The target's greedy choice ``argmax`` at rows ``0 .. k - 1`` is compared with the
proposals; a request accepts its proposals up to the first that differs, and its next
token is the target's choice after the last accepted one (a token the step gains even
when nothing is accepted). Accepting this way gives the tokens plain greedy decoding
gives, whatever was proposed.

Sampled acceptance (:func:`sampled_accept`) is rejection sampling against proposals that
were chosen, not drawn (a deterministic proposer: n-gram lookup, a greedy draft): with
``p`` the distribution plain sampling draws from at a row (temperature, top-k, top-p:
:func:`graphcap.opsdb.sample.probabilities`), proposal ``x`` is accepted with probability
``p(x)``; the first refused one is replaced by a draw from ``p`` without ``x``
(renormalised), and where all are accepted the next token is drawn from the last row's
``p``. Each token is then distributed as plain sampling's: ``p(x) [y = x] + (1 - p(x))
p(y) / (1 - p(x)) [y != x] = p(y)``. The noise is the seeded counter hash plain sampling
uses (``seed``, the position the token takes), the acceptance draws on their own lane of
counters: a request's tokens are reproducible from its seed. A greedy row's ``p`` is its
argmax alone, so greedy rows accept exactly as :func:`greedy_accept`. Non-finite logits
give ``p`` as sampling defines it (:mod:`graphcap.opsdb.sample`: +inf and NaN tokens
share the mass), never NaN: a proposal with all of it is always accepted (the coin is
below 1), so a refused one leaves the rest of ``p`` some mass to draw from.
"""

from __future__ import annotations

import torch

from graphcap.opsdb.sample import probabilities, uniform_noise

ACCEPT_LANE = 1 << 62  # added to the acceptance draws' counters: apart from every token's


def greedy_accept(logits: torch.Tensor, tokens: torch.Tensor, step: int) -> torch.Tensor:
    """``[requests, 2]`` int64: each request's accepted proposals (0 .. ``step - 1``) and
    its next token, from ``logits`` ``[requests * step, vocab]`` of the step's ``tokens``
    ``[requests * step]`` (the last accepted token, then ``step - 1`` proposals); rows
    past the last whole request (a bucket's padding) are left out."""
    whole = logits.shape[0] // step * step  # a shape's pad rows past its last request
    target = logits[:whole].argmax(dim=-1).view(-1, step)
    proposed = tokens[:whole].view(-1, step)[:, 1:].to(target.dtype)
    agree = (target[:, :-1] == proposed).to(torch.int64)
    accepted = agree.cumprod(dim=1).sum(dim=1)
    following = target.gather(1, accepted[:, None])[:, 0]
    return torch.stack([accepted, following], dim=1)


def sampled_accept(logits: torch.Tensor, tokens: torch.Tensor, step: int,
                   temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   seed: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """:func:`greedy_accept`'s ``[requests, 2]`` by rejection sampling (the module
    docstring): ``temperature``, ``top_k``, ``top_p``, ``seed`` and ``positions`` of
    every row (a request's sampling on each of its rows; a row's draw takes the position
    after its own, its counter)."""
    whole = logits.shape[0] // step * step
    requests, k, vocab = whole // step, step - 1, logits.shape[1]
    probs = probabilities(logits[:whole], temperature[:whole], top_k[:whole],
                          top_p[:whole]).view(requests, step, vocab)
    proposed = tokens[:whole].view(requests, step)[:, 1:].long()
    chance = probs[:, :k].gather(2, proposed[..., None])[..., 0]  # p(x) of each proposal
    counters = positions[:whole].view(requests, step) + 1
    seeds = seed[:whole:step]
    coin = uniform_noise(seeds.repeat_interleave(k),
                         (counters[:, :k] + ACCEPT_LANE).reshape(-1), 1).view(requests, k)
    accepted = (coin < chance).to(torch.int64).cumprod(dim=1).sum(dim=1)
    row = probs.gather(1, accepted[:, None, None].expand(requests, 1, vocab))[:, 0]
    refused = proposed.gather(1, accepted.clamp_max(k - 1)[:, None])
    residual = torch.where((accepted < k)[:, None], row.scatter(1, refused, 0.0), row)
    noise = uniform_noise(seeds, counters.gather(1, accepted[:, None])[:, 0], vocab)
    gumbel = -torch.log(-torch.log(noise))
    following = (residual.double().log() + gumbel).argmax(dim=1)
    return torch.stack([accepted, following], dim=1)


ACCEPTS = {"greedy": greedy_accept, "sampled": sampled_accept}

__all__ = ["ACCEPTS", "greedy_accept", "sampled_accept"]
