"""What an eager break of a breakable capture returns: which of its results are graphcap's
copies and which lie on what it was given (:func:`_own`), how results sharing memory lie
on one another (:func:`_shares`), and the checks of a result's kind and layout."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcap.core.snapshot import held_tensors
from graphcap.core.trees import repeats_memory, span, storage_key, storages
from graphcap.errors import CaptureError, ReplayError


def _layout(value) -> tuple:
    """A value's pytree structure and, per tensor leaf, its shape, dtype and device."""
    leaves, spec = tree_flatten(value)
    return spec, [(tuple(t.shape), t.dtype, t.device) if isinstance(t, torch.Tensor)
                  else type(t) for t in leaves]


def _given(leaves: list, seen: dict) -> set[int]:
    """The memory a break is given: its tensor arguments' storages, and those of every
    tensor a module among its arguments holds (parameters, buffers, plain tensor
    attributes: a cache it returns is the module's, which writes through it reach).
    ``seen``: each module's tensors and their storages, found once per capture (a whole
    model passed to every layer's break is walked once), held meanwhile."""
    given = storages(leaves)
    for leaf in leaves:
        if isinstance(leaf, torch.nn.Module):
            if id(leaf) not in seen:
                held = held_tensors(leaf)
                seen[id(leaf)] = (leaf, held, storages(held))
            given |= seen[id(leaf)][2]
    return given


def _own(value, given: set[int]) -> tuple[Any, tuple[bool, ...]]:
    """``value`` with every tensor leaf copied into a new tensor (of its strides), but
    those on an argument's memory (``given``: the arguments' storages before the call;
    the argument, a view of it, an ``out=`` it wrote): kept as they are, so that a write
    through one reaches the other, as eagerly; and for each tensor leaf, whether it was
    kept. Leaves sharing new memory (a tensor returned twice, a tensor and its view) are
    views of one copy of the bytes they span, as they are of theirs; an expanded, empty,
    conjugate or negative view among them is a copy of its own (a replay cannot write
    it, or its flag would not follow)."""
    leaves, spec = tree_flatten(value)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    kept = tuple(storage_key(t) in given for t in tensors)
    groups: dict[int, list[torch.Tensor]] = {}
    for t, k in zip(tensors, kept, strict=True):
        if not k and _shareable(t):  # else a copy of its own
            groups.setdefault(storage_key(t), []).append(t)
    shared = {key: _span_copy(ts) for key, ts in groups.items() if len(ts) > 1}
    flags = iter(kept)

    def copy(t: torch.Tensor) -> torch.Tensor:
        key = storage_key(t)
        if key not in shared or not _shareable(t):
            return t.clone()
        storage, first = shared[key]
        size = t.element_size()
        return torch.empty(0, dtype=t.dtype, device=t.device).set_(
            storage, (t.storage_offset() * size - first) // size, t.shape, t.stride())

    return tree_unflatten([t if not isinstance(t, torch.Tensor) or next(flags)
                           else copy(t) for t in leaves], spec), kept


def _shares(tensors: list[torch.Tensor], kept: tuple[bool, ...]) -> tuple:
    """Per tensor leaf of a break's result: the earlier leaf whose new memory it shares
    (``_own`` made the two views of one copy), its byte offset from it and both one's
    strides, else None."""
    first: dict[int, int] = {}
    out = []
    for i, (t, k) in enumerate(zip(tensors, kept, strict=True)):
        j = i if k or not _shareable(t) else first.setdefault(storage_key(t), i)
        out.append(None if j == i else (j, *_lies_on(t, tensors[j])))
    return tuple(out)


def _check_aliasing(brk, fresh: list[torch.Tensor]) -> None:
    """A replay's results (``fresh``, the tensor leaves of what ``brk``, a ``Break``,
    returned) share memory, with one another and with what the break was given, as they
    did at capture: else ``ReplayError``. Eagerly a write through one of two tensors on
    one memory reaches the other; the graph after the break reads graphcap's copies
    where they were apart at capture (a write through the copy of a result that is its
    argument at replay would not reach the argument), and one copy where they shared."""
    for i, (was, now) in enumerate(zip(brk.shares, _shares(fresh, brk.on_args),
                                       strict=True)):
        if was != now and was is not None:
            raise ReplayError(
                f"eager break {brk.name} returned results {was[0]} and {i} on one "
                "memory at capture (a tensor returned twice, or a tensor and its "
                "view), and apart or as other views at replay: the graph after it "
                "reads them from one buffer. Return results that share memory alike "
                "on every call (or .clone() one of them)")
        if was != now:
            raise ReplayError(
                f"eager break {brk.name} returned results {now[0]} and {i} apart at "
                "capture and on one memory at replay (a tensor returned twice, or a "
                "tensor and its view): the graph after it reads copies of each, so a "
                "write through one would not reach the other as eagerly. Return "
                "results that share memory alike on every call (or .clone() one of them)")
    for i, new in enumerate(fresh):
        if brk.sites[i] is not None:  # on an argument's memory at capture too
            continue
        memory = storages([new])
        if memory & brk.given and memory & _given(brk.at_call[0], {}):  # a module's: still there
            raise ReplayError(
                f"eager break {brk.name} returned a new tensor at capture (result {i}) and "
                "a view of its arguments at replay (an argument, a view of one, or a "
                "tensor a module argument holds): the graph after it reads graphcap's "
                "copy of the capture's, so a write through either would not reach the "
                "other as eagerly. Return the argument on every call, or a .clone() of "
                "it where the forward only reads it")


def _lies_on(t: torch.Tensor, first: torch.Tensor) -> tuple | None:
    """How ``t`` lies on ``first``'s memory (both shareable, one storage): its byte offset
    from ``first`` and both one's strides; else None."""
    if not (_shareable(t) and _shareable(first) and storage_key(t) == storage_key(first)):
        return None
    return t.data_ptr() - first.data_ptr(), first.stride(), t.stride()


def _shareable(t: torch.Tensor) -> bool:
    """Whether ``t`` can be a plain view of a shared copy: not empty, not expanded, not a
    conjugate or negative view (their flags would not follow)."""
    return bool(t.numel()) and not (repeats_memory(t) or t.is_conj() or t.is_neg())


def _span_copy(tensors: list[torch.Tensor]) -> tuple[torch.UntypedStorage, int]:
    """A copy of the bytes ``tensors`` (views of one storage) span, from a byte offset
    every one of their element sizes divides, and that offset."""
    align = max(t.element_size() for t in tensors)
    first = min(t.storage_offset() * t.element_size() for t in tensors) // align * align
    end = max(t.storage_offset() * t.element_size() + span(t)[1] - t.data_ptr()
              for t in tensors)
    raw = torch.empty(0, dtype=torch.uint8, device=tensors[0].device).set_(
        tensors[0].untyped_storage(), first, (end - first,), (1,))
    return raw.clone().untyped_storage(), first


def _check_arguments(name: str, leaves: list) -> None:
    """A break's arguments can be given again at replay: CaptureError for an iterator
    among them (a generator), which the call at capture used up."""
    used = [type(x).__name__ for x in leaves
            if isinstance(x, Iterator) and not isinstance(x, torch.Tensor)]
    if used:
        raise CaptureError(
            f"eager break {name} was given an iterator ({used[0]}): every replay calls it "
            "again on the arguments of capture, where the iterator is used up (a sum over "
            "it would be 0). Pass a list or tuple instead")


def _check_result(name: str, output, device: torch.device) -> None:
    """A break's result is tensors (or None) on the graph's device: CaptureError else."""
    leaves = tree_flatten(output)[0]
    if any(not isinstance(x, torch.Tensor) and x is not None for x in leaves):
        raise CaptureError(
            f"eager break {name} returned a host value ({[type(x).__name__ for x in leaves]}"
            "): replay could only reuse the value of capture. Return tensors (e.g. "
            "torch.tensor on the device, or write into an out= tensor) instead; a "
            "dataclass or class of your own is a leaf to torch's pytree: return a tuple "
            "or dict, or register it with torch.utils._pytree")
    elsewhere = [t.device for t in leaves if isinstance(t, torch.Tensor)
                 and t.device != device]
    if elsewhere:
        raise CaptureError(
            f"eager break {name} returned a tensor on {elsewhere[0]}, not on the graph's "
            f"{device}: a kernel reads a host scalar when it is launched, so the graph "
            "would replay the value of capture. Return it on the device")
