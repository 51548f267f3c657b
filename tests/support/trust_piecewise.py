"""What the ``sgl_piecewise`` trust tests share: a small model of token ids, its compile at
capture sizes 4 and 8, the split op ``graphcap_trust::split_b``, and calls of a compiled
module compared with an eager twin's."""

from __future__ import annotations

import torch
from torch import nn

from graphcap.piecewise import PiecewiseCompiler, counters
from tests.support.runner_helpers import DEVICE


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.lin = nn.Linear(16, 16)
        self.norm = nn.LayerNorm(16)
        self.scale = 0.5

    def forward(self, ids):
        return self.norm(self.lin(self.emb(ids))) * self.scale


def net():
    torch.manual_seed(0)
    return Net().to(DEVICE)


def compiled(m, **kw):
    # The backend itself: on the GPU machine graphcap runs from the tree, without the
    # entry point that resolves backend="sgl_piecewise".
    return torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [4, 8]}), **kw)


def ids(n, seed=0):
    return torch.randint(0, 100, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def warm(c, n=4):
    for seed in range(3):  # warm-up, capture, replay
        c(ids(n, seed))


_LIB = torch.library.Library("graphcap_trust", "FRAGMENT")
_LIB.define("split_b(Tensor x, Tensor(a!) out) -> ()")


def _split_b(x, out):
    out.copy_(x * 3 + 1)


_LIB.impl("split_b", _split_b, "CompositeExplicitAutograd")


def calls_beside_eager(module, args_of, calls: int, **options):
    """``module`` compiled (capture size 4, ``split_b`` a split op) beside an eager twin,
    each call's outputs and buffers compared; the counters' change at each call."""
    torch.manual_seed(0)
    m = module().to(DEVICE)
    twin = module().to(DEVICE)
    twin.load_state_dict(m.state_dict())
    c = torch.compile(m, backend=PiecewiseCompiler({
        "capture_sizes": [4], "split_ops": ["graphcap_trust::split_b"], **options}),
        fullgraph=True)
    changes = []
    with torch.no_grad():
        for k in range(calls):
            before = counters()
            torch.testing.assert_close(c(*args_of(m, k)), twin(*args_of(twin, k)),
                                       msg=lambda s, k=k: f"call {k}: {s}")
            changes.append({key: n for key, n in (counters() - before).items() if n})
            for (name, got), (_, want) in zip(m.named_buffers(), twin.named_buffers(),
                                              strict=True):
                torch.testing.assert_close(got, want, msg=f"call {k}: buffer {name}")
    return changes
