"""What a capture read of the model by address, and a cheap check that it still holds.

A graph reads the model's parameters and buffers where they were at capture: it does not
see a tensor assigned later (``m.w = Parameter(...)``, ``load_state_dict(...,
assign=True)``), nor a tensor whose storage moved (``m.to(dtype)``, ``p.data = ...``),
and the memory it reads may have been freed. :class:`ModelSnapshot` records, at capture,
every submodule, parameter and buffer slot of the model with the tensor and data pointer
it held; :meth:`~ModelSnapshot.current` compares them with the model as it is now, on the
host, in a few microseconds (C-level ``map`` over the slots and one C++ comparison of the
addresses, no Python loop). In-place
updates (``p.copy_(new)``, ``load_state_dict`` without ``assign``) keep every slot, so
replays see them, as eager does.

Python attributes (an ``eps``, a flag, ``training``) are not part of the snapshot: they
are baked into the graphs at capture, as in any CUDA graph; capture again after changing
one.
"""

from __future__ import annotations

import operator

import torch
from torch import nn

from graphcap import compat

_PTR = torch.Tensor.data_ptr


def _slots(model: nn.Module):
    """(dict, key, qualified name) of every submodule, parameter and buffer slot."""
    modules, tensors = [], []
    for prefix, module in model.named_modules(remove_duplicate=True):
        dot = prefix + "." if prefix else ""
        for name in module._modules:
            modules.append((module._modules, name, dot + name))
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    tensors.append((table, name, dot + name))
    return modules, tensors


def _describe(t) -> str:
    if t is None:
        return "removed"
    return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} on {t.device}"


class ModelSnapshot:
    """The model's submodules, parameters and buffers as a capture saw them.

    Held strongly: a tensor replaced after capture stays alive until the runner drops
    this snapshot (at its next capture), so its graphs never read freed memory."""

    def __init__(self, model: nn.Module):
        modules, tensors = _slots(model)
        self._module_dicts = [d for d, _, _ in modules]
        self._module_keys = [k for _, k, _ in modules]
        self._modules = [d[k] for d, k, _ in modules]
        self._module_names = [n for _, _, n in modules]
        self._dicts = [d for d, _, _ in tensors]
        self._keys = [k for _, k, _ in tensors]
        self._names = [n for _, _, n in tensors]
        self._tensors = [d[k] for d, k, _ in tensors]
        self._ptrs = [self._ptr(t) for t in self._tensors]
        # Followed by address too: every tensor with storage (a subclass without one, by
        # identity alone).
        stored = [i for i, p in enumerate(self._ptrs) if p >= 0]
        self._stored = [self._tensors[i] for i in stored]
        self._stored_ptrs = [self._ptrs[i] for i in stored]
        self._stored_indices = list(range(len(stored)))
        self.model = model

    @staticmethod
    def _ptr(t) -> int:
        try:
            return _PTR(t)
        except (RuntimeError, TypeError):  # a tensor subclass without storage: by identity
            return -id(t)

    def current(self) -> bool:
        """Whether every slot holds the tensor (or module) it held at capture, at the same
        address. Cheap enough for every call."""
        modules = map(dict.get, self._module_dicts, self._module_keys)
        if not all(map(operator.is_, modules, self._modules)):
            return False
        now = map(dict.get, self._dicts, self._keys)
        if not all(map(operator.is_, now, self._tensors)):
            return False
        # The same tensors, at the same addresses still (no .data = ..., no .to()).
        return compat.data_ptrs_equal(self._stored, self._stored_ptrs, self._stored_indices)

    def changes(self, limit: int = 5) -> list[str]:
        """What differs from capture, one line per slot (at most ``limit`` of them)."""
        out = []
        for d, k, name, held in zip(self._module_dicts, self._module_keys,
                                    self._module_names, self._modules, strict=True):
            if d.get(k) is not held:
                out.append(f"{name}: " + ("removed" if d.get(k) is None else
                                          f"another module ({type(d.get(k)).__name__})"))
        for d, k, name, held, ptr in zip(self._dicts, self._keys, self._names,
                                         self._tensors, self._ptrs, strict=True):
            now = d.get(k)
            if now is None:
                out.append(f"{name}: removed")
            elif now is not held:
                out.append(f"{name}: another tensor ({_describe(now)}; was "
                           f"{_describe(held)})")
            elif self._ptr(now) != ptr:
                out.append(f"{name}: its storage moved (now {_describe(now)}; the graphs "
                           "read the memory of capture)")
        more = len(out) - limit
        return out[:limit] + ([f"... and {more} more"] if more > 0 else [])

    def devices(self) -> set[torch.device]:
        """The devices the model's tensors are on now."""
        now = (d.get(k) for d, k in zip(self._dicts, self._keys, strict=True))
        return {t.device for t in now if t is not None}
