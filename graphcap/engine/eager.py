"""The calls an engine makes on a paged cache, eagerly: prefill requests into their slots,
and one decode step of one token per slot. (Decode under graphs, sampling and a
``generate()`` loop build on these.)

The model is one of graphcap's reference decoders or any model whose attention halves
go through :func:`graphcap.models.blocks.attention_half` with their layer index: it
reads the cache from the forward context.
"""

from __future__ import annotations

import torch

from graphcap.api import backend_for
from graphcap.core.checks import host_lengths
from graphcap.errors import BadBatch
from graphcap.inputs.cache_prefill import CachePrefillInputs
from graphcap.inputs.decode import DecodeInputs
from graphcap.inputs.paged_calls import starts_of
from graphcap.kv.paged import PagedKVCache


@torch.inference_mode()
def prefill(model, cache: PagedKVCache, input_ids: torch.Tensor, seq_lens, slots,
            attention: str | None = None, starts=None) -> torch.Tensor:
    """Run the prompts of requests ``slots`` (admitted in ``cache``), packed in
    ``input_ids`` ``[T]`` with lengths ``seq_lens``, writing their K/V to the cache;
    returns each request's last-token logits ``[requests, vocab]``. Each prompt starts at
    position 0, or with ``starts`` at ``starts[r]`` on the request's cached tokens (an
    extend: a chunk of a long prompt), and must fit the request's admitted tokens."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise BadBatch(f"input_ids must be a 1-d tensor [T], the prompts' tokens packed "
                       f"in one row, got {_described(input_ids)}")
    lens = host_lengths(seq_lens)
    slots = cache.requests(slots, len(lens))
    if 0 in lens or sum(lens) != input_ids.shape[0]:
        raise BadBatch(f"seq_lens {lens} must be positive and sum to the {input_ids.shape[0]}"
                       " tokens of input_ids")
    device = input_ids.device
    rows = getattr(model, "output_rows", "tokens")
    # eager: the host may read the ids (as decode_step does): one outside the vocabulary
    # is refused, not wrapped around (negative) or faulting on the device (past its end)
    inputs = CachePrefillInputs(cache, backend_for(model, attention, device), len(lens),
                                rows, name=type(model).__name__, extend=starts is not None,
                                check_inputs=True)
    inputs.bind(model)
    begin = starts_of(starts, len(lens))  # checked against the cache by inputs.check
    positions = torch.cat([torch.arange(b, b + n, device=device)
                           for b, n in zip(begin, lens, strict=True)])
    extra = {} if starts is None else {"starts": begin}
    batch = inputs.check((input_ids, positions), {"seq_lens": lens, "slots": slots, **extra})
    return last_token_logits(_run(inputs, model, batch), lens, rows)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


def _run(inputs, model, batch):
    """``batch`` run eagerly: its tokens count as written once it ran; a run that raised
    keeps each request's tokens before the call's only (it may have written some)."""
    try:
        out = inputs.eager(model, batch)()
        inputs.commit(batch)  # interrupted before it is whole: the call counts nothing
    except BaseException:
        inputs.abandon(batch)
        raise
    return out


def last_token_logits(out: torch.Tensor, lens: list[int], output_rows: str) -> torch.Tensor:
    """Each request's last-token row of a prefill's ``out``: ``out`` itself when the
    model gives one row per request (``output_rows == "requests"``), else its rows at
    the requests' ends."""
    if output_rows == "requests":
        return out
    return out[torch.tensor(lens, device=out.device).cumsum(0) - 1]


@torch.inference_mode()
def decode_step(model, cache: PagedKVCache, input_ids: torch.Tensor, positions,
                slots) -> torch.Tensor:
    """One decode step: row ``b`` is token ``input_ids[b]`` at position ``positions[b]``
    (host ints, as a runner takes them, or a tensor) of the request in slot ``slots[b]``
    (its previous tokens in the cache). Writes the tokens' K/V and returns their logits
    ``[B, vocab]``."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
        raise BadBatch(f"input_ids must be a 1-d tensor [B], one token per row, got "
                       f"{_described(input_ids)}")
    if isinstance(positions, torch.Tensor):
        if positions.shape != input_ids.shape:
            raise BadBatch(f"input_ids {tuple(input_ids.shape)} and positions "
                           f"{tuple(positions.shape)} must be [B], one token per row")
        positions = positions.tolist()
    inputs = DecodeInputs(cache, check_inputs=True)  # eager: the host may read the ids
    inputs.bind(model)
    batch = inputs.check((input_ids,), {"positions": positions, "slots": slots})
    return _run(inputs, model, batch)
