"""Hypothesis strategies for users' tests: op inputs and prefill batches."""

from __future__ import annotations

import torch

from graphcap.opsdb import get_op
from graphcap.opsdb.spec import OpSpec


def op_inputs(op: str | OpSpec, *, device="cpu", dtype=torch.float32, **constraints):
    """The hypothesis strategy of valid argument tuples of a registered op, from its
    ``OpSpec``; ``constraints`` narrow it (e.g. ``max_tokens=16``)."""
    spec = op if isinstance(op, OpSpec) else get_op(op)
    if spec.inputs is None:
        raise ValueError(f"{spec.qualname} has no input strategy: pass inputs= when "
                         "registering it")
    _check_constraints(spec, constraints)
    return spec.inputs(torch.device(device), dtype, **constraints)


def _check_constraints(spec: OpSpec, constraints: dict) -> None:
    """A keyword the op's input function does not take is refused by name, with the
    keywords it does take (rather than a bare ``TypeError`` from the call)."""
    import inspect

    params = inspect.signature(spec.inputs).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
             ][2:]  # after (device, dtype)
    for key in constraints:
        if key not in takes:
            raise TypeError(f"{spec.qualname}'s input strategy takes no keyword {key!r}; "
                            f"it takes {', '.join(takes) or 'none'}")


def _refuse_empty(what: str, max_tokens: int, max_requests: int, vocab: int,
                  min_token_id: int) -> None:
    """A batch range that holds no request, or ids with no value to take, is refused
    (rather than a batch past ``max_tokens`` or torch's error from ``randint``)."""
    if max_tokens < 1 or max_requests < 1:
        raise ValueError(f"{what}: max_tokens {max_tokens} and max_requests {max_requests} "
                         "must be 1 or more: no batch holds a request")
    if vocab <= min_token_id:
        raise ValueError(f"{what}: vocab {vocab} leaves no token id from min_token_id "
                         f"{min_token_id} (ids are drawn from [min_token_id, vocab))")


def prefill_batches(max_tokens: int, max_requests: int, vocab: int, *, device="cpu",
                    min_token_id: int = 1, min_len: int = 0, max_len: int | None = None):
    """Batches of packed prefill requests: ``(input_ids, positions, seq_lens)`` with 1 to
    ``max_requests`` requests, lengths from ``min_len`` (default 0, sentinel-like) up to
    ``max_len`` each (default: any; a model's positions) and ``max_tokens`` in all, edge
    lengths (1, powers of two and their neighbours, ``max_tokens``) favoured.
    ``min_len=1`` for models that return a row per request."""
    from hypothesis import strategies as st

    _refuse_empty("prefill_batches", max_tokens, max_requests, vocab, min_token_id)
    if min_len > max_tokens:
        raise ValueError(f"prefill_batches: min_len {min_len} exceeds max_tokens "
                         f"{max_tokens}: no request fits")
    longest = max_tokens if max_len is None else min(max_tokens, max_len)
    if longest < max(min_len, 1):
        raise ValueError(f"prefill_batches: max_len {max_len} holds no request of min_len "
                         f"{max(min_len, 1)}")
    if min_len:  # as many requests as fit min_len tokens each
        max_requests = min(max_requests, max_tokens // min_len)
    edges = sorted({0, 1, 2, 3, 4, 7, 8, 15, 16, 31, 32, longest} & set(
        range(min_len, longest + 1)))

    @st.composite
    def draw(d):
        n = d(st.integers(1, max_requests))
        lens = [d(st.one_of(st.sampled_from(edges), st.integers(min_len, longest)))
                for _ in range(n)]
        while sum(lens) > max_tokens:
            i = lens.index(max(lens))
            lens[i] = max(lens[i] // 2, min_len)
        if sum(lens) == 0:
            lens[0] = 1
        seed = d(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(min_token_id, vocab, (sum(lens),), generator=gen)
        pos = torch.cat([torch.arange(n) for n in lens])
        return ids.to(device), pos.to(device), lens

    return draw()


def full_batch(max_tokens: int, max_requests: int, vocab: int, *, device="cpu",
               min_token_id: int = 1, min_len: int = 0, seed: int = 0,
               max_len: int | None = None):
    """One batch of :func:`prefill_batches`' range that packs the most: as many requests
    as fit (up to ``max_requests``, at least ``min_len`` and one token each, at most
    ``max_len``), of unequal lengths where there is room, ``max_tokens`` tokens in all. A
    check of few drawn examples runs it too: hypothesis draws its simplest batch, one
    short request, first."""
    _refuse_empty("full_batch", max_tokens, max_requests, vocab, min_token_id)
    if max_tokens < max(min_len, 1):
        raise ValueError(f"full_batch: max_tokens {max_tokens} holds no request of "
                         f"min_len {max(min_len, 1)} tokens")
    n = max(1, min(max_requests, max_tokens // max(min_len, 1)))
    base = max(min_len, 1)
    spare = max_tokens - n * base
    weights = range(1, n + 1)  # the i-th request takes i parts of what is left
    lens = [base + spare * w // sum(weights) for w in weights]
    lens[-1] += max_tokens - sum(lens)
    if max_len is not None and lens[-1] > max_len:  # even lengths, each within max_len
        if n * max_len < max_tokens:
            raise ValueError(f"full_batch: {max_tokens} tokens need requests of more than "
                             f"max_len {max_len} tokens with {n} requests")
        lens = [max_tokens // n + (i < max_tokens % n) for i in range(n)]
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(min_token_id, vocab, (max_tokens,), generator=gen)
    pos = torch.cat([torch.arange(k) for k in lens])
    return ids.to(device), pos.to(device), lens


def bucket_batches(buckets, max_requests: int, vocab: int, *, device="cpu",
                   min_token_id: int = 1, min_len: int = 0, max_pad_ratio: float = 2.0,
                   seed: int = 0, max_len: int | None = None) -> list:
    """Per bucket (ascending), two batches of :func:`full_batch`'s packing that replay it:
    the most padded one (the fewest tokens it takes: one past the bucket below, and no
    more than ``max_pad_ratio`` times padded) and one that fills it. Hypothesis draws
    few of a ladder's buckets (a bug of one bucket, a tile config picked for its size,
    passes most runs); these reach each of them, on every run."""
    ladder = sorted(set(buckets))
    out = []
    for i, bucket in enumerate(ladder):
        below = ladder[i - 1] if i else 0
        fewest = max(below + 1, -(-bucket // max_pad_ratio), max(min_len, 1))
        for tokens in dict.fromkeys((int(fewest), bucket)):
            if tokens <= bucket:
                out.append(full_batch(tokens, max_requests, vocab, device=device,
                                      min_token_id=min_token_id, min_len=min_len,
                                      seed=seed + tokens, max_len=max_len))
    return out
