"""Weights fused for a kernel, still the model's own: its parameters become views into them.

graphcap's attention block reads q, k and v as one ``[q | k | v]`` matrix and its SwiGLU
block gate and up as one ``[gate | up]``. A stock transformers layer keeps them in
separate ``nn.Linear`` modules. :class:`Fused` concatenates them once and puts views of
the result back into the modules' parameter slots, so the memory is the model's, not a
copy, and ``state_dict``, ``load_state_dict`` (in place) and ``p.copy_(...)`` reach the
fused weight. A parameter later assigned anew or moved (``m.weight = Parameter(...)``,
``load_state_dict(..., assign=True)``, ``model.to(dtype)``) is no longer a view:
:meth:`Fused.intact` says so, and :meth:`Fused.rebuild` concatenates the current ones again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Fused:
    """One fused tensor and the parameter slots that are views of consecutive rows of
    it: ``(module, name)`` each."""

    slots: list[tuple[nn.Module, str]]
    tensor: torch.Tensor = field(init=False)
    _where: list[tuple[int, torch.dtype, torch.device, tuple]] = field(init=False)

    def __post_init__(self):
        self.rebuild()

    def current(self) -> list[torch.Tensor]:
        return [module._parameters[name] for module, name in self.slots]

    def intact(self) -> bool:
        """Whether every slot still holds the view it was given (host work only)."""
        for (module, name), (ptr, dtype, device, shape) in zip(self.slots, self._where,
                                                                strict=True):
            p = module._parameters.get(name)
            if p is None or p.data_ptr() != ptr or p.dtype != dtype or p.device != device \
                    or tuple(p.shape) != shape:
                return False
        return True

    def rebuild(self) -> None:
        """Concatenate the slots' current tensors along dim 0 and put views of the result
        back (each keeps its ``requires_grad``); the old tensors are freed with their last
        reference."""
        parts = self.current()
        # Normal tensors even when called under inference_mode: they are parameters.
        with torch.inference_mode(False), torch.no_grad():
            fused = torch.cat([p.detach() for p in parts])
        start, where = 0, []
        for (module, name), p in zip(self.slots, parts, strict=True):
            view = fused[start:start + p.shape[0]]
            setattr(module, name, nn.Parameter(view, requires_grad=p.requires_grad))
            where.append((view.data_ptr(), view.dtype, view.device, tuple(view.shape)))
            start += p.shape[0]
        self.tensor, self._where = fused, where


def check_fusable(slots: list[tuple[nn.Module, str]]) -> str | None:
    """Why these slots cannot be fused (or None): all present, on one device and dtype,
    with equal trailing dims and real storage."""
    parts = []
    for module, name in slots:
        p = module._parameters.get(name)
        if p is None:
            return f"{type(module).__name__}.{name} is missing"
        parts.append(p)
    if len({(p.device, p.dtype) for p in parts}) != 1:
        return "the weights differ in device or dtype"
    if len({tuple(p.shape[1:]) for p in parts}) != 1:
        return "the weights' trailing dims differ"
    if parts[0].device.type == "meta":
        return "the weights are on the meta device (not loaded)"
    return None
