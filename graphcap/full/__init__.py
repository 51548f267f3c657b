"""The full strategy: one graph per shape; prefill made static by token buckets and
request slots whose unused slots are zero-length sentinels (the runner's attention
metadata, rebuilt outside the graph before every replay)."""

from __future__ import annotations

from graphcap.core.graphs import GraphPool
from graphcap.core.strategy import Captured, Strategy


class FullStrategy(Strategy):
    """``strategy="full"``: the whole forward of one shape in one graph."""

    name = "full"

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        graph = pool.graph()
        graph.capture(fn)
        return Captured(graph.replay)


__all__ = ["FullStrategy"]
