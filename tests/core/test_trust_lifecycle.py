"""A runner's life outside the happy path: a first call that fails, a model whose
parameters are made by its first call, a dtype change, capture_all or recapture asked of
a runner that has nothing to recapture. Each leaves the runner usable and its replays
equal to eager. On the emulator in CI and on CUDA graphs on the GPU."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.errors import BadBatch, CaptureError, ModelChanged, UnsupportedStrategy
from graphcap.models import MLP, build_model
from graphcap.piecewise import counters
from tests.support.runner_helpers import DEVICE, batch

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def mlp():
    torch.manual_seed(0)
    return MLP().to(DEVICE)


def rows(n=3, dtype=torch.float32):
    return torch.randn(n, 64, device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("strategy", ("full", "breakable"))
def test_a_first_call_the_model_refuses_leaves_the_runner_to_capture_the_next(strategy):
    m = mlp()
    r = graphcap.capture(m, strategy, buckets=[4, 8])
    with pytest.raises(RuntimeError, match="dtype"):
        r(rows(dtype=torch.float64))  # the model's own error, raised as eager raises it
    x = rows()
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))
    assert r.report()["replays"][4] >= 1


@pytest.mark.parametrize("strategy", ("full", "breakable"))
def test_parameters_made_by_the_first_call_are_captured_after_it(strategy):
    class Lazy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.LazyLinear(8)

        def forward(self, x):
            return self.lin(x)

    torch.manual_seed(0)
    m = Lazy().to(DEVICE)
    r = graphcap.capture(m, strategy, buckets=[4, 8])
    x = torch.randn(3, 16, device=DEVICE)
    out = r(x)
    with torch.no_grad():
        torch.testing.assert_close(out, m(x))
        torch.testing.assert_close(r(x * 2), m(x * 2))
    assert r.report()["replays"][4] >= 1


def test_a_model_cast_to_another_dtype_is_recaptured_and_old_inputs_are_refused():
    m = mlp()
    r = graphcap.capture(m, "full", buckets=[4, 8], example_inputs=(rows(4),))
    x = rows()
    r(x)
    m.double()
    with torch.no_grad():
        want = m(x.double())
    torch.testing.assert_close(r(x.double()), want)
    assert r.report()["recaptures"] == 1
    with pytest.raises(BadBatch, match="dtype torch.float32.*captured torch.float64"):
        r(x)
    torch.testing.assert_close(r(x.double()), want)


def test_a_recapture_that_fails_is_counted_and_the_next_call_captures_the_model_once():
    m = mlp()
    r = graphcap.capture(m, "full", buckets=[4, 8], example_inputs=(rows(4),))
    r(rows())
    m.double()
    with pytest.raises(RuntimeError):  # the model's own error: float32 rows, float64 weights
        r(rows())
    x = rows(dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))
    report = r.report()
    assert report["recaptures"] == 1 and report["failed"] == 1, report


@pytest.mark.parametrize("strategy", ("full", "breakable"))
def test_capture_all_with_an_example_captures_the_dtypes_and_shapes_of_that_example(strategy):
    m = mlp()
    r = graphcap.capture(m, strategy, buckets=[4, 8], example_inputs=(rows(4),),
                         on_change="error")
    m.double()
    with pytest.raises(ModelChanged, match=r"other dtypes now: runner.capture_all\(example\)"):
        r(rows())
    with pytest.raises(RuntimeError) as info:  # the model's own error, on old dtypes
        r.recapture()
    assert "runner.capture_all(example)" in "".join(info.value.__notes__)
    r.capture_all((rows(4, torch.float64),))
    x = rows(dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))
    assert sum(r.stats.replays.values()) == 1
    with pytest.raises(BadBatch, match="must be a tensor"):
        r.capture_all(([1.0] * 64,))  # refused: the capture before stays
    with torch.no_grad():
        torch.testing.assert_close(r(x), m(x))
    assert sum(r.stats.replays.values()) == 2


def test_a_prefill_models_failed_recapture_names_no_capture_all_with_an_example():
    # Prefill inputs are token ids and positions of fixed dtypes, and capture_all of a
    # call's arguments refuses them (seq_lens is a keyword): no note points there.
    m = build_model("tiny", device=DEVICE, dtype=torch.float32)
    r = graphcap.capture(m, "full", buckets=[8], max_requests=2)
    m.forward = lambda *args, **kwargs: 1 / 0
    with pytest.raises(ZeroDivisionError) as info:
        r.recapture()
    assert not getattr(info.value, "__notes__", None)


def test_the_eager_strategy_has_nothing_to_capture_and_says_so():
    r = graphcap.capture(mlp(), "eager")
    for ask in (r.recapture, lambda: r.capture_all((rows(4),))):
        with pytest.raises(UnsupportedStrategy, match="'eager' captures nothing"):
            ask()
    assert r(rows()).shape == (3, 64)


@pytest.mark.parametrize("strategy", ("full", "breakable"))
def test_recapture_before_anything_was_captured_says_what_to_call_first(strategy):
    r = graphcap.capture(mlp(), strategy, buckets=[4, 8])
    with pytest.raises(CaptureError, match="nothing"):
        r.recapture()
    x = rows()
    with torch.no_grad():
        torch.testing.assert_close(r(x), r.model(x))


def test_a_tc_piecewise_recapture_captures_whole_graphs_and_no_piece_graphs():
    m = graphcap.models.build_model("tiny", device=DEVICE)
    r = graphcap.capture(m, "tc_piecewise", buckets=[4, 8], max_requests=2,
                         attention="torch_masked")
    before = dict(counters())
    r.recapture()
    now = counters()
    assert now.get("captures", 0) == before.get("captures", 0)  # no piece graphs
    assert now["whole_captures"] == before["whole_captures"] + 2
    ids, pos = batch([3])
    with torch.inference_mode(), graphcap.packed([3], DEVICE, "torch_masked"):
        want = m(ids, pos)
    torch.testing.assert_close(r(ids, pos, seq_lens=[3]), want)
