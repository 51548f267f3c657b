"""``torch.compile(model, backend="sgl_piecewise")`` on a hostile user's paths: grad mode,
inference mode, threads, a second device, the model's own exceptions; and what dropped
runners of every strategy leave behind (nothing)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
from torch import nn

import graphcap
from graphcap.api import STRATEGIES
from graphcap.piecewise import PiecewiseCompiler, counters
from tests.support.runner_helpers import DEVICE, batch
from tests.support.trust_piecewise import Net, compiled, ids, net, warm

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def test_one_backend_instance_refuses_a_second_device_naming_what_to_do():
    compiler = PiecewiseCompiler({"capture_sizes": [4]})
    lin = nn.Linear(4, 4)
    c = torch.compile(lin, backend=compiler)
    with torch.no_grad():
        c(torch.randn(4, 4))
        lin.to("meta")  # Dynamo compiles again, with the same backend instance
        with pytest.raises(Exception, match="captures its graphs on cpu, and a call on meta"):
            c(torch.randn(4, 4, device="meta"))


def test_under_grad_mode_the_forward_runs_eagerly_and_backward_gives_eagers_gradients():
    m = net()
    c = compiled(m)
    before = counters()
    x = ids(4)
    for _ in range(3):
        out = c(x)
    out.sum().backward()
    got = [p.grad.clone() for p in m.parameters()]
    m.zero_grad()
    m(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(got, m.parameters(), strict=True))
    after = counters()
    assert after["grad_runs"] - before["grad_runs"] == 3
    assert after["captures"] == before["captures"]
    with torch.no_grad():  # a compile of its own, with graphs
        warm(c)
    assert counters()["captures"] > before["captures"]


def test_a_parameter_an_op_returns_as_is_is_no_autograd_history_under_inference_mode():
    class Scaled(Net):  # Gemma's RMSNorm: (1 + weight.float()), weight already float32
        def forward(self, ids):
            return super().forward(ids) * (1.0 + self.norm.weight.float())

    torch.manual_seed(0)
    m = Scaled().to(DEVICE)
    c = compiled(m)
    before = counters()
    with torch.inference_mode():
        warm(c)
        got = c(ids(4, 7))
    after = counters()
    assert after["grad_runs"] == before["grad_runs"]
    assert after["captures"] > before["captures"]
    with torch.no_grad():
        torch.testing.assert_close(got, m(ids(4, 7)))


def test_a_compiled_model_called_from_several_threads_gives_eager_results():
    m = net()
    c = compiled(m)
    xs = [ids(4 if i % 2 else 8, i) for i in range(32)]
    with torch.no_grad():
        warm(c, 4)
        warm(c, 8)  # a recompile, dynamic: its size 4 is warmed up and captured in threads
        want = [m(x) for x in xs]
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    failures = []

    def work(mine):
        with torch.no_grad():
            for i in mine:
                try:
                    if not torch.allclose(c(xs[i]), want[i], atol=1e-5):
                        failures.append(f"{i}: differs")
                except Exception as exc:  # noqa: BLE001 - collected, asserted below
                    failures.append(f"{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=work, args=(range(k, 32, 4),)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []


def test_an_exception_of_the_models_own_is_raised_as_it_is_not_as_a_tracing_failure():
    class Refuses(nn.Module):
        graphcap_inputs = "prefill"

        def __init__(self):
            super().__init__()
            self.inner = graphcap.models.build_model("tiny", device=DEVICE)

        def forward(self, input_ids, positions):
            if input_ids.shape[0] > 6:
                raise ValueError("inputs longer than 6 tokens are refused")
            return self.inner(input_ids, positions)

    with pytest.raises(ValueError, match="longer than 6"):
        graphcap.capture(Refuses(), "tc_piecewise", buckets=[4, 8], max_requests=2)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_a_dropped_runner_frees_its_graphs_and_pool(strategy):
    m = graphcap.models.build_model("tiny", device=DEVICE)
    keep = graphcap.capture(m, strategy, buckets=[4, 8], max_requests=2,
                            attention="torch_masked")
    i, p = batch([3])
    for _ in range(3):
        r = graphcap.capture(m, strategy, buckets=[4, 8], max_requests=2,
                             attention="torch_masked")
        r(i, p, seq_lens=[3])
        runner, pool = weakref.ref(r), weakref.ref(r.pool)
        del r
        gc.collect()
        assert runner() is None and pool() is None
    with graphcap.packed([3], DEVICE, "torch_masked"):
        torch.testing.assert_close(keep(i, p, seq_lens=[3]), m(i, p))


@pytest.mark.skipif(DEVICE != "cuda", reason="device memory")
def test_dropped_runners_leave_the_device_memory_where_it_was():
    m = graphcap.models.build_model("tiny", device="cuda")
    i, p = batch([3])

    def once():
        r = graphcap.capture(m, "tc_piecewise", buckets=[4, 8], max_requests=2,
                             attention="torch_masked")
        r(i, p, seq_lens=[3])
        del r
        gc.collect()
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved()

    readings = [once() for _ in range(5)]  # the first runner's build leaves some cache
    assert readings[2:] == [readings[1]] * 3 and readings[1] <= readings[0]
