"""The full strategy: one graph per shape; prefill made static by token buckets and
request slots whose unused slots are zero-length sentinels (the runner's attention
metadata, rebuilt outside the graph before every replay)."""

from __future__ import annotations

from graphcap.core.backend import CaptureBackend, Captured
from graphcap.core.graphs import GraphPool


class FullBackend(CaptureBackend):
    """``strategy="full"``: the whole forward of one shape in one graph."""

    strategy = "full"

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        graph = pool.graph()
        out = graph.capture(fn)
        return Captured(key, out, graph.replay, segments=1, graphs=[graph])


__all__ = ["FullBackend"]
