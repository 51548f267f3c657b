"""Splitting an FX graph at split ops: each split op alone in its piece, order kept."""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx
from torch.fx.passes.split_module import split_module


def split_op_names(extra=()) -> set[str]:
    """Qualified names (``ns::op``) of the opsdb ops tagged ``split``, plus ``extra``."""
    from graphcap.opsdb import REGISTRY

    return {q for q, spec in REGISTRY.items() if spec.split} | set(extra)


def _qualname(target) -> str | None:
    # A custom op in a fullgraph trace shows up as an OpOverloadPacket ("ns.op") or an
    # OpOverload ("ns.op.overload"); both name the same op.
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name
    return None


def is_split_node(node: torch.fx.Node, names: set[str]) -> bool:
    return node.op == "call_function" and _qualname(node.target) in names


def graphable(module: torch.fx.GraphModule, names: set[str]):
    """For a split piece (one split op): its op's ``graphable`` (the static state object
    it reads now, or None), or None when the op never can be captured (an op without
    ``graphable``, e.g. a user's split op)."""
    from graphcap.opsdb import REGISTRY

    specs = [REGISTRY.get(_qualname(n.target)) for n in module.graph.nodes
             if is_split_node(n, names)]
    if len(specs) != 1 or specs[0] is None or not specs[0].capturable:
        return None
    return specs[0].graphable


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
        elif node.op == "call_function" and node.target is operator.getitem and ids.get(
                node.args[0]) is not None and is_split_node(node.args[0], names):
            ids[node] = ids[node.args[0]]  # keep getitem with its producer
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
