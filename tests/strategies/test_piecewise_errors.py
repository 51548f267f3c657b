"""tc_piecewise: what the compiled forward raises says what went wrong, a call that
raised leaves the backend as if it never ran, and a module the backend compiled is
captured where its graphs can be, refused where they cannot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphcap
from graphcap.errors import CaptureError
from graphcap.piecewise import CompiledForward, PiecewiseCompiler


class RefusesHidden(nn.Module):
    """Raises an error of its own under a keyword option only (paged inputs pass
    ``hidden=True`` so)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, hidden=False):
        if hidden:
            raise ValueError("hidden states need a final norm")
        return self.lin(x)


def test_the_models_own_error_under_a_keyword_option_is_raised_as_it_is():
    forward = CompiledForward(RefusesHidden(), PiecewiseCompiler({"capture_sizes": [8]}))
    with torch.inference_mode(), pytest.raises(ValueError, match="need a final norm"):
        forward(torch.randn(8, 4), hidden=True)


class Gathers(nn.Module):
    """Raises at run time, past tracing: an index past the columns."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, idx):
        return self.lin(x).index_select(1, idx)


def test_a_warm_up_that_raised_leaves_the_size_to_warm_up_on_its_next_call():
    m, compiler = Gathers(), PiecewiseCompiler({"capture_sizes": [8]})
    compiled = torch.compile(m, backend=compiler, fullgraph=True)
    x, good = torch.randn(8, 4), torch.tensor([0, 3])
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="out of"):
            compiled(x, torch.tensor([0, 9]))  # the size's warm-up raises
        torch.testing.assert_close(compiled(x, good), m(x, good))  # its warm-up, eager
        assert compiler.stats["captures"] == 0
        for _ in range(2):  # the capture, then a replay
            torch.testing.assert_close(compiled(x, good), m(x, good))
    assert compiler.stats["captures"] == 1


@pytest.mark.parametrize("strategy", ["full", "breakable"])
@pytest.mark.parametrize("where", ["model", "model.1"])
def test_a_module_compiled_by_the_backend_is_refused_where_a_graph_would_hold_its_graphs(
        strategy, where):
    """Its graphs cannot be captured inside the strategy's: a CaptureError naming the
    module and what to capture instead, not torch's "found no compiled frames"."""
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    compiled = torch.compile(m[1] if where == "model.1" else m, backend="sgl_piecewise",
                             options={"capture_sizes": [4]}, fullgraph=True)
    model = nn.Sequential(m[0], compiled) if where == "model.1" else compiled
    with pytest.raises(CaptureError, match=rf"{where} \(OptimizedModule\) is compiled .*"
                                           rf"graphs do not nest.*{where}._orig_mod"):
        graphcap.capture(model, strategy, buckets=[4], example_inputs=(torch.randn(4, 8),))
    x = torch.randn(3, 8)
    r = graphcap.capture(model, "tc_piecewise", buckets=[4], example_inputs=(x,))
    with torch.inference_mode():
        torch.testing.assert_close(r(x), m(x))


@pytest.mark.parametrize("strategy", ["eager", "tc_piecewise"])
def test_a_prefill_model_compiled_by_the_backend_captures_as_the_refusal_advises(strategy):
    """torch.compile's module forwards ``*args``: the model it compiled is still a prefill
    model (it was refused as one whose forward takes [])."""
    from graphcap.models import Decoder, ModelArgs

    torch.manual_seed(0)
    m = Decoder(ModelArgs(layers=1)).eval()
    compiled = torch.compile(m, backend="sgl_piecewise", options={"capture_sizes": [8]})
    r = graphcap.capture(compiled, strategy, buckets=[8], max_requests=2,
                         attention="torch_masked")
    ids, pos = torch.randint(1, 256, (7,)), torch.cat([torch.arange(4), torch.arange(3)])
    with torch.inference_mode():
        torch.testing.assert_close(r(ids, pos, seq_lens=[4, 3]), m(ids, pos, seq_lens=[4, 3]))
