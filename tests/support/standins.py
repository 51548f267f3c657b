"""A graph that only re-runs the captured function: what the emulator must not be.

The semantics suite runs against it (``--graph-standin=rerun``) and must fail every test,
which proves no semantics test could pass on plain eager re-execution.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from graphcap.core.graph_base import Graph


class RerunGraph(Graph):
    emulated = True

    def __init__(self, pool):
        self.pool, self.device = pool, pool.device
        self._call = None

    def begin(self):
        raise NotImplementedError("the re-run stand-in captures whole functions only")

    end = begin

    def abort(self, exc):
        return exc

    def capture(self, fn, *args, **kwargs):
        self._call = (fn, args, kwargs)
        self._outs = fn(*args, **kwargs)
        return self._outs

    def replay(self):
        fn, args, kwargs = self._call
        fresh = tree_flatten(fn(*args, **kwargs))[0]
        for out, new in zip(tree_flatten(self._outs)[0], fresh, strict=True):
            if isinstance(out, torch.Tensor):
                out.copy_(new)

    def reset(self):
        self._call = None

    @property
    def captured(self):
        return self._call is not None

    @property
    def bytes_held(self):
        return sum(t.untyped_storage().nbytes() for t in tree_flatten(self._outs)[0]
                   if isinstance(t, torch.Tensor))


class RerunPool:
    kind = "rerun"
    emulated = True

    def __init__(self, device):
        self.device = torch.device(device)
        self._graphs = []

    def graph(self):
        g = RerunGraph(self)
        self._graphs.append(g)
        return g

    def bytes(self):
        return sum(g.bytes_held for g in self._graphs if g.captured)

    def warmup(self):
        return contextlib.nullcontext()
