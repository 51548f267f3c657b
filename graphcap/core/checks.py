"""Validating a runner call before anything is copied or replayed."""

from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from graphcap.errors import BadBatch

__all__ = ["BadBatch", "as_int", "check_lengths", "check_prefill", "check_tensors",
           "check_token_ids", "host_lengths", "staged"]


_INT_DTYPES = (torch.int32, torch.int64)
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32}


def staged(data, dtype: torch.dtype, device) -> torch.Tensor:
    """Host values a call stages into a device buffer, as a host tensor the copy reads
    without a host sync: pinned when ``device`` is CUDA (torch's caching host allocator
    keeps a pinned block until the copies that read it have run)."""
    pin = torch.device(device).type == "cuda"
    kind = _NUMPY.get(dtype)
    if kind is None:
        return torch.tensor(data, dtype=dtype, pin_memory=pin)
    # numpy converts a list of ints 2-3x faster than torch.tensor (3.5 against 9.5 us at
    # 2 x 64 on the CI host), which the GPU waits for at every decode step.
    host = torch.from_numpy(np.array(data, dtype=kind))
    return host.pin_memory() if pin else host


def as_int(value, what: str, error: type[Exception] = ValueError) -> int:
    """``value`` as an int when it is an integer (a Python or numpy integer, or a 0-d
    integer tensor on the host); anything else (a float, even 7.0, a string, a bool, a
    tensor on the device, whose value the host would wait for) raises ``error`` naming
    ``what``: a length or size is never rounded."""
    if type(value) is int:  # the common case first: calls check every slot and position
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() != 0 or value.device.type != "cpu" or value.dtype not in (
                torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
            raise error(f"{what} must be an integer, got a tensor of {value.dtype} and "
                        f"shape {tuple(value.shape)} on {value.device} (a 0-d integer "
                        "tensor on the host, or a Python int)")
        return int(value)
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise error(f"{what} must be an integer, got {value!r} ({type(value).__name__})")


def boolean(value, what: str, error: type[Exception] = ValueError) -> bool:
    """``value`` if it is True or False (a numpy bool too); anything else (None, 0, a
    string such as "no", which Python would take as true) raises ``error`` naming
    ``what``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise error(f"{what} must be True or False, got {value!r}")


def progress_option(value, what: str = "progress"):
    """A progress option: None or a bool (a bar, or none), or a callable ``(done,
    total)``; anything else raises ``ValueError`` naming ``what``."""
    if value is None or isinstance(value, (bool, np.bool_)) or callable(value):
        return value
    raise ValueError(f"{what} must be True, False, None or a callable (done, total), got "
                     f"{value!r}")


def positive_int(value, what: str, error: type[Exception] = ValueError) -> int:
    """``value`` as an int >= 1 (an integer as :func:`as_int` takes it); ``error`` naming
    ``what`` otherwise."""
    try:
        number = as_int(value, what, error)
    except error:
        number = 0
    if number < 1:
        raise error(f"{what} must be a positive int, got {value!r}")
    return number


def host_lengths(seq_lens, what: str = "seq_lens", error: type[Exception] = BadBatch
                 ) -> list[int]:
    """Request lengths given on the host (a list, tuple, numpy array or CPU integer
    tensor) as ints, each an integer >= 0; ``error`` names ``what`` otherwise."""
    if isinstance(seq_lens, (torch.Tensor, np.ndarray)) and seq_lens.ndim != 1:
        raise error(f"{what} must be one length per request (1-D), got a "
                    f"{type(seq_lens).__name__} of shape {tuple(seq_lens.shape)}")
    if isinstance(seq_lens, np.ndarray):
        seq_lens = list(seq_lens)  # numpy integers, each checked as one
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu":
            raise error(f"{what} must be host values (a list or CPU tensor): reading them "
                        "from the device would synchronise")
        if seq_lens.dtype not in _INT_DTYPES + (torch.int16, torch.int8, torch.uint8):
            raise error(f"{what} is a tensor of {seq_lens.dtype}; lengths are integers")
        seq_lens = seq_lens.tolist()
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence):
        raise error(f"{what} must be a list of request lengths, got "
                    f"{type(seq_lens).__name__}")
    if type(seq_lens) is list and set(map(type, seq_lens)) == {int}:
        lens = seq_lens[:]  # ints already (a runner's usual call): none to convert
    else:
        lens = [as_int(n, f"every entry of {what}", error) for n in seq_lens]
    if lens and min(lens) < 0:
        raise error(f"{what} must be non-negative, got {lens}")
    return lens


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
        check_strided(a, f"argument {i}")
        if a.dtype != dtype:
            raise BadBatch(f"argument {i} has dtype {a.dtype}; the runner captured {dtype}: "
                           f"cast it with .to({dtype}), or capture the model for inputs "
                           "of this dtype (runner.capture_all(example) of them)")
        if a.dim() == 0 or tuple(a.shape[1:]) != tail:
            raise BadBatch(f"argument {i} has shape {tuple(a.shape)}; expected (tokens, "
                           f"{', '.join(map(str, tail))})" if tail else
                           f"argument {i} has shape {tuple(a.shape)}; expected (tokens,)")
        tokens = a.shape[0] if tokens is None else tokens
        if a.shape[0] != tokens:
            raise BadBatch(f"argument {i} has {a.shape[0]} rows along dim 0 but argument 0 "
                           f"has {tokens}: every argument of a model of tensors has the "
                           "call's rows (tokens) along dim 0; pass a tensor of other rows "
                           "as a parameter or buffer of the model")
    if not tokens:
        raise BadBatch("empty batch: at least one token is needed")
    return tokens


def check_strided(t: torch.Tensor, what: str) -> None:
    """A dense tensor: one of another layout (sparse, mkldnn) cannot be copied into a
    static buffer, which would fail only once the call is under way."""
    if t.layout != torch.strided:
        raise BadBatch(f"{what} is a {str(t.layout).removeprefix('torch.')} tensor; the "
                       "runner copies dense tensors into its buffers: pass t.to_dense()")


def check_lengths(seq_lens, *, tokens: int | None = None, slots: int | None = None,
                  exact: bool = False, error: type[Exception] = BadBatch) -> list[int]:
    """The one check of request lengths: integers >= 0 given on the host
    (:func:`host_lengths`), at least one request, at most ``slots`` of them, summing to at
    most ``tokens`` (exactly, with ``exact``). Returns them as ints."""
    lens = host_lengths(seq_lens, error=error)
    if not lens:
        raise error("seq_lens is empty: a batch needs at least one request")
    if slots is not None and len(lens) > slots:
        raise error(f"{len(lens)} requests do not fit {slots} request slots")
    if tokens is not None and (sum(lens) != tokens if exact else sum(lens) > tokens):
        raise error(f"seq_lens sum to {sum(lens)} but there are {tokens} tokens: they must "
                    "match" if exact else f"seq_lens sum to {sum(lens)} tokens, more than "
                    f"the {tokens} rows of q/k/v")
    return lens


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
        check_strided(t, name)
    if input_ids.shape != positions.shape:
        raise BadBatch(f"input_ids {tuple(input_ids.shape)} and positions "
                       f"{tuple(positions.shape)} must have the same length")
    if seq_lens is None:
        raise BadBatch("a prefill call needs seq_lens=[...] (tokens of each request)")
    if input_ids.shape[0] == 0:
        raise BadBatch("empty batch: at least one request with one token is needed")
    return check_lengths(seq_lens, tokens=input_ids.shape[0], exact=True)



def check_packed_call(args: tuple, kwargs: dict, keywords: set[str], device: torch.device,
                      per_request: bool) -> list[int]:
    """A call of packed requests, ``runner(input_ids, positions, seq_lens=[...])`` with
    ``keywords`` beside ``seq_lens``: its form and lengths (:func:`check_prefill`), no
    zero-length request for a model of one row per request. Returns the lengths."""
    unknown = sorted(set(kwargs) - keywords - {"seq_lens"})
    if unknown or len(args) != 2:
        raise BadBatch("a prefill model is called as runner(input_ids, positions, "
                       f"seq_lens=[...]); got {len(args)} arguments"
                       + (f" and keywords {unknown}" if unknown else ""))
    lens = check_prefill(*args, kwargs.get("seq_lens"), device)
    if per_request:
        check_last_tokens(lens)
    return lens


def check_last_tokens(lens) -> None:
    """Every request of a model that returns one row per request has a last token."""
    if 0 in lens:
        raise BadBatch(f"seq_lens {list(lens)} has a zero-length request, which has no last "
                       "token: this model returns one row per request; drop empty requests")


def check_ranges(input_ids, positions, vocab_size: int, max_position: int | None) -> None:
    """The input check of an eager call given ``seq_lens`` (``PrefillLM``, ``Decoder``)
    and the opt-in one of a runner (``graphcap.capture(..., check_inputs=True)``): ids in
    ``[0, vocab_size)`` and positions in ``[0, max_position)``. It reads the extremes on
    the host: one synchronisation per call. Without it an id out of range is not caught:
    a negative one wraps around the embedding table, a large one faults on the device."""
    lo_id, hi_id = torch.aminmax(input_ids)
    lo_pos, hi_pos = torch.aminmax(positions)
    lo_id, hi_id, lo_pos, hi_pos = torch.stack([lo_id, hi_id, lo_pos, hi_pos]).tolist()
    _check_ids(lo_id, hi_id, vocab_size, "input_ids")
    if lo_pos < 0 or (max_position is not None and hi_pos >= max_position):
        bound = f"[0, {max_position})" if max_position is not None else "[0, ...)"
        what = ("each request's positions count from 0" if lo_pos < 0 else
                f"position {hi_pos} reaches past the model's max_position {max_position} "
                f"(the rows of its rotary table): give requests that end before position "
                f"{max_position}, or a model built for more positions")
        raise BadBatch(f"positions range over [{lo_pos}, {hi_pos}], outside {bound}: "
                       f"{what}")


def check_token_ids(ids: torch.Tensor, vocab_size: int, what: str = "tokens") -> None:
    """``BadBatch`` unless every id of ``ids`` (a non-empty integer tensor) lies in
    ``[0, vocab_size)``: one host sync. Unchecked, a negative id wraps around the
    embedding table and a large one faults on the device (on CUDA, a device-side assert
    that ends the process's CUDA context)."""
    lo, hi = torch.stack(list(torch.aminmax(ids))).tolist()
    _check_ids(lo, hi, vocab_size, what)


def _check_ids(lo: int, hi: int, vocab_size: int, what: str) -> None:
    if lo < 0 or hi >= vocab_size:
        raise BadBatch(f"{what} range over [{lo}, {hi}], outside the vocabulary "
                       f"[0, {vocab_size})")
