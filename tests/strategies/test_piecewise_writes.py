"""sgl_piecewise: every way a forward writes its caller's tensor, as Dynamo traces it,
reaches that tensor on every replay, and the pieces after the write read what it wrote."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphcap
from graphcap.piecewise import PiecewiseCompiler
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

SPLIT = "graphcap_test::scale_into"


def _scale_into(x, out):
    out.copy_(x * 2)


if SPLIT not in graphcap.opsdb.REGISTRY:  # a split op without static state: pieces
    graphcap.register_op(SPLIT, "(Tensor x, Tensor(a!) out) -> ()", reference=_scale_into,
                         fake=lambda x, out: None, split=True)


class WritesItsInput(nn.Module):
    """Writes ``x`` in a piece, then reads it again in the piece after a split op."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        if self.how == "inplace-keyword":
            F.relu(x, inplace=True)  # Dynamo keeps the call, inplace=True and all
        elif self.how == "inplace-positional":
            F.hardtanh(x, -0.5, 0.5, True)
        elif self.how == "module-inplace":
            nn.ReLU(inplace=True)(x)
        elif self.how == "attribute-view":
            x.T.mul_(-1)  # getattr(x, "T") in Dynamo's graph
        elif self.how == "ravel":
            x.ravel()[:4].fill_(3.0)
        elif self.how == "input-keyword":  # the tensor given by keyword: no args at all
            F.relu(input=x, inplace=True)
        elif self.how == "view-input-keyword":
            torch.flatten(input=x)[:4].fill_(3.0)
        out = torch.empty_like(x)
        torch.ops.graphcap_test.scale_into(self.lin(x), out)
        return out + x


HOWS = ["inplace-keyword", "inplace-positional", "module-inplace", "attribute-view", "ravel",
        "input-keyword", "view-input-keyword"]


@pytest.mark.parametrize("how", HOWS)
def test_a_write_of_the_callers_tensor_reaches_it_and_the_next_piece_on_every_replay(how):
    torch.manual_seed(0)
    m = WritesItsInput(how).to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [8]}), fullgraph=True)
    with torch.no_grad():
        for call in range(4):  # warm-up, capture, replays
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(call)).to(DEVICE)
            x_eager = x.clone()
            torch.testing.assert_close(c(x), m(x_eager), msg=lambda s, n=call: f"{n}: {s}")
            torch.testing.assert_close(x, x_eager, msg=lambda s, n=call: f"{n}: x: {s}")


@pytest.mark.parametrize("how", ["inplace-keyword", "attribute-view"])
def test_a_runner_whose_forward_writes_its_input_between_pieces_returns_eagers_output(how):
    torch.manual_seed(0)
    m = WritesItsInput(how).to(DEVICE)
    r = graphcap.capture(m, "tc_piecewise", buckets=[8],
                         example_inputs=(torch.randn(8, 4, device=DEVICE),))
    assert r.report()["breaks"] == {8: 1}  # captured piece by piece
    for call in range(3):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(call)).to(DEVICE)
        with torch.no_grad():
            want = m(x.clone())
        torch.testing.assert_close(r(x), want)


class WritesAViewOfItsSecondTensor(nn.Module):
    """Writes ``x`` through the view of it that an op of several tensors returns second."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how
        self.lin = nn.Linear(4, 4)

    def forward(self, scale, x):
        if self.how == "broadcast_tensors":  # same shapes: each a view of its tensor
            _, view = torch.broadcast_tensors(scale, x)
        elif self.how == "atleast_1d":  # tensors of a dim or more: each itself
            _, view = torch.atleast_1d(scale, x)
        view.mul_(2)
        return self.lin(x) * scale


@pytest.mark.parametrize("how", ["broadcast_tensors", "atleast_1d"])
def test_a_write_through_the_view_of_another_argument_of_the_op_reaches_the_callers_tensor(
        how):
    torch.manual_seed(0)
    m = WritesAViewOfItsSecondTensor(how).to(DEVICE)
    c = torch.compile(m, backend=PiecewiseCompiler({"capture_sizes": [8]}), fullgraph=True)
    with torch.no_grad():
        for call in range(4):  # warm-up, capture, replays
            g = torch.Generator().manual_seed(call)
            scale, x = (torch.randn(8, 4, generator=g).to(DEVICE) for _ in range(2))
            x_eager = x.clone()
            torch.testing.assert_close(c(scale, x), m(scale, x_eager),
                                       msg=lambda s, n=call: f"{n}: {s}")
            torch.testing.assert_close(x, x_eager, msg=lambda s, n=call: f"{n}: x: {s}")
