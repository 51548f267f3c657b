"""sgl_piecewise: a split op captured as a graph of its own replays only while the static
state it was captured on (attention metadata) is the one it reads now."""

from __future__ import annotations

import contextvars
import gc

import pytest
import torch
from torch import nn

import graphcap
from graphcap.piecewise import PiecewiseCompiler
from tests.support.runner_helpers import DEVICE

SPLIT = "graphcap_test::scaled_by_state"
# What the op's state holds, read when it runs. The emulator replays a custom op in the
# context of its capture: a replay reads the captured state's value, as a CUDA graph
# reads the captured state's buffers.
SCALE: contextvars.ContextVar[float] = contextvars.ContextVar("graphcap_test_scale")
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
HOLDER: dict = {}  # the state the op reads now, held by its caller alone


class State:
    """A split op's static state object (as attention metadata is)."""


def _scaled(x, out):
    out.copy_(x * SCALE.get())


if SPLIT not in graphcap.opsdb.REGISTRY:
    graphcap.register_op(SPLIT, "(Tensor x, Tensor(a!) out) -> ()", reference=_scaled,
                         fake=lambda x, out: None, split=True,
                         static_state=lambda: HOLDER.get("state"))


class Scales(nn.Module):
    def forward(self, x):
        out = torch.empty_like(x)
        torch.ops.graphcap_test.scaled_by_state(x + 1, out)
        return out - 1


def _call(compiled, model, scale: float):
    x = torch.ones(8, 4, device=DEVICE)
    token = SCALE.set(scale)
    try:
        with torch.no_grad():
            return compiled(x), model(x)
    finally:
        SCALE.reset(token)


def test_a_split_graph_whose_state_is_gone_runs_eagerly_where_the_op_reads_none_now():
    m = Scales()
    compiler = PiecewiseCompiler({"capture_sizes": [8]})
    c = torch.compile(m, backend=compiler, fullgraph=True)
    for scale in (1.0, 2.0):  # warm-up, then the capture on this state
        HOLDER["state"] = State()
        torch.testing.assert_close(*_call(c, m, scale))
    assert compiler.stats["split_captures"] == 1
    HOLDER["state"] = None  # the captured state is gone; the op reads none now
    gc.collect()
    for scale in (3.0, 5.0):
        torch.testing.assert_close(*_call(c, m, scale), msg=lambda s, k=scale: f"{k}: {s}")
