"""The tc_piecewise strategy: the ``sgl_piecewise`` torch.compile backend, and its use
under ``graphcap.capture(model, strategy="tc_piecewise")``."""

from __future__ import annotations

import torch

from graphcap.core.backend import CaptureBackend, Captured
from graphcap.errors import CaptureError
from graphcap.piecewise.backend import PieceRunner, PiecewiseCompiler, sgl_piecewise


class CompiledForward:
    """The model compiled once with ``fullgraph=True``, dim 0 of every tensor input
    dynamic; a forward Dynamo cannot trace whole fails with a clear error."""

    def __init__(self, model: torch.nn.Module, compiler: PiecewiseCompiler):
        self.model, self.compiler = model, compiler
        self.compiled = torch.compile(model, backend=compiler, fullgraph=True)

    def __call__(self, *args):
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim():
                torch._dynamo.mark_dynamic(a, 0)
        try:
            return self.compiled(*args)
        except torch._dynamo.exc.TorchDynamoException as exc:
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
