"""One graph per shape under tc_piecewise: the compiled forward captured whole.

Under ``graphcap.capture`` the runner warms each shape up with one call, then captures
it. The strategy watches that call (:class:`Call`). When every split op in it read static
state (attention on the runner's prepared metadata) and the model's outputs are outputs
of the compiled graph, the shape is captured as one graph (:class:`WholeCapture`): the
graph Dynamo compiled is called directly on the warm-up's arguments, each piece runs
inline (compiled once, for the symbolic size, as before) and the split ops are captured
with them. A replay is then one graph launch: no Dynamo guards, no piece runners, no
Python between the pieces. Called directly, no guard is evaluated inside the capture,
and the CPU emulator's recording (under which Dynamo declines to run compiled code) sees
the pieces' own ops.

Otherwise (a split op on host state, a user's split op, outputs Dynamo built anew) the
shape is captured piece by piece (:class:`~graphcap.piecewise.pieces.PieceGraphs`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcap.errors import CaptureError
from graphcap.piecewise.inductor import OneOpPiece
from graphcap.piecewise.pieces import run_boxed


def _where(t: torch.Tensor) -> tuple:
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


@dataclass
class Call:
    """One call of the graph Dynamo compiled: the split module, its arguments (the
    runner's static buffers, parameters, sizes) and what it returned. ``static``: every
    split op of the call read static state and every split piece has graphs."""

    module: torch.fx.GraphModule
    args: tuple
    static: bool
    outputs: Any = None
    tokens: int | None = None
    returns: tuple | None = None  # (index into outputs or None, constant, spec)
    slots: list | None = None  # per caller tensor: the graph argument it became, or None

    def learn_inputs(self, args) -> None:
        """Which of the graph's arguments each of the caller's tensors became (Dynamo
        passes an alias: the same memory, shape and strides), so that a capture can pass
        the graph the capture's own tensors (:meth:`direct`)."""
        mine = [(i, _where(a)) for i, a in enumerate(self.args) if isinstance(a, torch.Tensor)]
        self.slots = [next((i for i, w in mine if w == _where(a)), None)
                      if isinstance(a, torch.Tensor) else None for a in args]

    def learn_returns(self, value, tokens: int) -> None:
        """Map the model's return value onto the graph's outputs, by identity; a tensor
        the compiled code made outside the graph leaves the call unreplayable. The
        warm-up's outputs are dropped either way: only where they go is kept (a shape's
        logits for every token would otherwise live as long as the runner)."""
        outs = self.outputs if isinstance(self.outputs, tuple | list) else (self.outputs,)
        self.outputs = None
        leaves, spec = tree_flatten(value)
        where = []
        for leaf in leaves:
            i = next((i for i, o in enumerate(outs) if o is leaf), None)
            if i is None and isinstance(leaf, torch.Tensor):
                return
            where.append(i)
        self.tokens = tokens
        constants = [None if i is not None else leaf for i, leaf in zip(where, leaves,
                                                                         strict=True)]
        self.returns = (where, constants, spec)

    def replayable(self, tokens: int) -> bool:
        return self.static and self.returns is not None and self.tokens == tokens

    def direct(self, args=None):
        """The model's return value, from calling the compiled graph directly: on the
        warm-up's arguments, with the caller's tensors of this call, ``args``, in their
        places (the runner's buffers, or tensors its forward made anew). Dynamo drops the
        arguments the graph does not read, so a caller's tensor without a slot is unread."""
        graph_args = list(self.args)
        if args is not None:  # a tensor with no slot is one the graph never reads
            for slot, a in zip(self.slots, args, strict=True):
                if slot is not None:
                    graph_args[slot] = a
        outs = self.module.forward(*graph_args)  # past hooks: see split.piece_calls
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        where, leaves, spec = self.returns
        return tree_unflatten([leaf if i is None else outs[i]
                               for i, leaf in zip(where, leaves, strict=True)], spec)


@dataclass
class WholeCapture:
    """The capture of one shape as one graph: the pieces run inline, and the split ops
    with them, on the static state the runner owns (it stays current)."""

    call: Call
    emulated: bool
    splits: int = 0
    graph: Any = None
    keep: list = field(default_factory=list)  # OneOpPieces the emulated graph replays

    def run(self, piece, box: list):
        """A piece's forward inside the capture: the piece itself, inline, on the
        arguments in ``box`` (emptied: each freed after its last use in the piece)."""
        if piece.static_state is not None:
            state = piece.static_state()
            if state is None:
                raise CaptureError(
                    "tc_piecewise: a split op read static state in the warm-up forward "
                    "but not in the capture of the same shape; keep the attention "
                    "backend and metadata fixed between warm-up and capture")
            self.splits += 1
        fn = piece.fn
        if piece.opaque and self.emulated:  # kernels the emulator's recording cannot see
            fn = OneOpPiece(piece.fn, piece.writes)
            self.keep.append(fn)
        return run_boxed(fn, box)

    def replay(self) -> None:
        self.graph.replay()
