"""``strategy="tc_piecewise"``: the model compiled by the ``sgl_piecewise`` backend, each
shape captured under the runner as one graph when it can be, else piece by piece."""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import types
import weakref

import torch

from graphcap import compat
from graphcap.compat import guards
from graphcap.core.snapshot import forward_hooks
from graphcap.core.strategy import Captured, Strategy
from graphcap.errors import CaptureError, GraphcapError
from graphcap.piecewise import phase as phases
from graphcap.piecewise.compiler import PiecewiseCompiler, Traces
from graphcap.piecewise.phase import Phase, Watch
from graphcap.piecewise.pieces import PieceGraphs
from graphcap.piecewise.whole import WholeCapture


def _entry(graphcap_model, *graphcap_args, **graphcap_options):
    return graphcap_model(*graphcap_args, **graphcap_options)


# What the code FX generates of _entry's compile mentions: Dynamo names a graph input it
# reads from _entry's arguments L_graphcap_..., the pieces l_graphcap_..., and the pieces
# of graphcap's split ops call torch.ops.graphcap.
OUR_CODE_MENTIONS = "graphcap"


_NAMES = itertools.count()
# Code objects of released compiles, each free for the next runner: Dynamo keeps state per
# code object (and memos of it) for the process's life, so they are reused, not made anew.
_FREE: list[types.CodeType] = []


def _fresh_entry():
    """A function of a code object and name no live runner uses: Dynamo keeps compiled
    code per code object and counts compiles against one limit per code object, and its
    automatic-dynamic record per code name (a second model's other norm eps would turn
    every later compile's eps dynamic). A released runner's code
    object is reused, what Dynamo kept of its compiles dropped (:func:`_release`)."""
    try:
        code = _FREE.pop()
    except IndexError:
        name = f"graphcap_tc_piecewise_forward_{next(_NAMES)}"
        code = _entry.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, _entry.__globals__, code.co_name)


def _release(code: types.CodeType, compiler: weakref.ref, traces: Traces) -> None:
    """A runner's compiled forward is gone: drop what torch keeps of its compiles for the
    process's life (the backend and everything it holds: graphs, pool, the pieces' static
    buffers; the compiled code and guards; each trace's ShapeEnv and fake tensors; FX's
    sources), and free its code object for the next runner."""
    compat.forget_backend(compiler())
    reusable = compat.forget_code(code)
    traces.release()
    compat.forget_finished_compiles()
    if reusable:
        _FREE.append(code)


# Dynamo's refusal to compile a frame again (fullgraph): a subclass of Exception only on
# some torch versions.
_RECOMPILE_LIMIT = getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", ())
# A dim marked dynamic that the traced Python specialised (a RuntimeError, not Dynamo's).
_SPECIALISED = torch.fx.experimental.symbolic_shapes.ConstraintViolationError


class CompiledForward:
    """The model compiled once with ``fullgraph=True``, dim 0 of every tensor input
    dynamic; a forward Dynamo cannot trace whole fails with a clear error. A call outside
    the strategy's phases (a runner's fallback) runs every piece eagerly."""

    def __init__(self, model: torch.nn.Module, compiler: PiecewiseCompiler):
        self.model, self.compiler = model, compiler
        entry = _fresh_entry()
        self.compiled = torch.compile(entry, backend=compiler, fullgraph=True)
        self._code = entry.__code__
        self._hooks: dict | None = None  # the model's forward hooks as it last compiled
        # Run when the compiled function dies with this object; holds neither it nor the
        # compiler (Dynamo holds the compiler until then).
        weakref.finalize(entry, _release, entry.__code__, weakref.ref(compiler),
                         compiler.traces).atexit = False

    def __call__(self, *args, **options):
        """The forward on ``args``; ``options``: keyword arguments that are no tensors
        (``hidden=True``), constants of the trace (Dynamo guards on them)."""
        if any(isinstance(v, torch.Tensor) for v in options.values()):
            named = sorted(k for k, v in options.items() if isinstance(v, torch.Tensor))
            raise TypeError("strategy='tc_piecewise' passes tensors to the compiled forward "
                            f"by position; got tensor keywords {named}")
        now, detail = phases.current()
        if now is Phase.CAPTURE_WHOLE:  # the compiled graph itself, on this call's tensors
            return detail.call.direct(args)
        if now is None:
            with phases.phase(Phase.EAGER):
                return self._compiled(args, options)
        if now is Phase.WARMUP:
            self._compile_with_hooks_of_now()
        out = self._compiled(args, options)
        call = detail.call if now is Phase.WARMUP else None
        if call is not None and call.returns is None and args \
                and isinstance(args[0], torch.Tensor) and args[0].dim():
            call.learn_returns(out, tokens=args[0].shape[0])
            call.learn_inputs(args)
        return out

    def _compile_with_hooks_of_now(self) -> None:
        """Before a warm-up (every capture's): where the model's forward hooks and
        pre-hooks (its modules' and the global ones) are not those it last compiled with,
        its compiled code is dropped, and the warm-up compiles the forward again with
        them. Dynamo guards on no hook (``skip_nnmodule_hook_guards``): a recapture after a
        hook was added or removed would otherwise replay the hooks of the first compile."""
        hooks = forward_hooks(self.model)
        if self._hooks is not None and hooks != self._hooks:
            compat.forget_code(self._code)
        self._hooks = hooks

    def _compiled(self, args, options=None):
        # Aliases without a view base: Dynamo guards a view on its base's size, which a
        # caller's own tensors (the runner's fallbacks) lack, and would recompile for them.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.mark_dynamic(a, 0)
        traces, graphs = self.compiler.traces, self.compiler.stats["graphs"]
        traces.begin(OUR_CODE_MENTIONS)  # from here, what FX generates of this frame is ours
        try:
            # In a copy of the context: torch 2.13's config patches, a few per compile, each
            # leave a context variable in the context they ran in, for its life.
            context = guards.graphcap_compile(contextvars.copy_context())
            out = context.run(self._guarded, args, options or {})
            if self.compiler.stats["graphs"] != graphs:
                compat.forget_finished_compiles()
            return out
        except _RECOMPILE_LIMIT as exc:  # no TorchDynamoException on every torch
            raise CaptureError(
                "strategy='tc_piecewise' compiled the forward again at every call until "
                "Dynamo's recompile limit: Python state it reads changes between calls (a "
                "counter, a flag), which a replay would freeze; keep such state in tensors, "
                f"or use strategy='breakable' ({str(exc).strip().splitlines()[0]})") from exc
        except _SPECIALISED as exc:
            raise CaptureError(
                "strategy='tc_piecewise' compiles the forward once for every token count "
                "(dim 0 of its arguments dynamic), and this forward's Python pins it to a "
                "constant (a branch on x.shape[0] == n, a buffer built for each size): use "
                "strategy='breakable' or 'full', which capture each shape as it runs "
                f"({str(exc).strip().splitlines()[0]})") from exc
        except torch._dynamo.exc.TorchDynamoException as exc:
            if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
                inner = getattr(exc, "inner_exception", exc)
                if isinstance(inner, GraphcapError):  # the backend's own refusal, as it said
                    raise inner from exc
                raise CaptureError(
                    f"strategy='tc_piecewise' traced the forward but could not compile its "
                    f"pieces with compiler={self.compiler.compiler!r}: "
                    f"{type(inner).__name__}: {inner}") from exc
            self._raise_the_models_own_error(args, options, exc)
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
            raise CaptureError(
                f"strategy='tc_piecewise' needs torch.compile to trace the whole forward "
                f"(fullgraph=True), and it could not: {cause}. Data-dependent Python "
                "control flow and graph breaks cannot be compiled whole: use "
                "strategy='breakable', which needs no compiler.") from exc

    def _guarded(self, args: tuple, options: dict):
        # Every tensor guarded, and where the call may compile (a warm-up, every shape's
        # first call; an eager call), one compile for every token count, 1 included
        # (graphcap.compat.guards). A replay of the pieces runs the code its shape's
        # warm-up compiled: no compile settings patched for it (about 40 us a call).
        replay = phases.current()[0] is Phase.PIECES
        sizes = contextlib.nullcontext() if replay else guards.no_zero_one_specialisation()
        with guards.tensor_guards(), sizes:
            return self.compiled(self.model, *args, **options)

    def _raise_the_models_own_error(self, args, options, exc: BaseException) -> None:
        """Dynamo reports an exception the forward raises itself as a failure to trace:
        run the forward eagerly, as it was called (its options too), and raise what it
        raises (the model's own error)."""
        try:
            self.model(*args, **(options or {}))
        except Exception as own:
            own.add_note("graphcap: raised by the model's forward, run eagerly after "
                         f"torch.compile failed on it ({type(exc).__name__})")
            raise own from None


class PiecewiseStrategy(Strategy):
    """The runner's view. It watches the runner's warm-up call of each shape; when every
    split op in it read static state the shape is captured as one graph
    (:mod:`graphcap.piecewise.whole`), else piece by piece: the compiled forward captures
    its pieces on its call in the ``PIECES`` phase, and replays them in it."""

    name = "tc_piecewise"
    warms_every_shape = True  # each shape's warm-up compiles (or re-guards) the forward

    def __init__(self, compiler: PiecewiseCompiler):
        self.compiler = compiler
        self._watched: dict[int, Watch] = {}

    @property
    def sizes_pool(self) -> bool:
        """The first warm-up sizes the pool where its peak is the pieces': with the eager
        compiler (the FX pieces run as traced), not Inductor's (its autotuning
        benchmarks in the compiling warm-up)."""
        return self.compiler.compiler == "eager"

    def watch(self, key):
        self._watched[key] = watch = Watch()
        return phases.phase(Phase.WARMUP, watch)

    def capture(self, fn, key, pool) -> Captured:
        if self.compiler.pool is None:  # the pieces' graphs go where the runner's go
            self.compiler.pool = pool
        watch = self._watched.pop(key, None)
        call = watch.call if watch is not None else None
        if call is not None and call.replayable(key):
            graph = pool.graph()
            whole = WholeCapture(call, graph.emulated, graph=graph)
            with phases.phase(Phase.CAPTURE_WHOLE, whole):
                graph.capture(fn)
            self.compiler.stats["whole_captures"] += 1
            # whole.replay: the capture keeps what its graph replays (Inductor pieces)
            return Captured(whole.replay, segments=1, splits_in_graph=whole.splits)
        before = self.compiler.stats["captures"]
        with phases.phase(Phase.PIECES):
            fn()

        def replay():
            with phases.phase(Phase.PIECES):
                fn()

        if call is None:  # no record of the pieces: those this capture made
            return Captured(replay, segments=self.compiler.stats["captures"] - before)
        # The pieces with a graph of this size, those captured before included (a
        # recapture of the runner replays the graphs of pieces that did not change).
        graphs = sum(isinstance(p, PieceGraphs) and p.static_state is None
                     and key in p.entries for p in call.module.children())
        return Captured(replay, segments=graphs,
                        breaks=getattr(call.module, "graphcap_split_pieces", 0))
