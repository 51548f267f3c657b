"""Which inputs a piece of Dynamo's FX graph writes: in place, through a view of them, by
item assignment or into an ``out=`` tensor. A captured piece reads a static copy of such
an input, so what it writes there is copied back to the caller's tensor after each replay.

The graph is torch-level (Dynamo's, before any decomposition): a write names the tensor it
writes, which may be a view of an input several ops away (``cache[:n].add_(y)``,
``cache.narrow(0, 0, n).copy_(y)``, ``x.T.mul_(-1)``), or is a functional call given
``inplace=True`` (``F.relu(x, inplace=True)``, as Dynamo keeps it). A node made from an
input by an op that may return a view of it (or the input itself: ``x.float()`` of a
float tensor), or whose example value shares an input's memory (a view an op of several
tensors returns, ``torch.broadcast_tensors(a, x)[1]``), counts as that input; a conversion
to another dtype or device (Dynamo's example values say) is a new tensor.
"""

from __future__ import annotations

import inspect
import operator

import torch
import torch.fx

from graphcap.core.trees import overlap, reach, storage_key

# Tensor methods and torch functions that may return their first argument or a view of it.
VIEWS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "narrow", "select", "t", "transpose",
    "permute", "expand", "expand_as", "unsqueeze", "squeeze", "flatten", "unflatten",
    "as_strided", "diagonal", "unbind", "split", "split_with_sizes", "chunk",
    "tensor_split", "hsplit", "vsplit", "movedim", "moveaxis", "swapaxes", "swapdims",
    "unfold", "detach", "contiguous", "to", "type", "type_as", "float", "half", "bfloat16",
    "double", "int", "long", "bool", "cpu", "cuda", "view_as_real", "view_as_complex",
    "real", "imag", "alias", "align_as", "refine_names", "rename", "__getitem__",
    "getitem", "requires_grad_", "data", "_get_data_attr", "ravel", "broadcast_to",
    "positive", "conj", "adjoint", "atleast_1d", "atleast_2d", "atleast_3d"})
# Attributes that are views of their tensor: Dynamo traces ``x.T`` as ``getattr(x, "T")``.
VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})
# Of those, the ones that convert: a view only where the dtype and device stay the same.
CONVERSIONS = frozenset({"to", "type", "type_as", "float", "half", "bfloat16", "double",
                         "int", "long", "bool", "cpu", "cuda"})
# operator's in-place forms (x += y): they write their first argument.
IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
    operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
    operator.ixor, operator.ilshift, operator.irshift, operator.imatmul})


def _name(node: torch.fx.Node) -> str:
    target = node.target
    return target if isinstance(target, str) else getattr(target, "__name__", "")


def _overload(target):
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target.default
    return target if isinstance(target, torch._ops.OpOverload) else None


def _first(node: torch.fx.Node):
    """The tensor ``node`` works on: its first argument, or the ``input`` a torch function
    was given by keyword (``F.relu(input=x, inplace=True)``, ``torch.flatten(input=x)``);
    None if neither."""
    return node.args[0] if node.args else node.kwargs.get("input")


def _may_alias(node: torch.fx.Node) -> bool:
    """Whether ``node`` may be (a view of) its first tensor argument."""
    if node.op not in ("call_method", "call_function"):
        return False
    first = _first(node)
    if first is not None and _shares_memory(node, first):  # as traced: whatever the op
        return True
    op = _overload(node.target)
    if op is not None:
        return any(r.alias_info is not None for r in op._schema.returns)
    if node.target is operator.getitem:
        return True
    if node.target is getattr:
        return len(node.args) > 1 and node.args[1] in VIEW_ATTRIBUTES
    if _inplace_call(node):  # returns its input, written
        return True
    name = _name(node)
    if name in CONVERSIONS:
        return _same_kind(node, first)
    return name in VIEWS


def _same_kind(node: torch.fx.Node, source) -> bool:
    """Whether Dynamo's example values of ``node`` and ``source`` have one dtype and
    device (True where it recorded none: the conversion may return its input)."""
    new = node.meta.get("example_value")
    old = source.meta.get("example_value") if isinstance(source, torch.fx.Node) else None
    if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
        return True
    return new.dtype == old.dtype and new.device == old.device


def _shares_memory(node: torch.fx.Node, source) -> bool:
    """Whether Dynamo's example values of ``node`` and ``source`` share one storage (a
    view, or the tensor itself: ``x.ravel()``, ``getattr(x, "mT")``)."""
    new = _storage(node)
    return new is not None and isinstance(source, torch.fx.Node) and new == _storage(source)


def _storage(node: torch.fx.Node) -> int | None:
    """The storage of Dynamo's example value of ``node``, where it is a tensor with one."""
    value = node.meta.get("example_value")
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):  # a tensor subclass without a storage
        return None


def _inplace_call(node: torch.fx.Node) -> bool:
    """Whether ``node`` calls a function with ``inplace=True``, by keyword or position
    (``F.relu(x, inplace=True)``, ``F.dropout(x, 0.1, False, True)``): it writes its
    first argument and returns it."""
    if node.op != "call_function" or _first(node) is None or \
            _overload(node.target) is not None:
        return False
    if node.kwargs.get("inplace") is True:
        return True
    try:
        signature = inspect.signature(node.target)
        if "inplace" not in signature.parameters:
            return False
        bound = signature.bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):  # a builtin without a signature, or other arguments
        return False
    return bound.arguments.get("inplace") is True


def _in_place(name: str) -> bool:
    """``add_``, ``copy_``, ``__iadd__``, ``__setitem__``: a method writing its tensor."""
    if name.startswith("__"):
        return name == "__setitem__" or name.startswith("__i") and name not in (
            "__index__", "__init__", "__invert__", "__iter__")
    return name.endswith("_")


def _written(node: torch.fx.Node) -> list:
    """The argument nodes ``node`` writes."""
    if node.op not in ("call_method", "call_function"):
        return []
    out = node.kwargs.get("out")
    targets = list(out) if isinstance(out, (tuple, list)) else [out] if out is not None else []
    op = _overload(node.target)
    if op is not None:
        for i, arg in enumerate(op._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                targets.append(node.args[i] if i < len(node.args)
                               else node.kwargs.get(arg.name))
    elif _first(node) is not None and (node.target in IN_PLACE_OPERATORS
                                       or _in_place(_name(node)) or _inplace_call(node)):
        targets.append(_first(node))
    # A list written as a whole (``torch._foreach_add_([a, b], ...)``) writes each tensor.
    return [t for target in targets
            for t in (target if isinstance(target, (tuple, list)) else (target,))]


def _roots(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node that may be (a view of) an input -> that input's index. A node whose
    example value shares an input's storage is that input's, whatever its first argument
    (``torch.broadcast_tensors(a, x)[1]``, ``torch.atleast_1d(a, x)[1]``: views of ``x``)."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    root = {n: i for i, n in enumerate(placeholders)}
    inputs: dict[int, list[int]] = {}  # storage -> the inputs on it
    for i, n in enumerate(placeholders):
        if (storage := _storage(n)) is not None:
            inputs.setdefault(storage, []).append(i)
    for node in graph.nodes:
        if node.op == "placeholder":
            continue
        first = _first(node)
        if isinstance(first, torch.fx.Node) and first in root and _may_alias(node):
            root[node] = root[first]
        # As traced, whatever the op: the input whose memory its example value is on
        # (of inputs sharing one storage, the one it was made from, if it was).
        on = inputs.get(_storage(node), ())
        if on and root.get(node) not in on:
            root[node] = on[0]
    return root


def mutated_inputs(module: torch.nn.Module) -> set[int]:
    """Indices of the placeholders of ``module``'s graph that it may write."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return set()
    root = _roots(graph)
    return {root[t] for node in graph.nodes for t in _written(node)
            if isinstance(t, torch.fx.Node) and t in root}


def aliased_outputs(graph: torch.fx.Graph) -> dict[int, int]:
    """The graph's outputs (a tuple or list) that may be (views of) its inputs: output
    index -> the input's. Whether one is (``x.float()`` of a float ``x``, not of a bf16
    one) the call's tensors say: :func:`views_of_inputs`."""
    root = _roots(graph)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    values = output.args[0]
    values = values if isinstance(values, (tuple, list)) else [values]
    return {k: root[v] for k, v in enumerate(values)
            if isinstance(v, torch.fx.Node) and v in root}


def views_of_inputs(out, args, aliased: dict[int, int]) -> set[int]:
    """Which of ``aliased``'s outputs of ``out`` share memory with their input in ``args``
    (eager returns them aliased: a copy would not be what eager returns)."""
    return {k for k, i in aliased.items()
            if isinstance(out[k], torch.Tensor) and isinstance(args[i], torch.Tensor)
            and storage_key(out[k]) == storage_key(args[i])}


def copies(out, keep: set[int]) -> list:
    """``out`` with each tensor cloned but those of ``keep`` (returned as they are).
    Outputs whose memory overlaps (a tensor and a view of it) are views of one copy, as
    eager returns them: a write through one reaches the other."""
    flat = list(out)
    groups: list[list[int]] = []  # outputs on overlapping memory, transitively
    for k, o in enumerate(flat):
        if not isinstance(o, torch.Tensor) or k in keep:
            continue
        near = [g for g in groups if any(_shared(o, flat[j]) for j in g)]
        groups = [g for g in groups if g not in near] + [[i for g in near for i in g] + [k]]
    for group in groups:
        first = flat[group[0]]
        if len(group) == 1 or any(flat[k].dtype != first.dtype or flat[k].is_conj()
                                  or flat[k].is_neg() for k in group):
            for k in group:
                flat[k] = flat[k].clone()
            continue
        start = min(flat[k].storage_offset() for k in group)
        end = max(flat[k].storage_offset() + reach(flat[k]) + 1 for k in group)
        base = first.as_strided((end - start,), (1,), start).clone()
        for k in group:
            o = flat[k]
            flat[k] = base.as_strided(o.shape, o.stride(), o.storage_offset() - start)
    return flat


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    return storage_key(a) == storage_key(b) and overlap(a, b)


__all__ = ["aliased_outputs", "copies", "mutated_inputs", "views_of_inputs"]
