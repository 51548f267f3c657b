"""The ``sgl_piecewise`` torch.compile backend: split at split ops, compile each piece once,
capture it per token count.

Dynamo traces the forward once (``fullgraph=True``, dim 0 of the token inputs dynamic).
The FX graph is split so that each split op (attention, and any op named in
``split_ops``) sits alone in its piece, original order kept. Every other piece is
compiled once, in the backend call, for the symbolic token count (``compiler="eager"``:
the FX code as traced; ``"inductor"``: Inductor's fused kernels, see
:mod:`graphcap.piecewise.inductor`) and wrapped in a
:class:`~graphcap.piecewise.pieces.PieceGraphs`, which for each capture size runs the
piece eagerly once (warm-up), then captures it on the backend's one graph pool, then
replays it. Split ops run eagerly between pieces. Token counts outside the capture sizes
run the pieces eagerly (counted). Under ``graphcap.capture`` the strategy sets a phase
around each call instead (:mod:`graphcap.piecewise.phase`).
"""

from __future__ import annotations

import logging
import weakref
from collections import Counter

import torch

from graphcap import compat
from graphcap.compat import imports
from graphcap.core import hostsync
from graphcap.core.buckets import check_ladder, prefill_ladder
from graphcap.core.graphs import GraphPool, new_pool
from graphcap.core.serial import Serial
from graphcap.errors import GraphcapError
from graphcap.piecewise import phase as phases
from graphcap.piecewise.inductor import compile_piece
from graphcap.piecewise.phase import Phase
from graphcap.piecewise.pieces import PieceGraphs
from graphcap.piecewise.split import (
    builds_autograd_graph,
    device_of,
    held_args,
    host_names,
    host_scalars,
    piece_calls,
    qualname,
    split_graph,
    split_op_names,
    static_state_of,
    token_arg,
)
from graphcap.piecewise.whole import Call
from graphcap.piecewise.writes import aliased_outputs, copies, views_of_inputs

OPTIONS = ("capture_sizes", "max_tokens", "compiler", "split_ops", "copy_outputs", "pool")
COMPILERS = ("eager", "inductor")
log = logging.getLogger("graphcap")
_COMPILERS: weakref.WeakSet = weakref.WeakSet()  # every live compile, for counters()
_ENDED: Counter = Counter()  # the counts of compiles that are gone, for counters()
# split_ops names a graph of the process called: a forward with graph breaks is traced as
# several graphs, each a compile of its own, and the op is called in one of them only.
_MET: set[str] = set()


class Traces:
    """What the compiles of one backend leave in torch's process-wide state, to drop once
    nothing runs them (:meth:`release`): each trace's ShapeEnv, weakly, and the names under
    which FX keeps the code it generated for each: the graphs made of the trace, and those
    Dynamo made and dropped while tracing or replaced on a recompile (found by what their
    code mentions, ``mentioning``, which :meth:`begin` sets before a call that may
    compile)."""

    def __init__(self):
        self.shape_envs: list[weakref.ref] = []
        self.sources: list[str] = []
        self.mark: int | None = None
        self.mentioning: str | None = None

    def begin(self, mentioning: str) -> None:
        self.mark, self.mentioning = compat.fx_source_mark(), mentioning

    def record(self, example_inputs, graph: torch.nn.Module) -> None:
        """A trace Dynamo handed the backend (its fake inputs), and the graph made of it."""
        env = compat.shape_env_of(example_inputs)
        if env is not None:
            self.shape_envs.append(weakref.ref(env))
        self.sources += compat.fx_sources(graph)
        if self.mentioning is not None:
            self.sources += compat.fx_sources_since(self.mark, self.mentioning)
            self.mark = compat.fx_source_mark()

    def release(self) -> None:
        for ref in self.shape_envs:
            compat.release_shape_env(ref())
        compat.forget_fx_sources(self.sources)
        self.shape_envs, self.sources = [], []


class PiecewiseCompiler:
    """A Dynamo backend instance; ``torch.compile(m, backend="sgl_piecewise")`` makes one
    per compile, with ``options=`` as its keyword arguments."""

    def __init__(self, options: dict | None = None, mode: str | None = None):
        opts = own_options(options, mode)
        if "capture_sizes" in opts and "max_tokens" in opts:
            raise GraphcapError("sgl_piecewise: give capture_sizes or max_tokens, not both "
                                "(max_tokens is the top of the default capture sizes)")
        self.capture_sizes = set(check_ladder(
            opts["capture_sizes"], "sgl_piecewise: capture_sizes", "capture size")
            if "capture_sizes" in opts else
            prefill_ladder(opts.get("max_tokens", 2048), "sgl_piecewise: max_tokens",
                           "capture_sizes with the sizes to capture"))
        self.compiler = opts.get("compiler", "eager")
        if self.compiler not in COMPILERS:
            raise GraphcapError(f"sgl_piecewise: compiler={self.compiler!r}; use one of "
                                f"{COMPILERS}")
        named = _split_ops(opts.get("split_ops", ()))
        self.split_names = split_op_names(named)
        self.unmet = set(named)  # split_ops no graph has called yet
        self.copy_outputs = opts.get("copy_outputs", True)
        if not isinstance(self.copy_outputs, bool):
            raise GraphcapError(f"sgl_piecewise: copy_outputs={self.copy_outputs!r}; give "
                                "True or False")
        self.pool: GraphPool | None = opts.get("pool")
        if self.pool is not None and not isinstance(self.pool, GraphPool):
            raise GraphcapError(f"sgl_piecewise: pool={self.pool!r} is no graphcap GraphPool;"
                                " leave it out (each compile makes its own)")
        self.stats: Counter = Counter()  # see counters()
        self.serial: Serial | None = None  # one call at a time: the pieces' static buffers
        self.device: torch.device | None = None  # where its graphs run: the first compile's
        self.static_ptrs: set[int] = set()  # outputs of captured pieces: fixed addresses
        self.traces = Traces()
        self._told_eager: set[str] = set()  # the kinds of reason ran_eagerly() told
        _COMPILERS.add(self)
        weakref.finalize(self, _ENDED.update, self.stats).atexit = False

    def ran_eagerly(self, why: str, kind: str = "call") -> None:
        """A piece ran eagerly where a graph was wanted: counted (``eager_runs``), and
        told once per compile and ``kind`` of reason (a call outside the capture sizes,
        a piece that cannot be captured), naming why (a run of calls that never capture
        would otherwise pass unnoticed)."""
        self.stats["eager_runs"] += 1
        if kind not in self._told_eager:
            self._told_eager.add(kind)
            log.warning("sgl_piecewise: %s. It ran eagerly (counters()['eager_runs'] counts "
                        "every such run; told once per compile and kind of reason).", why)

    def ran_outside(self, size: int | None) -> None:
        """A piece ran eagerly at a call of ``size``, no capture size (None: of no size)."""
        if size is None:
            self.ran_eagerly(
                "a call has no size to capture: the capture sizes count dim 0 of the first "
                "tensor argument the forward reads (else a dynamic size, else a tensor "
                "attribute's), and its graph reads no tensor with a dim; pass one it works "
                "on as an argument", kind="no size")
            return
        self.ran_eagerly(
            f"a call of size {size} (dim 0 of the first tensor argument the forward reads, "
            "or its dynamic dim where dim 0 is static) is not one of the capture sizes "
            f"{_sizes(self.capture_sizes)}: pad calls to a capture size, or give "
            "options={'capture_sizes': [...]}; a transformers model called with [batch, "
            "tokens] ids is read by its batch, and runs on graphs under "
            "graphcap.accelerate(model) or graphcap.LLM(model)")

    def _meet(self, gm: torch.fx.GraphModule) -> None:
        """Tell, once, of ``split_ops`` names the first graph traced never calls (a
        module traced as another op than the one named: ``nn.Linear`` as
        ``torch._C._nn.linear``, not ``aten::addmm``), unless a graph of the process
        called them (the other side of a graph break); a later graph calling one is
        split at it as named."""
        called = {qualname(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        _MET.update(self.unmet & called)
        unmet, self.unmet = self.unmet - _MET, set()
        if unmet:
            log.warning("sgl_piecewise: split_ops names %s, which the traced forward never "
                        "calls (Dynamo traces torch functions, nn.Linear as "
                        "torch._C._nn.linear, and registered ops as named), so nothing is "
                        "split there; the registered ops it calls: %s", ", ".join(
                            map(repr, sorted(unmet))), ", ".join(sorted(
                                c for c in called if c)) or "none")

    def pool_for(self, args) -> GraphPool:
        if self.pool is None:
            self.pool = new_pool(device_of(args))
        return self.pool

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.stats["graphs"] += 1
        imports.complete(imports.INDUCTOR if self.compiler == "inductor" else ())
        hostsync.check_value_guards(guards_checked=phases.current()[0] is None)
        if builds_autograd_graph(gm):
            self.traces.record(example_inputs, gm)
            return self._eager_for_autograd(gm)
        device = _normal(device_of(example_inputs))
        if self.serial is None:
            self.device, self.serial = device, Serial(device)
        elif device != self.device:
            raise GraphcapError(
                f"sgl_piecewise: this compile captures its graphs on {self.device}, and a "
                f"call on {device} needs graphs (a pool, an order of calls) of its own: "
                "compile for that device with a PiecewiseCompiler of its own, or with "
                "backend='sgl_piecewise' (one for each graph Dynamo compiles)")
        scalars = host_scalars(gm)
        token = token_arg(gm)
        aliased = aliased_outputs(gm.graph)
        split, pieces = split_graph(gm, self.split_names)
        self._meet(gm)
        static = True  # every split op can be captured inside a graph
        held, names = held_args(split), host_names(split)
        for piece in pieces:
            self.stats["pieces"] += 1
            if piece.is_split:
                self.stats["split_pieces"] += 1
                check = static_state_of(piece.module, self.split_names)
                if check is not None:  # replayed as a graph while its state is static
                    setattr(split, piece.name, PieceGraphs(
                        self, piece.module, piece.module, static_state=check,
                        held=held[piece.name], names=names[piece.name]))
                static &= check is not None
                continue
            self.stats["captured_pieces"] += 1
            inductor = self.compiler == "inductor"
            graphs = PieceGraphs(self, compile_piece(piece.module) if inductor else
                                 piece.module, piece.module, opaque=inductor,
                                 held=held[piece.name], names=names[piece.name])
            setattr(split, piece.name, graphs)
        split.graphcap_split_pieces = sum(p.is_split for p in pieces)
        # Each piece frees what it uses last (PieceGraphs.forward); a split op run as
        # traced (no static state) takes its arguments as before. Every piece is called
        # past nn.Module.__call__ (its hooks).
        piece_calls(split, {name for name, m in split.named_children()
                            if isinstance(m, PieceGraphs)})
        self.traces.record(example_inputs, split)

        def forward(*args):
            if scalars:  # host values, read outside any graph
                args = tuple(a.item() if i in scalars else a for i, a in enumerate(args))
            with self.serial.held():
                self.serial.order()
                return run(*args)

        def run(*args):
            size = None if token is None else (
                args[token] if isinstance(args[token], int) else args[token].shape[0])
            now, watch = phases.current()
            if now is Phase.WARMUP:  # recorded: may the shape be captured as one graph?
                watch.call = Call(split, args, static=static)
            sized = phases.enter_size(size)
            try:
                out = split.forward(*args)  # past hooks: see split.piece_calls
            finally:
                phases.exit_size(sized)
            if now is Phase.WARMUP:
                watch.call.outputs = out
            if not self.copy_outputs:
                return out
            # The last piece's outputs are static and overwritten by the next call; views
            # of the call's own tensors are returned as eager returns them, and outputs
            # sharing memory share their copy.
            if not isinstance(out, (tuple, list)):
                return out
            views = views_of_inputs(out, args, aliased) if aliased else set()
            return type(out)(copies(out, views))

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


def _sizes(sizes) -> str:
    ordered = sorted(sizes)
    return str(ordered) if len(ordered) <= 8 else \
        f"[{', '.join(map(str, ordered[:4]))}, ..., {', '.join(map(str, ordered[-2:]))}]"


def _normal(device: torch.device) -> torch.device:
    """``device`` with its index: ``cuda`` is the current CUDA device."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _split_ops(names) -> list[str]:
    """``split_ops`` checked: a list of registered ops' names, ``namespace::op``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, (list, tuple, set,
                                                                 frozenset)):
        raise GraphcapError(f"sgl_piecewise: split_ops={names!r}; give a list of op names "
                            "('namespace::op'), e.g. ['mylib::attention']")
    for name in names:
        namespace, _, op = str(name).partition("::")
        if not op or not hasattr(getattr(torch.ops, namespace), op):
            raise GraphcapError(f"sgl_piecewise: split_ops names {name!r}, which is no "
                                "registered op ('namespace::op', as torch.library defines "
                                "it); register the op before compiling")
    return list(names)


def own_options(options: dict | None, mode: str | None = None) -> dict:
    """``sgl_piecewise``'s options of ``options``. What torch.compile means for Inductor
    (``mode=``, the keys of ``torch._inductor.list_options()``) is accepted, as torch's
    own custom backends accept it, and ignored with one warning; any other key, or a mode
    torch.compile does not have, raises."""
    opts = dict(options or {})
    foreign = [key for key in opts if key not in OPTIONS]
    inductor = _inductor_options() if foreign else set()
    ignored = [key for key in foreign if key.replace("-", "_") in inductor]
    unknown = sorted(set(foreign) - set(ignored))
    if unknown:
        raise GraphcapError(f"sgl_piecewise: unknown options {unknown}; its own: "
                            f"{list(OPTIONS)} (Inductor's are accepted and ignored)")
    mode = None if mode == "default" else mode
    if mode is not None and mode not in _inductor_modes():
        raise GraphcapError(f"sgl_piecewise: mode={mode!r} is no torch.compile mode (one of "
                            f"{sorted(_inductor_modes())}, all ignored by sgl_piecewise)")
    if mode is not None or ignored:
        given = ([f"mode={mode!r}"] if mode else []) + ([f"options {ignored}"] if ignored else [])
        log.warning("sgl_piecewise ignores Inductor's %s: it captures CUDA graphs of its own, "
                    "piece by piece per capture size; its own options are %s "
                    "(compiler='inductor' compiles each piece with Inductor)",
                    " and ".join(given), ", ".join(OPTIONS))
    return {key: value for key, value in opts.items() if key in OPTIONS}


def _inductor_options() -> set[str]:
    from torch._inductor import list_options

    return set(list_options())


def _inductor_modes() -> set[str]:
    from torch._inductor import list_mode_options

    return set(list_mode_options())


def counters() -> Counter:
    """The counters of every ``sgl_piecewise`` compile of the process, summed (those that
    are gone included, so a count never goes down between two readings):

    - ``graphs``: FX graphs Dynamo handed the backend (one per compile or recompile);
    - ``pieces``, ``split_pieces``, ``captured_pieces``: the pieces they were split into,
      those holding a split op, and those captured per size;
    - ``captures``: graphs captured of pieces (one per piece and capture size);
    - ``split_captures``: split ops captured as graphs of their own (static metadata);
    - ``whole_captures``: shapes captured as one graph (under ``graphcap.capture``);
    - ``eager_runs``: pieces run eagerly at a size outside the capture sizes (or on
      inputs the capture cannot take, or a Python number past its changes);
    - ``recaptures``: pieces captured again because a tensor they read in place (a
      weight, a buffer) is another one now, or a Python number they baked changed;
    - ``grad_graphs``, ``grad_runs``: compiles traced with grad enabled and inputs that
      require grad, and their calls, which run eagerly (no graphs).

    Compare two readings around a call to see what it did."""
    total: Counter = Counter(_ENDED)
    for compiler in list(_COMPILERS):
        total.update(compiler.stats)
    return total


def sgl_piecewise(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None,
                  options: dict | None = None):
    """The Dynamo backend registered as ``sgl_piecewise`` (entry point
    ``torch_dynamo_backends``): ``torch.compile(model, backend="sgl_piecewise",
    options={"capture_sizes": [...], "compiler": "inductor"})``. Inductor's ``mode=`` and
    option keys are accepted and ignored with a warning (:func:`own_options`)."""
    return PiecewiseCompiler(options, mode)(gm, example_inputs)
