"""The tc_piecewise strategy: the ``sgl_piecewise`` torch.compile backend, and its use
under ``graphcap.capture(model, strategy="tc_piecewise")``."""

from __future__ import annotations

import contextlib
import itertools
import types

import torch

from graphcap import compat
from graphcap.core.backend import CaptureBackend, Captured
from graphcap.errors import CaptureError
from graphcap.piecewise.backend import PieceRunner, PiecewiseCompiler, counters, sgl_piecewise
from graphcap.piecewise.whole import WholeCapture


def _entry(model, *args):
    return model(*args)


_RUNNERS = itertools.count()


def _fresh_entry():
    """A function of its own code object and name: Dynamo keeps its compiled code per code
    object and counts every runner's compile (each with its own backend) against one
    limit, and keeps its automatic-dynamic record per code *name*: one shared name let a
    second model's different float attribute (its norm eps) turn the eps of every later
    compile into a dynamic value, which a custom op's float argument refuses (SymFloat on
    torch 2.11, a tensor read with .item() on 2.13). A fresh name per runner keeps each
    compile to its own model."""
    name = f"graphcap_tc_piecewise_forward_{next(_RUNNERS)}"
    code = _entry.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, _entry.__globals__, name)


class CompiledForward:
    """The model compiled once with ``fullgraph=True``, dim 0 of every tensor input
    dynamic; a forward Dynamo cannot trace whole fails with a clear error."""

    def __init__(self, model: torch.nn.Module, compiler: PiecewiseCompiler):
        self.model, self.compiler = model, compiler
        entry = _fresh_entry()
        self.compiled = torch.compile(entry, backend=compiler, fullgraph=True)
        # Dynamo would keep the compiler, and its graph pool, for the process's life.
        compat.release_compiled(entry, compiler)

    def __call__(self, *args):
        whole = self.compiler.whole
        if whole is not None:  # captured as one graph: the compiled graph, directly
            return whole.call.direct()
        # Aliases without a view base: Dynamo guards a view on its base's size, which a
        # caller's own tensors (the runner's fallbacks) lack, and would recompile for them.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.mark_dynamic(a, 0)
        try:
            out = self.compiled(self.model, *args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
                inner = getattr(exc, "inner_exception", exc)
                raise CaptureError(
                    f"strategy='tc_piecewise' traced the forward but could not compile its "
                    f"pieces with compiler={self.compiler.compiler!r}: "
                    f"{type(inner).__name__}: {inner}") from exc
            self._raise_the_models_own_error(args, exc)
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
            raise CaptureError(
                f"strategy='tc_piecewise' needs torch.compile to trace the whole forward "
                f"(fullgraph=True), and it could not: {cause}. Data-dependent Python "
                "control flow and graph breaks cannot be compiled whole: use "
                "strategy='breakable', which needs no compiler.") from exc
        call = self.compiler.last_call
        if call is not None and call.returns is None and args and \
                isinstance(args[0], torch.Tensor) and args[0].dim():
            call.learn_returns(out, tokens=args[0].shape[0])
        return out

    def _raise_the_models_own_error(self, args, exc: BaseException) -> None:
        """Dynamo reports an exception the forward raises itself as a failure to trace:
        run the forward eagerly, and raise what it raises (the model's own error)."""
        try:
            self.model(*args)
        except Exception as own:
            own.add_note("graphcap: raised by the model's forward, run eagerly after "
                         f"torch.compile failed on it ({type(exc).__name__})")
            raise own from None


class PiecewiseBackend(CaptureBackend):
    """The runner's view. The backend watches the runner's warm-up call of each shape;
    when its split ops all read static state the shape is captured as one graph
    (:mod:`graphcap.piecewise.whole`), else piece by piece: the compiled forward captures
    its pieces on its second call at a capture size, and replay calls it again."""

    strategy = "tc_piecewise"
    watches_warmup = True  # each shape's warm-up compiles (or re-guards) the forward

    def __init__(self, compiler: PiecewiseCompiler):
        self.compiler = compiler

    @contextlib.contextmanager
    def watch(self, key):
        self.compiler.last_call, self.compiler.watching = None, True
        try:
            yield
        finally:
            self.compiler.watching = False

    def capture(self, fn, key, pool) -> Captured:
        compiler = self.compiler
        call, compiler.last_call = compiler.last_call, None
        compiler.whole_sizes.discard(key)
        if call is not None and call.replayable(key):
            return self._capture_whole(fn, key, pool, call)
        before = compiler.stats["captures"]
        out = fn()
        pieces = compiler.stats["captures"] - before
        return Captured(key, out, fn, segments=pieces, breaks=compiler.stats["split_pieces"])

    def _capture_whole(self, fn, key, pool, call) -> Captured:
        graph = pool.graph()
        whole = WholeCapture(call, graph.emulated, graph=graph)
        self.compiler.whole = whole
        try:
            out = graph.capture(fn)
        finally:
            self.compiler.whole = None
        self.compiler.whole_sizes.add(key)
        self.compiler.stats["whole_captures"] += 1
        return Captured(key, out, whole.replay, segments=1, graphs=[graph],
                        states=whole.states, splits_in_graph=whole.splits)


__all__ = ["CompiledForward", "PiecewiseBackend", "PiecewiseCompiler", "PieceRunner",
           "counters", "sgl_piecewise"]
