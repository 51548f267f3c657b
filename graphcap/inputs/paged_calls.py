"""A call of a paged kind of input (:class:`~graphcap.inputs.paged.PagedInputs`), checked
before anything runs (``BadBatch``, the cache untouched): a step of ``k`` tokens per
request, or requests of any length. Each returns the call's :class:`Batch`: the tokens,
each token's position and request slot (staged on the host, pinned: no sync), and in
``host`` what the call writes once it has run, ``(slot, end)`` per request."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from graphcap.core import checks
from graphcap.core.buckets import decode_ladder, prefill_ladder
from graphcap.core.inputs import Batch, check_packing
from graphcap.errors import BadBatch
from graphcap.inputs.accept import ACCEPTS
from graphcap.inputs.sampling import host_tensors, per_row

if TYPE_CHECKING:
    from graphcap.inputs.paged import PagedInputs

_INTS = (torch.int32, torch.int64)


def check_options(step: int | None, *, attention, slots, output_rows, extend: bool,
                  sample: bool, accept, hidden: bool) -> int | None:
    """:class:`~graphcap.inputs.paged.PagedInputs`' options checked together
    (``ValueError`` naming the one at fault); its ``tokens_per_request`` back, checked."""
    if hidden and not accept and step is not None:
        raise ValueError("hidden=True returns each request's hidden state at its last "
                         "accepted token (a verify step: accept=) or the prefill rows' "
                         "(tokens_per_request=None)")
    if step is not None:
        step = checks.positive_int(step, "tokens_per_request")
        if attention is not None or slots is not None:
            given = " and ".join(f"{name}=" for name, value in (
                ("attention", attention), ("slots", slots)) if value is not None)
            raise ValueError(f"{given} shape a prefill (tokens_per_request=None): a step of "
                             f"{step} token{'s' * (step > 1)} a request attends over the "
                             "cache's pages (decode_attention= picks how) and its buckets "
                             "count the requests' tokens; drop it")
    elif attention is None or slots is None:
        raise ValueError("requests of any length (tokens_per_request=None) need the "
                         "prefill attention backend (attention=) and request slots "
                         "per shape (slots=)")
    else:
        checks.positive_int(slots, "slots")
    if sample and step != 1:
        raise ValueError("sample=True draws one token per request: it needs "
                         "tokens_per_request=1")
    if accept is not None and accept not in ACCEPTS:
        raise ValueError(f"accept={accept!r}: None (logits out), 'greedy' or 'sampled' "
                         "(a verify step's accepted proposals and next token)")
    if accept and (step is None or step < 2):
        raise ValueError(f"accept={accept!r} verifies proposals: it needs "
                         "tokens_per_request=1 + k, k >= 1 (the last accepted token, "
                         "then the proposals)")
    if extend and step is not None:
        raise ValueError("extend=True continues requests of any length: it needs "
                         "tokens_per_request=None (fixed steps always extend)")
    if output_rows not in (None, "tokens", "requests"):
        raise ValueError(f"output_rows={output_rows!r}: None (the model's), 'tokens' or "
                         "'requests' (one row per request)")
    return step


def default_ladder(step: int | None, slots: int | None, cache,
                   max_tokens: int | None = None) -> list[int]:
    """The shapes a paged kind captures where no ``buckets`` are given: those its calls
    can fill. Steps of ``step`` tokens a request: ``step`` times the decode batch ladder
    to the cache's request slots, which bound a step's requests (a step of one request
    replays a graph of its own), or to ``max_tokens // step`` requests; requests of any
    length in ``slots`` request slots: the token ladder to ``max_tokens``, else to 2048 or
    as many tokens as they may hold, ``slots`` times the cache's ``max_len``."""
    if step is None:
        return prefill_ladder(min(2048, slots * cache.max_len) if max_tokens is None
                              else max_tokens)
    if max_tokens is None:
        return [b * step for b in decode_ladder(cache.max_requests)]
    if checks.as_int(max_tokens, "max_tokens") < step:
        raise ValueError(f"max_tokens={max_tokens} holds no step of {step} tokens a request: "
                         f"give at least {step} (a step of one request)")
    return [b * step for b in decode_ladder(max_tokens // step)]


def check_steps(inputs: PagedInputs, args: tuple, kwargs: dict) -> Batch:
    """A step of ``inputs.step`` tokens per request: ``runner(tokens, positions=[...],
    slots=[...])``."""
    known = {"positions", "slots"} | ({"sampling"} if inputs.draws else set())
    unknown = sorted(set(kwargs) - known)
    tokens, k = args[0] if args else None, inputs.step
    if "sampling" in unknown:  # greedy inputs: the call's parameters would go unread
        raise BadBatch("sampling= draws tokens in the graph, which this runner does not: "
                       "capture DecodeInputs(cache, sample=True) (one token per request) "
                       "or, for a verify step, PagedInputs(cache, 1 + k, accept='sampled')")
    if len(args) != 1 or unknown or "positions" not in kwargs or "slots" not in kwargs:
        step = "a decode step" if k == 1 else f"a step of {k} tokens per request"
        raise BadBatch(f"{step} is called as runner(tokens, positions=[...], "
                       "slots=[...]" + (", sampling=[...]" if inputs.draws else "")
                       + f"); got {len(args)} arguments and keywords {sorted(kwargs)}")
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or \
            tokens.dtype not in _INTS or tokens.device != inputs.device:
        raise BadBatch(f"tokens must be a 1-D int64 (or int32) tensor on {inputs.device}, "
                       + ("one per request" if k == 1 else f"{k} per request"))
    checks.check_strided(tokens, "tokens")
    if tokens.shape[0] % k:
        raise BadBatch(f"{tokens.shape[0]} tokens are not {k} per request")
    requests = tokens.shape[0] // k
    if requests == 0:
        raise BadBatch("empty step: at least one request is needed")
    try:
        firsts = checks.host_lengths(kwargs["positions"], "positions")
    except BadBatch:
        firsts = None
    if firsts is None or len(firsts) != requests:
        raise BadBatch(f"positions must be {requests} ints >= 0 (one per request, on "
                       f"the host: a list or a CPU tensor), got {kwargs['positions']!r}")
    slots = inputs.cache.requests(kwargs["slots"], requests)
    params = per_row(kwargs.get("sampling"), requests) if inputs.draws else None
    inputs.cache.check_step(slots, firsts, k, checked=True)
    if inputs.max_position is not None and max(firsts) + k > inputs.max_position:
        raise BadBatch(f"positions {firsts} reach past the model's max_position "
                       f"{inputs.max_position}")
    positions, token_slots = firsts, slots
    if k > 1:
        positions = [p + j for p in firsts for j in range(k)]
        token_slots = [s for s in slots for _ in range(k)]
    host, places = staged_places(inputs, positions, token_slots)  # pinned: no host sync
    args = (tokens, *places)
    if inputs.draws:  # per token: a request's sampling on each of its rows
        args += host_tensors([p for p in params for _ in range(k)], inputs.device)
    return Batch(args, tokens.shape[0], [k] * requests, staged=host,
                 host=[(s, p + k) for s, p in zip(slots, firsts, strict=True)])


def staged_places(inputs: PagedInputs, positions: list[int], token_slots: list[int]
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A step's positions and request slots as one host tensor ``[2, width]``, and its
    first ``len(positions)`` columns' two rows (the call's): once the inputs' buffers
    exist, the next of their ``host_places`` (no allocation), its pad columns position 0
    and no request slot, so that one copy stages them all; before, or past them, pinned
    for the call."""
    rows, count = inputs.host_places, len(positions)
    if rows is None or count > rows.shape[1]:
        host = checks.staged([positions, token_slots], torch.long, inputs.device)
        return host, (host[0], host[1])
    turn = rows.take()
    host = rows.arrays[turn]
    host[0, :count], host[1, :count] = positions, token_slots
    host[0, count:], host[1, count:] = 0, -1
    return rows.tensors[turn], rows.head(turn, count)


def check_requests(inputs: PagedInputs, args: tuple, kwargs: dict) -> Batch:
    """Requests of any length: ``runner(input_ids, positions, seq_lens=[...], slots=[...],
    starts=[...])``."""
    if "slots" not in kwargs:
        raise BadBatch("a prefill into the cache is called as runner(input_ids, "
                       "positions, seq_lens=[...], slots=[...]): slots are the requests' "
                       "cache slots, admitted first")
    if "starts" in kwargs and not inputs.extend:
        raise BadBatch("starts= continues requests already in the cache, which needs "
                       "CachePrefillInputs(..., extend=True); without it each prompt "
                       "starts at position 0")
    lens = checks.check_packed_call(args, kwargs, {"slots", "starts"}, inputs.device,
                                    inputs.per_request)
    if inputs.attends is False:
        check_packing(inputs.name, inputs.attention.name, lens)
    slots = inputs.cache.requests(kwargs["slots"], len(lens))
    starts = _starts(inputs, kwargs.get("starts"), slots, lens)
    # Each token's position and request slot, from the host values the cache's counts
    # follow (the positions given must be the same; check_inputs compares them).
    counts = np.array(lens)
    positions = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts - starts,
                                                    counts)
    host, _ = staged_places(inputs, positions, np.repeat(slots, counts))  # pinned
    if inputs.check_inputs and not torch.equal(args[1].cpu(), host[0]):  # one host sync
        raise BadBatch(f"positions must run from each request's start: starts {starts} and "
                       f"seq_lens {lens} give {positions[:8].tolist()}"
                       f"{'...' * (len(positions) > 8)}")
    ends = [(s, b + n) for s, b, n in zip(slots, starts, lens, strict=True) if n]
    return Batch((args[0], host[0], host[1]), args[0].shape[0], lens, host=ends)


def starts_of(given, requests: int) -> list[int]:
    """Each of ``requests`` requests' first position: ``given`` (one int each), else 0;
    ``BadBatch`` naming what is wrong."""
    if given is None:
        return [0] * requests
    if isinstance(given, (str, bytes)) or not hasattr(given, "__iter__") or (
            isinstance(given, torch.Tensor) and given.dim() != 1):
        raise BadBatch(f"starts must be one int per request (a list, or a 1-D CPU "
                       f"tensor), got {given!r}")
    starts = [checks.as_int(b, "starts", BadBatch) for b in given]
    if len(starts) != requests:
        raise BadBatch(f"starts has {len(starts)} entries for {requests} requests")
    return starts


def _starts(inputs: PagedInputs, given, slots: list[int], lens: list[int]) -> list[int]:
    """Each request's first position, checked against its slot's tokens (``BadBatch``)."""
    starts = starts_of(given, len(slots))
    for slot, start, length in zip(slots, starts, lens, strict=True):
        written = inputs.cache.written(slot)
        if not 0 <= start <= written:
            why = "a position is never negative" if start < 0 else "a request continues " \
                "at most from its last written token"
            raise BadBatch(f"starts: request slot {slot} starts at {start}, but its "
                           f"pages hold {written} tokens; {why}")
        if length:  # a request of no tokens reads no page
            inputs.cache.check_reach(slot, start)
    ends = [b + n for b, n in zip(starts, lens, strict=True)]
    if inputs.max_position is not None and max(ends) > inputs.max_position:
        raise BadBatch(f"requests ending at positions {ends} reach past the model's "
                       f"max_position {inputs.max_position}")
    inputs.cache.check_prompts(slots, ends)
    return starts
