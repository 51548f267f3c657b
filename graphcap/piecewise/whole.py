"""One graph per shape under tc_piecewise: the compiled forward captured whole.

Under ``graphcap.capture`` the runner warms each shape up with one call, then captures
it. The backend watches that call (:class:`Call`). When every split op in it read static
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

from graphcap.core.strategy import note_state
from graphcap.errors import CaptureError
from graphcap.piecewise.inductor import OneOpPiece


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
    inputs: list | None = None  # where the caller's tensors were: address, shape, strides

    @staticmethod
    def where(args) -> list:
        """Where the caller's tensors are: the graph, called directly on the warm-up's
        arguments, reads them there."""
        return [(a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
                if isinstance(a, torch.Tensor) else a for a in args]

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

    def direct_for(self, args):
        """:meth:`direct`, for a call with these arguments: those of the warm-up, where the
        graph reads them (views of the runner's static buffers), else :class:`Moved`."""
        if Call.where(args) != self.inputs:
            raise Moved
        return self.direct()

    def direct(self):
        """The model's return value, from calling the compiled graph directly."""
        outs = self.module(*self.args)
        outs = outs if isinstance(outs, tuple | list) else (outs,)
        where, leaves, spec = self.returns
        return tree_unflatten([leaf if i is None else outs[i]
                               for i, leaf in zip(where, leaves, strict=True)], spec)


class Moved(Exception):  # noqa: N818 - a signal between the forward and the strategy
    """The forward passed the compiled model tensors other than its warm-up's (made anew
    each call, not views of static buffers): the shape cannot be captured whole."""


@dataclass
class WholeCapture:
    """The capture of one shape as one graph: the pieces run inline, the split ops'
    static states are listed (the runner owns them: they stay current)."""

    call: Call
    emulated: bool
    states: list = field(default_factory=list)
    splits: int = 0
    graph: Any = None
    keep: list = field(default_factory=list)  # OneOpPieces the emulated graph replays

    def run(self, piece, args):
        """A piece's forward inside the capture: the piece itself, inline."""
        if piece.graphable is not None:
            state = piece.graphable()
            if state is None:
                raise CaptureError(
                    "tc_piecewise: a split op read static state in the warm-up forward "
                    "but not in the capture of the same shape; keep the attention "
                    "backend and metadata fixed between warm-up and capture")
            note_state(self.states, piece.graphable, state)
            self.splits += 1
        fn = piece.fn
        if piece.opaque and self.emulated:  # kernels the emulator's recording cannot see
            fn = OneOpPiece(piece.fn, piece.writes)
            self.keep.append(fn)
        return fn(*args)

    def replay(self) -> None:
        self.graph.replay()
