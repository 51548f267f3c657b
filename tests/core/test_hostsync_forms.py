"""A forward that reads a device value on the host is refused at capture, under every
strategy, in every form Python offers (``int(t)``, ``float(t)``, ``operator.index``,
``range(t)``, ``x[:t]``, ``if t:``, math functions, numpy), wherever the tensor comes from
(an input, a parameter, a buffer; float or integer; 0-d or one element). CUDA capture
refuses each of them; a graph that took one would replay the branch and the value of
capture. The forms on their own are pinned on every graph kind by
tests/core/test_graph_semantics.py; here they go through ``graphcap.capture``, which captures
under ``torch.inference_mode`` (and, under tc_piecewise, through Dynamo)."""

from __future__ import annotations

import math
import operator

import numpy as np
import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.errors import CaptureError
from graphcap.models import PRESETS, Decoder
from graphcap.piecewise.compiler import sgl_piecewise
from tests.support.runner_helpers import DEVICE, batch

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

FORMS = {
    "int(t)": lambda t: int(t),
    "float(t)": lambda t: float(t),
    "operator.index(t)": lambda t: operator.index(t.long()),
    "range(t)": lambda t: len(range(t.long())),
    "x[:t]": lambda t: torch.ones(4, device=t.device)[: t.long()].numel(),
    "if t:": lambda t: 1 if t else -1,
    "math.floor(t)": lambda t: math.floor(t),
    "numpy.asarray(t)": lambda t: np.asarray(t).item(),
}


class Reads(torch.nn.Module):
    """``h * 2`` when the number read from ``source`` on the host is positive, else
    ``h * 3``: a graph that baked the branch of capture would differ from eager."""

    def __init__(self, form: str, source: str):
        super().__init__()
        self.form, self.source = form, source
        self.lin = torch.nn.Linear(8, 8)
        self.scale = torch.nn.Parameter(torch.ones(1), requires_grad=False)  # 1 element
        self.register_buffer("count", torch.tensor(1))  # 0-d, integer

    def forward(self, x):
        t = {"input": x[0, 0], "parameter": self.scale, "buffer": self.count}[self.source]
        h = self.lin(x)
        return h * 2 if FORMS[self.form](t) > 0 else h * 3


def _refused(model, strategy: str) -> CaptureError:
    x = torch.ones(8, 8, device=DEVICE)
    with pytest.raises(CaptureError, match="(?i)host synchronisation|data-dependent") as info:
        graphcap.capture(model, strategy, buckets=[8], example_inputs=(x,))
    with torch.inference_mode():  # the model still runs eagerly, its own way
        torch.testing.assert_close(model(x), model.lin(x) * 2)
    return info.value


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("form", sorted(FORMS))
def test_every_python_read_of_a_buffer_is_refused_at_capture(strategy, form):
    if form.startswith("numpy") and DEVICE != "cpu":
        pytest.skip("numpy reads host memory only: it refuses a CUDA tensor by itself")
    _refused(Reads(form, "buffer").to(DEVICE).eval(), strategy)


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("source", ["input", "parameter", "buffer"])
def test_int_of_an_input_a_parameter_or_a_buffer_is_refused_at_capture(strategy, source):
    _refused(Reads("int(t)", source).to(DEVICE).eval(), strategy)


def test_tc_piecewise_names_the_tensor_dynamo_read_on_the_host():
    err = _refused(Reads("int(t)", "buffer").to(DEVICE).eval(), "tc_piecewise")
    if "data-dependent expression" in str(err):  # a Dynamo that cannot trace the read
        assert "use strategy='breakable'" in str(err), str(err)  # (torch 2.11's)
        return
    assert "_buffers['count'].item()" in str(err), str(err)
    assert str(err).startswith("host synchronisation"), str(err)  # as the backend said it


def test_sgl_piecewise_on_its_own_follows_a_value_dynamo_guards_on():
    # Outside graphcap.capture Dynamo's guards run before every call: a changed value
    # compiles again, so the compiled model keeps matching eager.
    # (A Dynamo that cannot trace the read whole breaks the graph there instead.)
    model = Reads("int(t)", "buffer").to(DEVICE).eval()
    compiled = torch.compile(model, backend=sgl_piecewise, options={"capture_sizes": [8]})
    x = torch.randn(8, 8, device=DEVICE)
    with torch.inference_mode():
        for value in (1, 1, -1, -1, 2):
            model.count.fill_(value)
            torch.testing.assert_close(compiled(x), model(x))


class ReadsPositions(Decoder):
    """The tiny decoder, doubled when the last position (read on the host) is past 4."""

    graphcap_inputs = "prefill"

    def forward(self, input_ids, positions):
        logits = super().forward(input_ids, positions)
        return logits * 2 if int(positions[-1]) > 4 else logits


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_prefill_forward_that_reads_a_position_on_the_host_is_refused_at_capture(strategy):
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = ReadsPositions(PRESETS["tiny"]).eval()
    with pytest.raises(CaptureError, match="(?i)host synchronisation|data-dependent"):
        graphcap.capture(model, strategy, buckets=[8], max_requests=2,
                         attention="torch_masked")
    ids, pos = batch([7])
    with graphcap.packed([7], DEVICE), torch.inference_mode():
        assert model(ids, pos).shape == (7, model.args.vocab_size)  # still runs eagerly


class ItemOfOutput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        return y * y.max().item()  # the line a refusal names


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_refused_host_read_names_the_models_line_under_every_strategy(strategy):
    # Under tc_piecewise the op runs in an interpreted piece, whose stack holds graphcap's
    # frames only: the line comes from the node's trace.
    torch._dynamo.reset()
    r = graphcap.capture(ItemOfOutput().to(DEVICE), strategy, buckets=[4])
    with pytest.raises(CaptureError, match=r"test_hostsync_forms\.py:\d+ `return y \* y\.max"):
        r(torch.randn(3, 8, device=DEVICE))


_CALLS = [0]


@torch.library.custom_op("graphcap_test::refused_at_capture", mutates_args=())
def _refused_at_capture(y: torch.Tensor) -> torch.Tensor:
    _CALLS[0] += 1
    if _CALLS[0] >= 2:  # the capture, after the warm-up: CUDA's own refusal, as CUDA says it
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
    return y * 2


@_refused_at_capture.register_fake
def _(y):
    return torch.empty_like(y)


class CallsARefusedOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return _refused_at_capture(self.lin(x))  # the node's traced line


@pytest.mark.skipif(DEVICE == "cuda", reason="simulates CUDA's refusal on the emulator")
def test_cudas_refusal_in_a_piece_names_the_ops_own_line_before_the_traced_one():
    from graphcap.core.hostsync import translate_cuda_failure

    torch._dynamo.reset()
    _CALLS[0] = 0
    r = graphcap.capture(CallsARefusedOp(), "tc_piecewise", buckets=[4])
    with pytest.raises(RuntimeError) as info:
        r(torch.randn(3, 8))
    assert "`return _refused_at_capture(self.lin(x))" in info.value.graphcap_site
    message = str(translate_cuda_failure(info.value))
    assert "`raise RuntimeError(\"CUDA error" in message, message
    del info.value.__dict__["graphcap_site"]  # what the traceback alone says, past pieces
    assert "test_hostsync_forms.py" in str(translate_cuda_failure(info.value))


class HostScalar(torch.nn.Module):
    """``lin(x) * torch.tensor(2.0)``: a CPU scalar made from Python data in the forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x) * torch.tensor(2.0)


@pytest.mark.parametrize("strategy", ["breakable", "full"])
def test_a_cpu_scalar_made_in_the_forward_is_captured_on_cuda_and_refused_on_the_emulator(
        strategy):
    # On CUDA the scalar is a kernel argument (docs/architecture.md: the emulator cannot
    # tell it from the same data put on the device, which CUDA capture refuses).
    model = HostScalar().to(DEVICE).eval()
    x = torch.randn(8, 8, device=DEVICE)
    if DEVICE == "cpu":
        with pytest.raises(CaptureError, match=r"torch.tensor\(python_data\)"):
            graphcap.capture(model, strategy, buckets=[8], example_inputs=(x,))
        return
    runner = graphcap.capture(model, strategy, buckets=[8], example_inputs=(x,))
    for _ in range(2):
        x = torch.randn(8, 8, device=DEVICE)
        with torch.inference_mode():
            torch.testing.assert_close(runner(x), model(x))
    assert runner.report()["fallbacks"] == {}


def test_host_work_on_host_tensors_is_no_sync_in_a_graph_of_another_device():
    # A CUDA capture records its stream's work: .item(), nonzero, a boolean mask,
    # linspace and normal of CPU tensors run on the host meanwhile. The emulator of
    # another device (meta stands in for CUDA on any machine) agrees; the device's own
    # tensors stay refused, and so does a copy of a host tensor to the device.
    from graphcap.core import new_pool

    pool = new_pool("meta", kind="emulated")
    host, x = torch.arange(8, dtype=torch.float32), torch.zeros(8, device="meta")

    def body(t):
        n = int(host.sum()) + len(torch.nonzero(host > 2)) + len(host[host > 5])
        torch.linspace(host[0], host[1], 8) + torch.normal(host, host.abs() + 1)
        return t + n + torch.tensor([1.0]).item()

    graph = pool.graph()
    y = graph.capture(body, x)
    graph.replay()
    assert y.shape == (8,) and y.device.type == "meta"
    for sync, needle in ((lambda t: t.sum().item(), "Tensor.item"),
                         (lambda t: torch.nonzero(t), "nonzero"),
                         (lambda t: t + host.to("meta"), "a copy between host and device")):
        with pytest.raises(CaptureError, match=needle):
            pool.graph().capture(sync, x)


def test_host_work_in_a_graph_of_another_device_runs_at_capture_only():
    # CUDA records the device's work: host work in the region runs once, at capture, and
    # keeps its writes and its results; no replay runs it again. So does the emulator of
    # another device (meta stands in for CUDA).
    from graphcap.core import new_pool

    pool = new_pool("meta", kind="emulated")
    host, x = torch.zeros(3), torch.zeros(3, device="meta")

    def body(t):
        host.add_(1)
        return t * 2, torch.arange(3.0)

    graph = pool.graph()
    _, made = graph.capture(body, x)
    assert host.tolist() == [1.0, 1.0, 1.0] and made.tolist() == [0.0, 1.0, 2.0]
    graph.replay()
    graph.replay()
    assert host.tolist() == [1.0, 1.0, 1.0] and made.tolist() == [0.0, 1.0, 2.0]
