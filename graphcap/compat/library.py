"""torch.library glue: define an op once, route it to a Python implementation, give it a fake.

``Library.define`` + ``impl`` costs a call a tenth of what ``torch.library.custom_op``
costs (``../shared/REFERENCE.md``), and eager and breakable pay it on every op of every
layer, so opsdb uses the lower-level API.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}


def split_qualname(qualname: str) -> tuple[str, str]:
    """``"ns::name"`` -> ``("ns", "name")``, with a clear error for anything else."""
    ns, sep, name = qualname.partition("::")
    if not sep or not ns.isidentifier() or not name.isidentifier():
        raise ValueError(
            f"op name {qualname!r} must be a qualified name 'namespace::op_name' of two "
            "Python identifiers, e.g. 'myproject::rms_norm'")
    return ns, name


def _library(ns: str) -> torch.library.Library:
    if ns not in _LIBRARIES:
        _LIBRARIES[ns] = torch.library.Library(ns, "FRAGMENT")
    return _LIBRARIES[ns]


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable,
              tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverloadPacket:
    """Define ``qualname`` with ``schema`` (arguments and returns, without the name),
    route CPU and CUDA calls to ``impl`` and fake tensors to ``fake``."""
    ns, name = split_qualname(qualname)
    lib = _library(ns)
    lib.define(f"{name}{schema}", tags=tags)
    for key in ("CPU", "CUDA"):
        lib.impl(name, impl, key)
    torch.library.register_fake(qualname, fake, lib=lib)
    return getattr(getattr(torch.ops, ns), name)
