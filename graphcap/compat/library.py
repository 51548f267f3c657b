"""torch.library glue: define an op once, route it to a Python implementation, give it a fake.

``Library.define`` + ``impl`` costs a call a tenth of what ``torch.library.custom_op``
costs (``../shared/REFERENCE.md``), and eager and breakable pay it on every op of every
layer, so opsdb uses the lower-level API.
"""

from __future__ import annotations

import inspect
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


def parse_schema(qualname: str, schema: str) -> torch._C.FunctionSchema:
    """``schema`` (arguments and returns, without the name) of ``qualname``, parsed."""
    split_qualname(qualname)
    try:
        return torch._C.parse_schema(f"{qualname}{schema}")
    except RuntimeError as e:
        raise ValueError(f"{qualname}: the schema {schema!r} does not parse ({e}); write "
                         "it as '(Tensor x, float eps) -> Tensor'") from None


def refuses_arguments(fn: Callable, schema: torch._C.FunctionSchema) -> str | None:
    """Why ``fn`` cannot be called with every argument of ``schema`` positionally, in
    the schema's order (how opsdb calls an op's functions), or None when it can (or its
    signature cannot be read: a builtin)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    try:
        signature.bind(*schema.arguments)
    except TypeError as e:
        return f"{getattr(fn, '__name__', type(fn).__name__)}{signature}: {e}"
    return None


def complete(arguments, args: tuple, kwargs: dict) -> tuple:
    """Every argument of a schema positionally, in its order: ``args`` and ``kwargs`` as
    the dispatcher passes them to a Python kernel (trailing arguments at their default
    left out, keyword-only ones by name), the rest at their defaults."""
    values = list(args)
    for argument in arguments[len(args):]:
        if argument.name in kwargs:
            values.append(kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            raise TypeError(f"missing argument {argument.name!r}")
    return tuple(values)


def in_schema_order(fn: Callable, schema: torch._C.FunctionSchema) -> Callable:
    """``fn`` given every argument of ``schema`` positionally, in the schema's order,
    however the op was called: ``fn`` itself when the schema has no default and no
    keyword-only argument (the dispatcher then passes them all so)."""
    arguments = schema.arguments
    if not any(a.kwarg_only or a.has_default_value() for a in arguments):
        return fn
    count = len(arguments)

    def call(*args, **kwargs):
        if len(args) == count:  # every argument given positionally
            return fn(*args)
        return fn(*complete(arguments, args, kwargs))

    return call


def _library(ns: str) -> torch.library.Library:
    if ns not in _LIBRARIES:
        _LIBRARIES[ns] = torch.library.Library(ns, "FRAGMENT")
    return _LIBRARIES[ns]


def define_op(qualname: str, schema: str, impl: Callable, fake: Callable,
              tags: tuple[torch.Tag, ...] = ()) -> torch._ops.OpOverloadPacket:
    """Define ``qualname`` with ``schema`` (arguments and returns, without the name),
    route CPU and CUDA calls to ``impl`` and fake tensors to ``fake``, each given every
    argument positionally in the schema's order (defaults filled in)."""
    ns, name = split_qualname(qualname)
    parsed = parse_schema(qualname, schema)
    lib = _library(ns)
    lib.define(f"{name}{schema}", tags=tags)
    for key in ("CPU", "CUDA"):
        lib.impl(name, in_schema_order(impl, parsed), key)
    torch.library.register_fake(qualname, in_schema_order(fake, parsed), lib=lib)
    return getattr(getattr(torch.ops, ns), name)


def overload_of(op) -> torch._ops.OpOverload:
    """The overload an op names: an ``OpOverload`` itself, an ``OpOverloadPacket``'s
    default, a ``torch.library.custom_op``'s (``CustomOpDef``), or a qualified name
    (``"ns::op"`` or ``"ns::op.overload"``) of an op registered with torch."""
    if isinstance(op, torch._ops.OpOverload):
        return op
    if not isinstance(op, (str, torch._ops.OpOverloadPacket)) and isinstance(
            getattr(op, "_opoverload", None), torch._ops.OpOverload):  # a CustomOpDef
        return op._opoverload
    if isinstance(op, str):
        ns, _, rest = op.partition("::")
        name, _, overload = rest.partition(".")
        try:
            op = getattr(getattr(torch.ops, ns), name)
        except (AttributeError, RuntimeError):
            raise ValueError(f"no op {op!r} in torch.ops: define it (torch.library), or "
                             f"import the module that does") from None
        op = (op, overload or "default")
    elif isinstance(op, torch._ops.OpOverloadPacket):
        op = (op, "default")
    if isinstance(op, tuple):
        packet, overload = op
        try:
            return getattr(packet, overload)
        except (AttributeError, RuntimeError):
            raise ValueError(f"{packet._qualified_op_name} has no overload {overload!r}: "
                             f"name one of {packet.overloads()}") from None
    raise TypeError(f"{op!r} is no op: pass an OpOverload, an OpOverloadPacket, a "
                    f"torch.library.custom_op or a qualified name 'ns::op'")


def device_types_of(op: torch._ops.OpOverload) -> tuple[str, ...]:
    """The device types (of ``cpu``, ``cuda``) the op has a kernel for, its own or a
    composite one."""
    def has(key: str) -> bool:
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key)
        except RuntimeError:  # an op of TorchScript's alone, not in the dispatcher
            return False

    composite = ("CompositeExplicitAutograd", "CompositeImplicitAutograd")
    return tuple(device for device, key in (("cpu", "CPU"), ("cuda", "CUDA"))
                 if any(has(k) for k in (key, *composite)))
