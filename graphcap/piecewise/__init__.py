"""The tc_piecewise strategy: the ``sgl_piecewise`` torch.compile backend
(:mod:`~graphcap.piecewise.compiler`), and its use under ``graphcap.capture(model,
strategy="tc_piecewise")`` (:mod:`~graphcap.piecewise.strategy`)."""

from graphcap.piecewise.compiler import PiecewiseCompiler, counters, sgl_piecewise
from graphcap.piecewise.pieces import PieceGraphs
from graphcap.piecewise.strategy import CompiledForward, PiecewiseStrategy

__all__ = ["CompiledForward", "PieceGraphs", "PiecewiseCompiler", "PiecewiseStrategy",
           "counters", "sgl_piecewise"]
