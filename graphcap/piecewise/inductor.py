"""Inductor pieces: a split piece compiled once by Inductor for the symbolic token count,
and run as one op where the CPU emulator must see it.

A piece is compiled inside the backend call, on the fake inputs Dynamo traced it with (dim
0 a symbol of the trace's shape env), by ``compile_fx``: how torch.compile's own Inductor
backend compiles a Dynamo graph, and how vLLM compiles its split pieces. Not by
``torch.compile`` of the piece: Dynamo marks the code of every GraphModule made during a
compile as code to skip, so that would trace nothing of the piece and compile instead each
Python frame the piece calls (the opsdb kernels) on its own, where Inductor's C++ backend
fails on ``fused_add_rms_norm`` (``KeyError: 'buf1'``, pytorch/pytorch#196570).

Inductor's kernels (C++ on the CPU, Triton on CUDA) are called without the dispatcher, so
the CPU emulator of CUDA graphs, which records dispatched ops, would miss them:
:class:`OneOpPiece` runs a compiled piece as one ``graphcap::compiled_piece`` op, which
the emulator records and replays whole, as a CUDA graph replays the piece's kernels.
"""

from __future__ import annotations

import copy
import itertools
import weakref
from collections.abc import Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcap.compat.library import define_op
from graphcap.errors import GraphcapError


def compile_piece(module: torch.fx.GraphModule) -> Callable:
    """``module``, a piece of the graph Dynamo hands the backend, compiled by Inductor for
    the symbolic token count; callable like ``module`` (tuple outputs come as a list).

    Call it inside the backend call: the fake inputs and their shape env are the trace's.
    """
    from torch._inductor.compile_fx import compile_fx

    fakes = [n.meta.get("example_value") for n in module.graph.nodes if n.op == "placeholder"]
    if any(v is None for v in fakes):
        raise GraphcapError("sgl_piecewise: a piece has inputs without Dynamo's example "
                            "values; compiler='inductor' compiles pieces of a Dynamo graph")
    # Inductor may rewrite the graph it is given; the piece keeps the traced one.
    return compile_fx(copy.deepcopy(module), fakes)


_ANCHOR = torch.empty(0)  # what a piece of no tensor passes the op (see OneOpPiece)
_PIECES: weakref.WeakValueDictionary[int, OneOpPiece] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def _run(key: int, reads: list[torch.Tensor], writes: list[torch.Tensor]):
    return _PIECES[key].run(reads, writes)


def _fake(key: int, reads, writes):
    raise NotImplementedError("graphcap::compiled_piece runs compiled code; it is not traced")


COMPILED_PIECE = define_op(
    "graphcap::compiled_piece", "(int key, Tensor[] reads, Tensor(a!)[] writes) -> Tensor[]",
    _run, _fake)


class OneOpPiece:
    """``fn(*args)`` as one ``graphcap::compiled_piece`` call, for one capture.

    Its outputs are the op's fresh tensors (which the emulator overwrites on replay) and,
    as they were at capture, outputs that alias an input (views stay views). Host values
    among ``args`` are baked, as in any graph. ``writes``: indices of the arguments ``fn``
    writes. The caller keeps this object alive as long as the graph that recorded it.
    """

    def __init__(self, fn: Callable, writes: set[int]):
        self.fn, self.writes = fn, writes
        self.key = next(_KEYS)
        _PIECES[self.key] = self

    def __call__(self, *args):
        self.args = list(args)
        slots = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        self.read_slots = [i for i in slots if i not in self.writes]
        self.write_slots = [i for i in slots if i in self.writes]
        # A piece of no tensor (a mask made from the token count alone) still reads one:
        # the dispatcher finds the op's kernel by its tensors.
        reads = [args[i] for i in self.read_slots] if slots else [_ANCHOR]
        fresh = COMPILED_PIECE(self.key, reads, [args[i] for i in self.write_slots])
        flat = list(self.flat)
        for i, t in zip(self.fresh_slots, fresh, strict=True):
            flat[i] = t
        return tree_unflatten(flat, self.spec)

    def run(self, reads: list[torch.Tensor], writes: list[torch.Tensor]) -> list:
        """The op's kernel: ``fn`` on these tensors; its outputs that alias no input."""
        args = list(self.args)
        if not self.read_slots and not self.write_slots:
            reads = []  # the anchor alone
        for i, t in zip(self.read_slots + self.write_slots, reads + writes, strict=True):
            args[i] = t
        self.flat, self.spec = tree_flatten(self.fn(*args))
        inputs = {t.untyped_storage().data_ptr() for t in reads + writes}
        self.fresh_slots = [i for i, o in enumerate(self.flat) if isinstance(o, torch.Tensor)
                            and o.untyped_storage().data_ptr() not in inputs]
        return [self.flat[i] for i in self.fresh_slots]
