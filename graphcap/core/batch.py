"""Validating a runner call before anything is copied or replayed."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from graphcap.errors import BadBatch

__all__ = ["BadBatch", "check_prefill", "check_tensors"]


_INT_DTYPES = (torch.int32, torch.int64)


def check_tensors(args: Sequence, specs: Sequence[tuple[torch.dtype, tuple[int, ...]]],
                  device: torch.device) -> int:
    """Generic models: every argument a tensor with the captured dtype, device and
    trailing shape, all sharing dim 0 (the token dim). Returns the token count."""
    if len(args) != len(specs):
        raise BadBatch(f"expected {len(specs)} tensor arguments, got {len(args)}")
    tokens = None
    for i, (a, (dtype, tail)) in enumerate(zip(args, specs, strict=True)):
        if not isinstance(a, torch.Tensor):
            raise BadBatch(f"argument {i} must be a tensor, got {type(a).__name__}")
        if a.device != device:
            raise BadBatch(f"argument {i} is on {a.device}; the runner captured {device}: "
                           f"move it with .to({str(device)!r})")
        if a.dtype != dtype:
            raise BadBatch(f"argument {i} has dtype {a.dtype}; the runner captured {dtype}")
        if a.dim() == 0 or tuple(a.shape[1:]) != tail:
            raise BadBatch(f"argument {i} has shape {tuple(a.shape)}; expected (tokens, "
                           f"{', '.join(map(str, tail))})" if tail else
                           f"argument {i} has shape {tuple(a.shape)}; expected (tokens,)")
        tokens = a.shape[0] if tokens is None else tokens
        if a.shape[0] != tokens:
            raise BadBatch(f"arguments disagree on the token count (dim 0): {tokens} and "
                           f"{a.shape[0]}")
    if not tokens:
        raise BadBatch("empty batch: at least one token is needed")
    return tokens


def check_prefill(input_ids, positions, seq_lens, device: torch.device) -> list[int]:
    """Prefill models: ids and positions [T] integer tensors on the device; ``seq_lens``
    host lengths, non-negative, summing to T. Returns the lengths as ints."""
    for name, t in (("input_ids", input_ids), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dim() != 1:
            raise BadBatch(f"{name} must be a 1-D tensor of token ids/positions")
        if t.dtype not in _INT_DTYPES:
            raise BadBatch(f"{name} has dtype {t.dtype}; use torch.int64 (or int32)")
        if t.device != device:
            raise BadBatch(f"{name} is on {t.device}; the runner captured {device}")
    if input_ids.shape != positions.shape:
        raise BadBatch(f"input_ids {tuple(input_ids.shape)} and positions "
                       f"{tuple(positions.shape)} must have the same length")
    if seq_lens is None:
        raise BadBatch("a prefill call needs seq_lens=[...] (tokens of each request)")
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu":
            raise BadBatch("seq_lens must be host values (a list or CPU tensor)")
        seq_lens = seq_lens.tolist()
    lens = [int(n) for n in seq_lens]
    if not lens or input_ids.shape[0] == 0:
        raise BadBatch("empty batch: at least one request with one token is needed")
    if any(n < 0 for n in lens):
        raise BadBatch(f"seq_lens must be non-negative, got {lens}")
    if sum(lens) != input_ids.shape[0]:
        raise BadBatch(f"seq_lens sum to {sum(lens)} but there are {input_ids.shape[0]} "
                       "tokens: they must match")
    return lens

