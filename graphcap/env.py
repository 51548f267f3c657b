"""Every environment variable graphcap reads, read here, once.

- ``GRAPHCAP_GRAPH``: ``emulated`` forces the CPU emulator on CUDA tensors (debugging),
  ``cuda`` insists on CUDA graphs.
- ``GRAPHCAP_DEBUG_CUDA_GRAPH=1`` (or ``true``, ``on``, ``yes``):
  ``capture(..., strategy="breakable")`` runs the whole forward as one eager break.
- ``GRAPHCAP_PDL=0`` (or ``false``, ``off``, ``no``): the project's Triton kernels launch
  without programmatic dependent launch.
- ``GRAPHCAP_<OP>_KERNEL``: the kernel an op runs unless a call names one
  (``GRAPHCAP_RMS_NORM_KERNEL=flashinfer``).
- ``GRAPHCAP_COMMIT``: the commit ``graphcap bench`` records where the tree is no git
  checkout of its own.
- ``TRITON_INTERPRET=1`` (Triton's; ``true``, ``on``, ``yes`` too, as Triton reads it):
  Triton kernels run in its interpreter, on CPU tensors too.
- ``PYTORCH_CUDA_ALLOC_CONF`` (torch's): whether one free block of a graph pool splits.

They are read when graphcap is imported, so that no op call reads the environment: after
changing ``os.environ`` in a running process, call :func:`reload`. A switch of another
value than those above is read as its default, with a warning naming it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field

_OFF = ("0", "false", "off", "no")
_ON = ("1", "true", "on", "yes")
_TRITON_ON = (*_ON, "y")  # Triton's own reading, in any case
_KERNEL = ("GRAPHCAP_", "_KERNEL")


@dataclass(frozen=True)
class Settings:
    graph: str = ""  # GRAPHCAP_GRAPH, lower-cased ("" unset)
    debug_cuda_graph: bool = False
    pdl: bool = True
    triton_interpret: bool = False
    commit: str = ""
    alloc_conf: str = ""  # PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF, joined
    kernels: dict[str, str] = field(default_factory=dict)  # op name -> kernel


def _read() -> Settings:
    env = os.environ
    kernels = {name[len(_KERNEL[0]):-len(_KERNEL[1])].lower(): value
               for name, value in env.items()
               if name.startswith(_KERNEL[0]) and name.endswith(_KERNEL[1]) and value}
    return Settings(
        graph=env.get("GRAPHCAP_GRAPH", "").strip().lower(),
        debug_cuda_graph=_flag(env, "GRAPHCAP_DEBUG_CUDA_GRAPH", False),
        pdl=_flag(env, "GRAPHCAP_PDL", True),
        triton_interpret=env.get("TRITON_INTERPRET", "").lower() in _TRITON_ON,
        commit=env.get("GRAPHCAP_COMMIT", ""),
        alloc_conf=env.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + env.get(
            "PYTORCH_ALLOC_CONF", ""),
        kernels=kernels)


def _flag(env, name: str, default: bool) -> bool:
    """A switch: one of :data:`_ON` or :data:`_OFF` in any case, else its default, with a
    warning naming the value (a typo is told, not silently read as the default)."""
    value = env.get(name, "").strip().lower()
    if value in _ON or value in _OFF:
        return value in _ON
    if value:
        warnings.warn(f"{name}={env[name]!r} is neither on ({', '.join(_ON)}) nor off "
                      f"({', '.join(_OFF)}): read as {'on' if default else 'off'}, its "
                      "default", stacklevel=4)
    return default


def _renamed(env) -> None:
    """The variables that named an op's kernel a backend: said, not silently ignored."""
    old = sorted(n for n in env if n.startswith("GRAPHCAP_") and n.endswith("_BACKEND"))
    if old:
        warnings.warn(f"{', '.join(old)}: graphcap reads GRAPHCAP_<OP>_KERNEL now (e.g. "
                      "GRAPHCAP_RMS_NORM_KERNEL); these are ignored", stacklevel=3)


_SETTINGS = _read()
_renamed(os.environ)


def settings() -> Settings:
    """The settings read at import (or at the last :func:`reload`)."""
    return _SETTINGS


def reload() -> Settings:
    """Read the environment again (after ``os.environ`` changed in this process)."""
    global _SETTINGS
    _SETTINGS = _read()
    _renamed(os.environ)
    return _SETTINGS


def kernel_variable(op_name: str) -> str:
    """The variable that picks ``op_name``'s kernel: ``GRAPHCAP_<OP>_KERNEL``."""
    return f"{_KERNEL[0]}{op_name.upper()}{_KERNEL[1]}"
