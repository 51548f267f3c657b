"""The tc_piecewise strategy: the ``sgl_piecewise`` torch.compile backend, and its use
under ``graphcap.capture(model, strategy="tc_piecewise")``."""

from __future__ import annotations

import types

import torch

from graphcap.core.backend import CaptureBackend, Captured
from graphcap.errors import CaptureError
from graphcap.piecewise.backend import PieceRunner, PiecewiseCompiler, sgl_piecewise


def _entry(model, *args):
    return model(*args)


def _fresh_entry():
    """A function of its own code object: Dynamo keeps its compiled code per code object
    and counts every runner's compile (each with its own backend) against one limit;
    a code object per runner keeps runners of one model from sharing that budget."""
    code = _entry.__code__.replace()
    return types.FunctionType(code, _entry.__globals__, "graphcap_tc_piecewise_forward")


class CompiledForward:
    """The model compiled once with ``fullgraph=True``, dim 0 of every tensor input
    dynamic; a forward Dynamo cannot trace whole fails with a clear error."""

    def __init__(self, model: torch.nn.Module, compiler: PiecewiseCompiler):
        self.model, self.compiler = model, compiler
        self.compiled = torch.compile(_fresh_entry(), backend=compiler, fullgraph=True)

    def __call__(self, *args):
        # Aliases without a view base: Dynamo guards a view on its base's size, which a
        # caller's own tensors (the runner's fallbacks) lack, and would recompile for them.
        args = tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.mark_dynamic(a, 0)
        try:
            return self.compiled(self.model, *args)
        except torch._dynamo.exc.TorchDynamoException as exc:
            if isinstance(exc, torch._dynamo.exc.BackendCompilerFailed):
                inner = getattr(exc, "inner_exception", exc)
                raise CaptureError(
                    f"strategy='tc_piecewise' traced the forward but could not compile its "
                    f"pieces with compiler={self.compiler.compiler!r}: "
                    f"{type(inner).__name__}: {inner}") from exc
            cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc)
            raise CaptureError(
                f"strategy='tc_piecewise' needs torch.compile to trace the whole forward "
                f"(fullgraph=True), and it could not: {cause}. Data-dependent Python "
                "control flow and graph breaks cannot be compiled whole: use "
                "strategy='breakable', which needs no compiler.") from exc


class PiecewiseBackend(CaptureBackend):
    """The runner's view: the compiled forward captures its pieces on its second call at
    a capture size (the runner's warm-up is the first); replay calls it again."""

    strategy = "tc_piecewise"

    def __init__(self, compiler: PiecewiseCompiler):
        self.compiler = compiler

    def capture(self, fn, key, pool) -> Captured:
        before = self.compiler.stats["captures"]
        out = fn()
        pieces = self.compiler.stats["captures"] - before
        return Captured(key, out, fn, segments=pieces,
                        breaks=self.compiler.stats["split_pieces"])


__all__ = ["CompiledForward", "PiecewiseBackend", "PiecewiseCompiler", "PieceRunner",
           "sgl_piecewise"]
