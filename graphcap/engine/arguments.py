"""What ``graphcap.generate`` is given, checked before anything runs: prompts, stop
tokens, sampling parameters."""

from __future__ import annotations

import dataclasses
import operator

import torch

from graphcap.errors import BadBatch
from graphcap.inputs.sampling import Sampling


def check_prompts(prompts, vocab: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        head = ", ".join(map(str, prompts[:6])) + (", ..." if len(prompts) > 6 else "")
        raise ValueError(f"prompts is a list of token-id lists, one per prompt: for one "
                         f"prompt pass [[{head}]], not [{head}]")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = p.tolist() if isinstance(p, torch.Tensor) and p.dim() == 1 else list(p)
        except TypeError:  # a number, or a 0-d tensor
            ids = None
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                          for t in ids):  # before anything launches (BadBatch: a ValueError)
            raise BadBatch(f"prompt {i} must be a non-empty list of token ids in "
                           f"[0, {vocab}), got {p!r}")
        out.append(ids)
    return out


def _token_id(value) -> int:
    """``value`` as an int; TypeError for a bool (no token id, though ``True == 1``)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def eos_ids(value) -> set[int]:
    """An ``eos_token_id`` as transformers' configs give it (an int, a list of them, or
    None) as a set of ids."""
    return {int(v) for v in ([value] if isinstance(value, int) else value or [])}


def stop_tokens_of(stop_tokens, vocab: int) -> set[int]:
    if stop_tokens is None:
        return set()
    given = stop_tokens
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    elif isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    try:
        stops = {_token_id(t.item() if isinstance(t, torch.Tensor) else t)
                 for t in stop_tokens}
    except TypeError:
        raise ValueError(f"stop_tokens must be token ids (ints), got {given!r}") \
            from None
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError(f"stop_tokens {sorted(stops)} must lie in [0, {vocab})")
    return stops


def sampling_of(sampling, count: int) -> list[Sampling]:
    """One Sampling per prompt. One given for all: each prompt draws with a seed of its
    own, derived from it and the prompt's index (the same prompt twice draws twice)."""
    if sampling is None:
        return [Sampling()] * count
    if isinstance(sampling, Sampling):
        return [dataclasses.replace(sampling, seed=(sampling.seed * 1000003 + i) % 2**63)
                for i in range(count)]
    try:
        sampling = list(sampling)
    except TypeError:
        raise ValueError(f"sampling must be a graphcap.Sampling (one for all prompts), a "
                         f"list of them (one per prompt) or None, got {sampling!r}") from None
    if len(sampling) != count:
        raise ValueError(f"sampling: one Sampling for every prompt, or one for all; got "
                         f"{len(sampling)} for {count} prompts")
    for i, s in enumerate(sampling):
        if not isinstance(s, Sampling):
            raise ValueError(f"sampling[{i}] must be a graphcap.Sampling, got {s!r}")
    return sampling
