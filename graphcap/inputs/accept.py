"""Greedy acceptance of a verify step's proposals, on the device (no host sync: it runs
inside the step's graph).

A verify step brings ``1 + k`` tokens per request: the request's last accepted token,
then ``k`` proposed ones. Row ``j`` of a request's logits predicts its token ``j + 1``.
The target's greedy choice ``argmax`` at rows ``0 .. k - 1`` is compared with the
proposals; a request accepts its proposals up to the first that differs, and its next
token is the target's choice after the last accepted one (a token the step gains even
when nothing is accepted). Accepting this way gives the tokens plain greedy decoding
gives, whatever was proposed.
"""

from __future__ import annotations

import torch


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


__all__ = ["greedy_accept"]
