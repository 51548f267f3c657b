"""The FX graph Dynamo hands the backend: split at split ops (each alone in its piece,
order kept), and what the backend reads of it (the token argument, host scalars, whether
it records autograd history; the inputs a piece writes: :mod:`graphcap.piecewise.writes`)."""

from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.passes.split_module import split_module
from torch.utils._pytree import tree_leaves

from graphcap import compat


def split_op_names(extra=()) -> set[str]:
    """Qualified names (``ns::op``) of the opsdb ops tagged ``split``, plus ``extra``."""
    from graphcap.opsdb import REGISTRY

    return {q for q, spec in REGISTRY.items() if spec.split} | set(extra)


def qualname(target) -> str | None:
    # A custom op in a fullgraph trace shows up as an OpOverloadPacket ("ns.op") or an
    # OpOverload ("ns.op.overload"); both name the same op.
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_split_node(node: torch.fx.Node, names: set[str]) -> bool:
    """A split op of ``names``, or an op a graph cannot hold (tagged
    ``torch.Tag.cudagraph_unsafe``, as opsdb tags an op registered ``capturable=False``):
    it runs eagerly between pieces, as Inductor's CUDA graphs leave it out."""
    return node.op == "call_function" and (qualname(node.target) in names
                                           or compat.cudagraph_unsafe(node.target))


def static_state_of(module: torch.fx.GraphModule, names: set[str]):
    """For a split piece (one split op): its op's ``static_state`` (the static state object
    it reads now, or None), or None when the op never can be captured (an op without
    ``static_state``, e.g. a user's split op)."""
    from graphcap.opsdb import REGISTRY

    specs = [REGISTRY.get(qualname(n.target)) for n in module.graph.nodes
             if is_split_node(n, names)]
    if len(specs) != 1 or specs[0] is None or not specs[0].capturable:
        return None
    return specs[0].static_state


# What a split op's piece keeps of the nodes reading its outputs.
_OF_OUTPUT = (operator.getitem, torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
              torch.ops.aten.sym_numel.default, torch.ops.aten.sym_storage_offset.default)


@dataclass
class Piece:
    name: str
    module: torch.nn.Module
    is_split: bool


def split_graph(gm: torch.fx.GraphModule, names: set[str]
                ) -> tuple[torch.fx.GraphModule, list[Piece]]:
    """Split ``gm`` so that every split op sits alone in its piece, in the original order."""
    piece, ids = 0, {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split_node(node, names):
            piece += 1
            ids[node] = piece
            piece += 1
        elif node.op == "call_function" and node.target in _OF_OUTPUT and ids.get(
                node.args[0]) is not None and is_split_node(node.args[0], names):
            # With its producer: an item of its outputs, or a size of one the data decides
            # (split_module puts an unbacked size where the node reading it is).
            ids[node] = ids[node.args[0]]
        else:
            ids[node] = piece
    used = sorted(set(ids.values()))
    renumber = {old: new for new, old in enumerate(used)}
    split = split_module(gm, gm, lambda n: renumber[ids[n]], keep_original_order=True)
    pieces = []
    for name, module in split.named_children():
        nodes = [n for n in module.graph.nodes if n.op == "call_function"]
        pieces.append(Piece(name, module, any(is_split_node(n, names) for n in nodes)))
    return split, pieces


def _box(*values) -> list:
    """A piece's arguments as one list, which the piece empties (:func:`piece_calls`)."""
    return list(values)


def _forward(piece: torch.nn.Module, *args, **kwargs):
    return piece.forward(*args, **kwargs)  # looked up now: a recompile replaces it


def past_hooks(fn):
    """``fn``, a module called through its own ``forward`` (:func:`piece_calls`)."""
    return functools.partial(_forward, fn) if isinstance(fn, torch.nn.Module) else fn


def piece_calls(split: torch.fx.GraphModule, boxed: set[str]) -> None:
    """Rewrite the split module's calls of its pieces:

    - each piece is called through its own ``forward``, past ``nn.Module.__call__``: a
      global module hook (``register_module_forward_hook``) then runs on the model's
      modules, where Dynamo traced it, and not on graphcap's pieces too (a capture would
      bake it into the graphs a second time);
    - each piece of ``boxed`` is called with one list of its arguments, built just before
      the call: the split module frees an argument after its last use, now the list, and
      the piece empties the list (``PieceGraphs``), so an argument it uses last is freed
      at its last use inside the piece, as in the forward Dynamo traced. Called with the
      arguments themselves, the split module's frame would hold each until the piece
      returned: the attention's output and the residual stream through the MLP after
      them, a larger warm-up peak and pool than the eager forward's."""
    graph = split.graph
    for node in list(graph.nodes):
        if node.op != "call_module":
            continue
        with graph.inserting_before(node):
            args = tuple(node.args)
            if node.target in boxed and not node.kwargs:
                args = (graph.call_function(_box, args),)
            call = graph.call_function(_forward, (graph.get_attr(node.target), *args),
                                       dict(node.kwargs))
        node.replace_all_uses_with(call)
        graph.erase_node(node)
    split.recompile()


def device_of(args) -> torch.device:
    """The device a call's graphs run on: its tensors' (a CUDA one over a host scalar)."""
    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else
                torch.device("cpu"))


def builds_autograd_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced forward records autograd history: an op whose traced output
    requires grad (grad enabled, and an input or parameter that requires grad, as the
    trace saw them, ``no_grad`` and ``enable_grad`` blocks inside the forward included).
    An op that returns its input itself (``weight.float()`` of a float32 parameter) keeps
    the parameter, a leaf: no history, so under inference_mode it is no reason."""
    return any(isinstance(v, torch.Tensor) and v.requires_grad and v.grad_fn is not None
               for n in gm.graph.nodes if n.op not in ("placeholder", "output")
               for v in tree_leaves(n.meta.get("example_value")))


def host_scalars(gm: torch.fx.GraphModule) -> set[int]:
    """Rewrite ``gm`` to take, as plain Python numbers, the inputs Dynamo passes as 0-d
    host tensors and reads back with ``.item()`` (a model's float attribute under
    ``dynamic=True``, e.g. ``nn.Embedding.norm_type``); return their indices. Inside a
    captured piece that read would be baked at capture, and the emulator refuses it as a
    host sync; as an argument, the value is compared on every replay instead (a piece
    is captured again when it changed: :mod:`graphcap.piecewise.hostvalues`)."""
    found = set()
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        arg, users = node.meta.get("grapharg"), list(node.users)
        if arg is None or not getattr(arg, "pass_arg_as_tensor", False) or arg.is_tensor:
            continue
        if not users or any(u.op != "call_method" or u.target != "item" for u in users):
            continue
        for user in users:
            user.replace_all_uses_with(node)
            node.meta["example_value"] = user.meta.get("example_value")
            gm.graph.erase_node(user)
        found.add(i)
    if found:
        gm.recompile()
    return found


def token_arg(gm: torch.fx.GraphModule) -> int | None:
    """Which argument of Dynamo's graph gives the token count: dim 0 of the first tensor of
    the caller's the forward reads (an argument, or an item of one; no parameter, buffer
    or tensor attribute), or, where that dim is static and another of its dims is dynamic
    (``[batch, tokens]`` ids at batch 1), the placeholder giving that size. Pieces take it
    from the call, not from their own first tensor, which may be a weight or the request
    rows of last-token logits; nor from the first dynamic size of the graph, which may be
    the caller's K/V cache's where Dynamo specialised a decode step's one token."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values = [n.meta.get("example_value") for n in placeholders]
    callers = [i for i, (n, v) in enumerate(zip(placeholders, values, strict=True))
               if isinstance(v, torch.Tensor) and v.dim() and _callers(n)]
    if callers:
        first = values[callers[0]]
        if not isinstance(first.shape[0], torch.SymInt):
            for size in first.shape[1:]:
                if isinstance(size, torch.SymInt):
                    return next((i for i, v in enumerate(values) if isinstance(v, torch.SymInt)
                                 and v.node.expr == size.node.expr), callers[0])
        return callers[0]
    # No such tensor (a graph of module state, or sources Dynamo did not record): the
    # first dynamic size, else the first input that is not named as a module's
    # parameter or buffer.
    for i, value in enumerate(values):
        if isinstance(value, torch.SymInt):
            return i
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0],
                                                                         torch.SymInt):
            return i
    for i, (node, value) in enumerate(zip(placeholders, values, strict=True)):
        if isinstance(value, torch.Tensor) and value.dim() and not any(
                part in node.name for part in ("_parameters_", "_buffers_")):
            return i
    return None


# Links of a Dynamo source that reach a tensor through an object's attribute (a module's
# parameter, buffer or tensor attribute), by the names of their classes across versions.
_STATE_LINKS = ("Attr", "ParamBuffer", "NNModule")


def _callers(node: torch.fx.Node) -> bool:
    """Whether a placeholder is a tensor the caller passed: its source is a local of the
    compiled frame (an argument), or an item of one (``args[0]``, ``kwargs["ids"]``),
    reached through no attribute (``self.table``, ``self._buffers["cache"]``)."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None:
        if any(link in type(source).__name__ for link in _STATE_LINKS):
            return False
        base = getattr(source, "base", None)
        if base is None:
            return type(source).__name__ == "LocalSource"
        source = base
    return False


def is_held(node: torch.fx.Node) -> bool:
    """Whether a placeholder of Dynamo's graph is a tensor Dynamo marked static: a module's
    parameter, buffer or tensor attribute, or a tensor given
    ``torch._dynamo.mark_static_address``."""
    return bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))


def held_args(split: torch.fx.GraphModule) -> dict[str, frozenset[int]]:
    """Per piece of ``split`` (its name): the arguments that are held tensors of the
    traced graph (:func:`is_held`), passed as they are: a piece reads them in place."""
    return {n.target: frozenset(i for i, a in enumerate(n.args)
                                if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                                and is_held(a))
            for n in split.graph.nodes if n.op == "call_module"}


def host_names(split: torch.fx.GraphModule) -> dict[str, dict[int, str]]:
    """Per piece of ``split`` (its name): its arguments that are inputs of the traced graph,
    by the name the forward reads them under (``self.scale``, ``k``; under
    ``graphcap.capture``, ``model.scale``), for what a piece says of a host value."""
    names = {}
    for n in split.graph.nodes:
        if n.op == "call_module":
            names[n.target] = {i: name for i, a in enumerate(n.args)
                               if isinstance(a, torch.fx.Node) and a.op == "placeholder"
                               and (name := _source_name(a)) is not None}
    return names


def _source_name(node: torch.fx.Node) -> str | None:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", None)
    name = name() if callable(name) else name
    if not isinstance(name, str):
        return None
    return re.sub(r"L\['(?:graphcap_)?(\w+)'\]", r"\1", name)
