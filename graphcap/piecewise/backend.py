"""The ``sgl_piecewise`` torch.compile backend: split at split ops, compile each piece once,
capture it per token count.

Dynamo traces the forward once (``fullgraph=True``, dim 0 of the token inputs dynamic).
The FX graph is split so that each split op (attention, and any op named in
``split_ops``) sits alone in its piece, original order kept. Every other piece is
compiled once, in the backend call, for the symbolic token count (``compiler="eager"``:
the FX code as traced; ``"inductor"``: Inductor's fused kernels, see
:mod:`graphcap.piecewise.inductor`) and wrapped in a :class:`PieceRunner`, which
for each capture size runs the piece eagerly once (warm-up), then captures it on the
backend's one graph pool, then replays it. Split ops run eagerly between pieces. Token
counts outside the capture sizes run the pieces eagerly (counted).
"""

from __future__ import annotations

import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.core.buckets import prefill_ladder
from graphcap.core.graph_base import Graph
from graphcap.core.graphs import GraphPool, new_pool
from graphcap.errors import GraphcapError
from graphcap.piecewise.inductor import OneOpPiece, compile_piece
from graphcap.piecewise.split import graphable, split_graph, split_op_names
from graphcap.piecewise.whole import Call, WholeCapture

OPTIONS = ("capture_sizes", "max_tokens", "compiler", "split_ops", "copy_outputs", "pool")
COMPILERS = ("eager", "inductor")


def mutated_inputs(module: torch.nn.Module) -> set[int]:
    """Indices of the placeholders a piece writes in place (``Tensor(a!)`` arguments of
    the ops it calls, and in-place methods)."""
    graph = getattr(module, "graph", None)
    if graph is None:
        return set()
    slots = {n: i for i, n in enumerate(n for n in graph.nodes if n.op == "placeholder")}
    written = set()
    for node in graph.nodes:
        targets = []
        if node.op == "call_method" and node.target.endswith("_") and node.args:
            targets = [node.args[0]]
        elif node.op == "call_function":
            op = node.target
            if isinstance(op, torch._ops.OpOverloadPacket):
                op = op.default
            if isinstance(op, torch._ops.OpOverload):
                for i, arg in enumerate(op._schema.arguments):
                    if arg.alias_info is not None and arg.alias_info.is_write:
                        value = node.args[i] if i < len(node.args) else node.kwargs.get(
                            arg.name)
                        targets.append(value)
            elif getattr(op, "__name__", "").endswith("_") and node.args:
                targets = [node.args[0]]
        written |= {slots[t] for t in targets if t in slots}
    return written


def token_arg(gm: torch.fx.GraphModule) -> int | None:
    """Which argument of Dynamo's graph gives the token count: the first placeholder that
    is a dynamic size (a SymInt) or a tensor whose dim 0 is one (the token inputs are
    marked dynamic in dim 0), else the first tensor input that is no parameter or buffer.
    Pieces take it from the call, not from their own first tensor, which may be a weight
    or the request rows of last-token logits."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt):
            return i
        if isinstance(value, torch.Tensor) and value.dim() and isinstance(value.shape[0],
                                                                         torch.SymInt):
            return i
    # A graph of static shapes: the first input that is not a module's parameter or
    # buffer (Dynamo names those after their attribute path).
    for i, node in enumerate(placeholders):
        value = node.meta.get("example_value")
        if isinstance(value, torch.Tensor) and value.dim() and not any(
                part in node.name for part in ("_parameters_", "_buffers_")):
            return i
    return None


@dataclass
class Entry:
    """One capture of a piece: its graph, the static inputs and outputs it reads and
    writes, and what it captured (the piece, or the piece as one op, kept alive here)."""

    graph: Graph
    static: list
    outputs: Any
    captured: Any
    state: Any = None  # split pieces: a weak reference to the state read at capture


class PieceRunner(torch.nn.Module):
    """One piece: eager warm-up, then one graph per capture size, replayed.

    Captured inputs: parameters and the static outputs of earlier captured pieces are
    used as they are (their addresses never change); any other tensor (the caller's
    inputs, buffers) gets a static copy, refreshed before each replay and, when the piece
    writes it, copied back after.

    ``opaque``: ``fn`` runs kernels the dispatcher never sees (Inductor's), so an emulated
    graph captures it as one op (:class:`~graphcap.piecewise.inductor.OneOpPiece`).

    ``graphable`` (split pieces): returns the static state object the split op reads now
    (attention: the runner's prepared metadata), or None. A size whose capture finds one
    is captured and replayed as a graph while that object stays current; otherwise (no
    static state, or another object since) the split op runs eagerly."""

    def __init__(self, owner: PiecewiseCompiler, fn, module: torch.nn.Module,
                 opaque: bool = False, graphable=None):
        super().__init__()
        self.owner, self.fn, self.opaque = owner, fn, opaque
        self.graphable = graphable
        self.writes = mutated_inputs(module)
        self.seen: set[int] = set()
        self.eager_sizes: set[int] = set()  # split pieces whose state was not static
        self.entries: dict[int, Entry] = {}

    def forward(self, *args):
        owner = self.owner
        if owner.whole is not None:  # the forward is being captured as one graph
            return owner.whole.run(self, args)
        if self.graphable is not None and owner.calling is not None \
                and self.graphable() is None:
            owner.calling.static = False  # this call cannot be captured whole
        size = owner.size
        if size is None:  # a graph without a dynamic size: its first tensor's rows
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            size = tensors[0].shape[0] if tensors and tensors[0].dim() else None
        if size in owner.whole_sizes:  # captured whole: outside that graph, eager
            return self.fn(*args)
        if size not in owner.capture_sizes or size in self.eager_sizes:
            if self.graphable is None:  # split ops run eagerly by design: not counted
                owner.stats["eager_runs"] += 1
            return self.fn(*args)
        entry = self.entries.get(size)
        if entry is None:
            if size not in self.seen:  # warm-up: lazy init and JIT outside any capture
                self.seen.add(size)
                return self.fn(*args)
            if self.graphable is not None and self.graphable() is None:
                self.eager_sizes.add(size)
                return self.fn(*args)
            return self._capture(size, args)
        if self.graphable is not None and self.graphable() is not entry.state():
            return self.fn(*args)  # the graph would read the captured state's buffers
        copied = []
        for i, (buf, a) in enumerate(zip(entry.static, args, strict=True)):
            if isinstance(buf, torch.Tensor):
                if buf.shape != a.shape:  # e.g. more requests than captured: no replay
                    owner.stats["eager_runs"] += 1
                    return self.fn(*args)
                if buf is not a and buf.data_ptr() != a.data_ptr():
                    buf.copy_(a)
                    copied.append(i)
            elif buf != a:  # a baked host value changed: this replay would be wrong
                owner.stats["eager_runs"] += 1
                return self.fn(*args)
        entry.graph.replay()
        for i in copied:
            if i in self.writes:
                args[i].copy_(entry.static[i])
        return entry.outputs

    def _static(self, a):
        if not isinstance(a, torch.Tensor):
            return a
        if isinstance(a, torch.nn.Parameter) or a.data_ptr() in self.owner.static_ptrs:
            return a
        return a.clone()

    def _capture(self, size: int, args):
        pool = self.owner.pool_for(args)
        static = [self._static(a) for a in args]
        graph = pool.graph()
        captured = OneOpPiece(self.fn, self.writes) if self.opaque and graph.emulated \
            else self.fn
        outputs = graph.capture(captured, *static)
        self.owner.stats["split_captures" if self.graphable else "captures"] += 1
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        self.owner.static_ptrs |= {o.data_ptr() for o in flat if isinstance(o, torch.Tensor)}
        # Weakly: a user's loop preparing new metadata per call must not keep the first
        # one (and its workspace) alive; once it is gone the split runs eagerly.
        state = weakref.ref(self.graphable()) if self.graphable is not None else None
        self.entries[size] = Entry(graph, static, outputs, captured, state)
        return self.forward(*args)


class PiecewiseCompiler:
    """A Dynamo backend instance; ``torch.compile(m, backend="sgl_piecewise")`` makes one
    per compile, with ``options=`` as its keyword arguments."""

    def __init__(self, options: dict | None = None):
        opts = dict(options or {})
        unknown = set(opts) - set(OPTIONS)
        if unknown:
            raise GraphcapError(f"sgl_piecewise: unknown options {sorted(unknown)}; "
                                f"known: {list(OPTIONS)}")
        sizes = opts.get("capture_sizes")
        self.capture_sizes = set(sizes) if sizes else set(
            prefill_ladder(int(opts.get("max_tokens", 2048))))
        self.compiler = opts.get("compiler", "eager")
        if self.compiler not in COMPILERS:
            raise GraphcapError(f"sgl_piecewise: compiler={self.compiler!r}; use one of "
                                f"{COMPILERS}")
        self.split_names = split_op_names(opts.get("split_ops", ()))
        self.copy_outputs = bool(opts.get("copy_outputs", True))
        self.pool: GraphPool | None = opts.get("pool")
        self.stats: Counter = Counter()
        self.static_ptrs: set[int] = set()  # outputs of captured pieces: fixed addresses
        # One graph per shape (graphcap.capture's runner, graphcap.piecewise.whole): the
        # call being watched, the last one watched, the capture in progress, and the sizes
        # captured whole (their pieces run eagerly outside that graph).
        self.size: int | None = None  # the token count of the call running now
        self.watching = False
        self.calling: Call | None = None
        self.last_call: Call | None = None
        self.whole: WholeCapture | None = None
        self.whole_sizes: set[int] = set()

    def pool_for(self, args) -> GraphPool:
        if self.pool is None:
            device = next(a.device for a in args if isinstance(a, torch.Tensor))
            self.pool = new_pool(device)
        return self.pool

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.stats["graphs"] += 1
        token = token_arg(gm)
        split, pieces = split_graph(gm, self.split_names)
        eager_splits = False  # a split op that never runs in a graph
        for piece in pieces:
            self.stats["pieces"] += 1
            if piece.is_split:
                self.stats["split_pieces"] += 1
                check = graphable(piece.module, self.split_names)
                if check is not None:  # replayed as a graph while its state is static
                    setattr(split, piece.name, PieceRunner(self, piece.module, piece.module,
                                                           graphable=check))
                eager_splits |= check is None
                continue
            self.stats["captured_pieces"] += 1
            if self.compiler == "inductor":
                runner = PieceRunner(self, compile_piece(piece.module), piece.module,
                                     opaque=True)
            else:
                runner = PieceRunner(self, piece.module, piece.module)
            setattr(split, piece.name, runner)

        def forward(*args):
            self.size = None if token is None else (
                args[token] if isinstance(args[token], int) else args[token].shape[0])
            if self.watching:
                self.calling = Call(split, args, static=not eager_splits)
            try:
                out = split(*args)
            finally:
                call, self.calling = self.calling, None
            if call is not None:
                call.outputs, self.last_call = out, call
            if not self.copy_outputs:
                return out
            # The last piece's outputs are static and overwritten by the next call.
            return type(out)(o.clone() if isinstance(o, torch.Tensor) else o for o in out) \
                if isinstance(out, (tuple, list)) else out

        return forward


def sgl_piecewise(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """The Dynamo backend registered as ``sgl_piecewise`` (entry point
    ``torch_dynamo_backends``): ``torch.compile(model, backend="sgl_piecewise",
    options={"capture_sizes": [...], "compiler": "inductor"})``."""
    return PiecewiseCompiler(options)(gm, example_inputs)
