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

import logging
import weakref
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphcap.core.buckets import check_ladder, prefill_ladder
from graphcap.core.graph_base import Graph
from graphcap.core.graphs import GraphPool, new_pool
from graphcap.core.serial import Serial
from graphcap.errors import GraphcapError
from graphcap.piecewise.inductor import OneOpPiece, compile_piece
from graphcap.piecewise.split import graphable, split_graph, split_op_names
from graphcap.piecewise.whole import Call, WholeCapture

OPTIONS = ("capture_sizes", "max_tokens", "compiler", "split_ops", "copy_outputs", "pool")
COMPILERS = ("eager", "inductor")
log = logging.getLogger("graphcap")
_COMPILERS: weakref.WeakSet = weakref.WeakSet()  # every live compile, for counters()


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


def _device_of(args) -> torch.device:
    """The device a call's graphs run on: its tensors' (a CUDA one over a host scalar)."""
    devices = [a.device for a in args if isinstance(a, torch.Tensor)]
    return next((d for d in devices if d.type != "cpu"), devices[0] if devices else
                torch.device("cpu"))


def builds_autograd_graph(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced forward records autograd history: an op whose traced output
    requires grad (grad enabled, and an input or parameter that requires grad, as the
    trace saw them, ``no_grad`` and ``enable_grad`` blocks inside the forward included)."""
    return any(isinstance(v, torch.Tensor) and v.requires_grad
               for n in gm.graph.nodes if n.op not in ("placeholder", "output")
               for v in tree_leaves(n.meta.get("example_value")))


def host_scalars(gm: torch.fx.GraphModule) -> set[int]:
    """Rewrite ``gm`` to take, as plain Python numbers, the inputs Dynamo passes as 0-d
    host tensors and reads back with ``.item()`` (a model's float attribute under
    ``dynamic=True``, e.g. ``nn.Embedding.norm_type``); return their indices. Inside a
    captured piece that read would be baked at capture, and the emulator refuses it as a
    host sync; as an argument, the value is compared on every replay instead (a piece
    runs eagerly when it changed)."""
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
    foreign: set[int]  # arguments read in place that graphcap does not own (parameters)
    state: Any = None  # split pieces: a weak reference to the state read at capture


class PieceRunner(torch.nn.Module):
    """One piece: eager warm-up, then one graph per capture size, replayed.

    Captured inputs: parameters and the static outputs of earlier captured pieces are
    read in place; any other tensor (the caller's inputs, buffers) gets a static copy,
    refreshed before each replay and, when the piece writes it, copied back after. A
    replay never writes a tensor it did not allocate: where a parameter read in place at
    capture is another tensor now (a weight reassigned after capture, another Parameter
    passed in), the size is captured again (``recaptures``), never copied into the old one.

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
                if buf is a or buf.data_ptr() == a.data_ptr():
                    continue
                if i in entry.foreign:  # the caller's, read in place: never written
                    return self._recapture(size, args)
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

    def _recapture(self, size: int, args):
        entry = self.entries.pop(size)
        flat = entry.outputs if isinstance(entry.outputs, (tuple, list)) else (entry.outputs,)
        self.owner.static_ptrs -= {o.data_ptr() for o in flat if isinstance(o, torch.Tensor)}
        self.owner.stats["recaptures"] += 1
        return self._capture(size, args)

    def _capture(self, size: int, args):
        pool = self.owner.pool_for(args)
        # Read in place: parameters (the caller's) and earlier pieces' static outputs
        # (graphcap's); any other tensor from a static copy of its own.
        foreign = {i for i, a in enumerate(args) if isinstance(a, torch.nn.Parameter)}
        static = [a if i in foreign or not isinstance(a, torch.Tensor)
                  or a.data_ptr() in self.owner.static_ptrs else a.clone()
                  for i, a in enumerate(args)]
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
        self.entries[size] = Entry(graph, static, outputs, captured, foreign, state)
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
        self.capture_sizes = set(check_ladder(sizes)) if sizes else set(
            prefill_ladder(opts.get("max_tokens", 2048)))
        self.compiler = opts.get("compiler", "eager")
        if self.compiler not in COMPILERS:
            raise GraphcapError(f"sgl_piecewise: compiler={self.compiler!r}; use one of "
                                f"{COMPILERS}")
        self.split_names = split_op_names(opts.get("split_ops", ()))
        self.copy_outputs = bool(opts.get("copy_outputs", True))
        self.pool: GraphPool | None = opts.get("pool")
        self.stats: Counter = Counter()  # see counters()
        self.serial: Serial | None = None  # one call at a time: the pieces' static buffers
        _COMPILERS.add(self)
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
            self.pool = new_pool(_device_of(args))
        return self.pool

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.stats["graphs"] += 1
        if builds_autograd_graph(gm):
            return self._eager_for_autograd(gm)
        if self.serial is None:
            self.serial = Serial(_device_of(example_inputs))
        scalars = host_scalars(gm)
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
            if scalars:  # host values, read outside any graph
                args = tuple(a.item() if i in scalars else a for i, a in enumerate(args))
            with self.serial:
                return run(*args)

        def run(*args):
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

    def _eager_for_autograd(self, gm: torch.fx.GraphModule):
        """A forward traced with grad enabled and inputs that require grad: graphs would
        return outputs tied to the autograd graph of their capture, so it runs eagerly
        (Dynamo guards on grad mode and requires_grad: calls under inference_mode or
        no_grad get a compile of their own, with graphs)."""
        self.stats["grad_graphs"] += 1
        log.warning("sgl_piecewise: the model was called with grad enabled and inputs or "
                    "parameters that require grad, so it runs eagerly, without graphs (an "
                    "output of a replay cannot carry autograd history); call it under "
                    "torch.inference_mode() or torch.no_grad() for graphs")

        def forward(*args):
            self.stats["grad_runs"] += 1
            return gm(*args)

        return forward


def counters() -> Counter:
    """The counters of every live ``sgl_piecewise`` compile, summed:

    - ``graphs``: FX graphs Dynamo handed the backend (one per compile or recompile);
    - ``pieces``, ``split_pieces``, ``captured_pieces``: the pieces they were split into,
      those holding a split op, and those captured per size;
    - ``captures``: graphs captured of pieces (one per piece and capture size);
    - ``split_captures``: split ops captured as graphs of their own (static metadata);
    - ``whole_captures``: shapes captured as one graph (under ``graphcap.capture``);
    - ``eager_runs``: pieces run eagerly at a size outside the capture sizes (or on
      inputs the capture cannot take);
    - ``recaptures``: pieces captured again because a tensor they read in place (a
      weight) is another one now;
    - ``grad_graphs``, ``grad_runs``: compiles traced with grad enabled and inputs that
      require grad, and their calls, which run eagerly (no graphs).

    Compare two readings around a call to see what it did."""
    total: Counter = Counter()
    for compiler in list(_COMPILERS):
        total.update(compiler.stats)
    return total


def sgl_piecewise(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None):
    """The Dynamo backend registered as ``sgl_piecewise`` (entry point
    ``torch_dynamo_backends``): ``torch.compile(model, backend="sgl_piecewise",
    options={"capture_sizes": [...], "compiler": "inductor"})``."""
    return PiecewiseCompiler(options)(gm, example_inputs)
