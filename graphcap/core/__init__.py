"""What every capture strategy shares: the graph primitive, buckets, batches, the runner."""

from graphcap.core.graph_base import Graph
from graphcap.core.graphs import CudaGraph, EmulatedGraph, GraphPool, graph_kind, new_pool

__all__ = ["CudaGraph", "EmulatedGraph", "Graph", "GraphPool", "graph_kind", "new_pool"]
