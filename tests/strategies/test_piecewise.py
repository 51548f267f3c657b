"""tc_piecewise: the sgl_piecewise torch.compile backend (split, compile once, capture
per shape), on its own and under graphcap.capture."""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.metadata
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from torch.utils._python_dispatch import TorchDispatchMode

import graphcap
from graphcap.compat import guards
from graphcap.errors import CaptureError
from graphcap.models import Decoder, ModelArgs
from graphcap.piecewise import PiecewiseCompiler
from graphcap.piecewise import compiler as piecewise_compiler
from graphcap.piecewise.inductor import compile_piece
from graphcap.piecewise.split import split_graph, split_op_names
from graphcap.piecewise.writes import mutated_inputs
from graphcap.testing.strategies import prefill_batches

ROOT = Path(__file__).resolve().parents[2]
SIZES = [8, 16, 32]

_LIB = torch.library.Library("graphcap_test", "FRAGMENT")
_LIB.define("split_a(Tensor x, Tensor(a!) out) -> ()")


def _split_a(x, out):
    out.copy_(x)


_LIB.impl("split_a", _split_a, "CompositeExplicitAutograd")


def decoder(layers: int):
    torch.manual_seed(0)
    return Decoder(ModelArgs(layers=layers)).eval()


def _check_batches(m, r, batches=([5, 3], [16], [20, 9, 3])):
    for lens in batches:  # new sizes and batches: no recompilation
        ids = torch.randint(1, 256, (sum(lens),))
        pos = torch.cat([torch.arange(n) for n in lens])
        with torch.inference_mode():
            want = m(ids, pos, seq_lens=lens)
        torch.testing.assert_close(r(ids, pos, seq_lens=lens), want)


def _captured(layers: int, attention: str):
    m = decoder(layers)
    r = graphcap.capture(m, "tc_piecewise", buckets=SIZES, max_requests=4,
                         attention=attention)
    return m, r, r.model.compiler.stats


@pytest.mark.parametrize("layers", [1, 3])
def test_counters_one_graph_2l_plus_1_pieces_l_plus_1_captured_no_recompile(layers):
    # torch_varlen attention reads host lengths: its split ops run eagerly between the
    # pieces, so every shape is captured piece by piece.
    m, r, stats = _captured(layers, "torch_varlen")
    assert stats["graphs"] == 1
    assert stats["pieces"] == 2 * layers + 1 and stats["split_pieces"] == layers
    assert stats["captured_pieces"] == layers + 1
    assert stats["captures"] == len(SIZES) * (layers + 1)
    assert stats["split_captures"] == 0 and stats["whole_captures"] == 0
    assert r.report()["segments"] == {n: layers + 1 for n in SIZES}
    _check_batches(m, r)
    assert stats["graphs"] == 1


@pytest.mark.parametrize("layers", [1, 3])
def test_a_forward_whose_split_ops_read_static_metadata_is_one_graph_per_shape(layers):
    m, r, stats = _captured(layers, "torch_masked")
    assert stats["graphs"] == 1 and stats["captured_pieces"] == layers + 1  # compiled once
    assert stats["whole_captures"] == len(SIZES)
    assert stats["captures"] == 0 and stats["split_captures"] == 0  # no graph per piece
    rep = r.report()
    assert rep["segments"] == {n: 1 for n in SIZES} and rep["breaks"] == {n: 0 for n in SIZES}
    assert rep["splits_in_graph"] == {n: layers for n in SIZES}
    _check_batches(m, r)
    assert stats["graphs"] == 1
    assert sum(r.stats.replays.values()) == 3


@pytest.mark.parametrize("attention", ["torch_varlen", "torch_masked"])
def test_one_compile_serves_every_bucket_one_token_included(attention):
    # Dynamo specialises a dynamic size on 0 and 1: without
    # graphcap.compat.guards.no_zero_one_specialisation, the first one-token call (a
    # decode step of one request) compiled the forward again.
    m = decoder(2)
    r = graphcap.capture(m, "tc_piecewise", buckets=[1, 2, 8], max_requests=2,
                         attention=attention)
    stats = r.model.compiler.stats
    assert stats["graphs"] == 1
    _check_batches(m, r, batches=([1], [2], [3, 5], [1, 1]))
    assert stats["graphs"] == 1 and r.stats.replays[1] == 1


def test_inductor_pieces_compile_once_after_a_compile_that_specialised_one_token(monkeypatch):
    # A compile without graphcap.compat.guards.no_zero_one_specialisation (a user's own
    # torch.compile(backend="sgl_piecewise")) saves cache entries guarded 2 <= tokens;
    # graphcap's compile must not hit them (it compiled its pieces again at one token).
    def capture(m):
        torch._dynamo.reset()  # each capture compiles, from the compile caches on disk
        return graphcap.capture(m, "tc_piecewise", buckets=[1, 8], max_requests=2,
                                attention="torch_masked", compiler="inductor")

    with monkeypatch.context() as patched:
        patched.setattr(guards, "no_zero_one_specialisation", contextlib.nullcontext)
        assert capture(decoder(1)).model.compiler.stats["graphs"] == 2  # 2 <= tokens, 1
    m = decoder(1)
    r = capture(m)
    assert r.model.compiler.stats["graphs"] == 1
    _check_batches(m, r, batches=([1], [3, 5]))
    assert r.model.compiler.stats["graphs"] == 1


def test_a_fallback_at_a_size_captured_whole_runs_the_pieces_eagerly_and_captures_nothing():
    m = decoder(2)
    r = graphcap.capture(m, "tc_piecewise", buckets=[16], max_requests=2,
                         attention="torch_masked")
    _check_batches(m, r, batches=([9, 7], [1, 2, 13]))  # the second: more requests
    assert r.report()["fallbacks"] == {"too_many_requests": 1} and r.stats.replays[16] == 1
    stats = r.model.compiler.stats
    assert stats["graphs"] == 1 and stats["captures"] == 0  # eager runs capture nothing


def test_split_ops_are_matched_as_packet_and_overload_and_sit_alone_in_order():
    def f(x, out):
        y = x * 2
        torch.ops.graphcap_test.split_a(y, out)      # the packet
        z = out + 1
        torch.ops.graphcap_test.split_a.default(z, out)  # the overload
        return out * 3

    gm = torch.fx.symbolic_trace(f)
    split, pieces = split_graph(gm, split_op_names({"graphcap_test::split_a"}))
    assert [p.is_split for p in pieces] == [False, True, False, True, False]
    x, out = torch.randn(4), torch.zeros(4)
    torch.testing.assert_close(split(x, out.clone()), f(x, out.clone()))


_LIB.define("kept_rows(Tensor x, Tensor keep) -> Tensor")  # as many rows as keep says
_LIB.impl("kept_rows", lambda x, keep: x[keep], "CompositeExplicitAutograd")


@torch.library.register_fake("graphcap_test::kept_rows")
def _kept_rows_fake(x, keep):
    return x.new_empty(torch.library.get_ctx().new_dynamic_size(), *x.shape[1:])


def test_a_split_op_whose_output_size_the_data_decides_splits_and_runs_as_eager():
    class KeepsRows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, keep):
            return torch.ops.graphcap_test.kept_rows(self.lin(x), keep) * 2

    torch.manual_seed(0)
    m = KeepsRows()
    compiler = PiecewiseCompiler({"capture_sizes": [8],
                                  "split_ops": ["graphcap_test::kept_rows"]})
    c = torch.compile(m, backend=compiler, fullgraph=True)
    x = torch.randn(8, 4)
    with torch.no_grad():
        for kept in (3, 3, 3, 5, 8):  # warm-up, capture, replay, then other row counts
            keep = torch.arange(8) < kept
            torch.testing.assert_close(c(x, keep), m(x, keep))
    assert compiler.stats["split_pieces"] == 1


def _gather_rows(x, lengths):  # a host loop over lengths (docs/ops.md's example)
    return torch.cat([x[i, : int(n)] for i, n in enumerate(lengths.tolist())])


if "graphcap_test::gather_rows" not in graphcap.opsdb.REGISTRY:
    graphcap.register_op(
        "graphcap_test::gather_rows", "(Tensor x, Tensor lengths) -> Tensor",
        reference=_gather_rows, capturable=False,
        fake=lambda x, lengths: x.new_empty(torch.library.get_ctx().new_dynamic_size(),
                                            *x.shape[2:]))


def test_an_op_registered_not_capturable_runs_eagerly_between_pieces():
    class GathersRows(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x, lengths):
            return torch.ops.graphcap_test.gather_rows(self.lin(x), lengths) * 2

    torch.manual_seed(0)
    m = GathersRows()
    compiler = PiecewiseCompiler({"capture_sizes": [4]})  # no split_ops: its tag splits
    c = torch.compile(m, backend=compiler, fullgraph=True)
    x = torch.randn(4, 3, 4)
    with torch.no_grad():
        for lengths in ([1, 2, 3, 2], [1, 2, 3, 2], [1, 2, 3, 2], [3, 3, 3, 3], [1, 1, 1, 1]):
            lengths = torch.tensor(lengths)
            torch.testing.assert_close(c(x, lengths), m(x, lengths))
    assert compiler.stats["split_pieces"] == 1


def test_a_conversion_to_another_dtype_is_a_new_tensor_not_a_write_of_the_input():
    # x.float() of a bf16 x is a copy: writing it leaves x alone (nothing to copy back);
    # y.float() of a float y is y itself, and so is a write of it, in every piece.
    def f(x, y, out):
        z = x.float()
        z.add_(1)
        torch.ops.graphcap_test.split_a(z, out)
        w = y.float()
        w.mul_(2)
        return out + w

    seen = []

    def backend(gm, example_inputs):
        _, pieces = split_graph(gm, split_op_names({"graphcap_test::split_a"}))
        for piece in pieces:
            if not piece.is_split:
                names = [n.name for n in piece.module.graph.nodes if n.op == "placeholder"]
                seen.append({names[i] for i in mutated_inputs(piece.module)})
        seen.append({i for i in mutated_inputs(gm)})
        return gm

    x, y = torch.randn(4, dtype=torch.bfloat16), torch.randn(4)
    torch.compile(f, backend=backend, fullgraph=True)(x, y, torch.zeros(4))
    first, second, whole = seen
    assert first == set() and len(second) == 1 and "y" in next(iter(second))
    assert whole == {1, 2}  # y, and out (the split op writes it)


def test_sizes_outside_the_capture_sizes_run_the_pieces_eagerly_and_are_counted(caplog):
    compiler = PiecewiseCompiler({"capture_sizes": [8]})
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    compiled = torch.compile(mlp, backend=compiler, fullgraph=True, dynamic=True)
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for n in (8, 8, 8, 5, 6):
            x = torch.randn(n, 16)
            torch.testing.assert_close(compiled(x), mlp(x))
    assert compiler.stats["captures"] == 1 and compiler.stats["eager_runs"] == 2
    told = [r.getMessage() for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(told) == 1, told  # once per compile, naming the size and the sizes
    assert "a call of size 5" in told[0] and "capture sizes [8]" in told[0]
    assert "(dim 0 of the first tensor argument the forward reads, or" in told[0]


def _ramp(n):  # a forward of no tensor at all (n a constant of the trace)
    return torch.arange(float(n)) * 2


def test_a_forward_of_no_tensor_argument_runs_eagerly_saying_it_has_no_size(caplog):
    compiler = PiecewiseCompiler({"capture_sizes": [4]})
    compiled = torch.compile(_ramp, backend=compiler, fullgraph=True)
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for _ in range(3):
            torch.testing.assert_close(compiled(4), _ramp(4))
    told = [r.getMessage() for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(told) == 1 and "no size to capture" in told[0], told
    assert "size None" not in told[0]


def test_split_ops_the_traced_forward_never_calls_are_told_once(caplog):
    # nn.Linear is traced as torch._C._nn.linear: aten::addmm is never called, and
    # nothing would be split there without a word.
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiler = PiecewiseCompiler({"capture_sizes": [4], "split_ops": ["aten::addmm"]})
    compiled = torch.compile(m, backend=compiler, fullgraph=True)
    x = torch.randn(4, 4)
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for _ in range(3):
            torch.testing.assert_close(compiled(x), m(x))
    told = [r.getMessage() for r in caplog.records if "split_ops" in r.getMessage()]
    assert len(told) == 1 and "'aten::addmm', which the traced forward never calls" in \
        told[0] and "registered ops it calls: none" in told[0], told
    assert compiler.stats["split_pieces"] == 0

def test_a_split_op_called_before_a_graph_break_is_never_told_as_never_called(caplog):
    # Dynamo hands the backend one graph per side of the break, each a compile of its
    # own: the graph after the break (and its recompile for a new size) calls no split op.
    class Broken(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, x):
            out = torch.empty_like(x)
            torch.ops.graphcap_test.split_a(self.a(x), out)
            torch._dynamo.graph_break()
            return self.b(out)

    torch.manual_seed(0)
    m = Broken()
    compiled = torch.compile(m, backend="sgl_piecewise", options={
        "capture_sizes": [4, 8], "split_ops": ["graphcap_test::split_a"]})
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for n in (4, 8, 4, 8):
            x = torch.randn(n, 4)
            torch.testing.assert_close(compiled(x), m(x))
    told = [r.getMessage() for r in caplog.records if "never calls" in r.getMessage()]
    assert told == []


class RopeTable(torch.nn.Module):
    """A plain tensor attribute (gpt-fast's ``freqs_cis``), read before the tokens."""

    def __init__(self):
        super().__init__()
        self.table = torch.randn(64, 8)
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, pos):
        return self.lin(self.table[pos] + x)


class DecodeStep(torch.nn.Module):
    """One decode step writing a K/V cache its caller owns (64 rows)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x, pos, cache):
        cache[pos] = self.lin(x)
        return self.lin(x) * 2 + cache.sum(0)


@pytest.mark.parametrize("model, dynamic, sizes", [
    (RopeTable, None, [4, 4, 4, 4]),
    (DecodeStep, True, [1, 1, 1, 1]),  # one token: Dynamo specialises it, not the cache
    (DecodeStep, True, [4, 4, 4, 4])])
def test_the_size_is_dim_0_of_the_callers_tensor_not_of_an_attribute_or_a_cache(
        model, dynamic, sizes, caplog):
    torch.manual_seed(0)
    m = model()
    compiler = PiecewiseCompiler({"capture_sizes": [1, 4]})
    compiled = torch.compile(m, backend=compiler, fullgraph=True, dynamic=dynamic)
    cache, twin = torch.zeros(64, 8), torch.zeros(64, 8)
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for k, n in enumerate(sizes):
            x, pos = torch.randn(n, 8), torch.arange(n) + k * n
            extra = ((cache,), (twin,)) if model is DecodeStep else ((), ())
            torch.testing.assert_close(compiled(x, pos, *extra[0]), m(x, pos, *extra[1]))
            torch.testing.assert_close(cache, twin)
    assert "size 64" not in caplog.text
    assert compiler.stats["eager_runs"] == 0 and compiler.stats["captures"] == 1


def test_a_one_token_shape_of_a_per_request_model_replays_its_pieces_under_a_runner():
    # At one token Dynamo compiles the token count static, and the request rows of the
    # last-token logits (3 slots) were the graph's first dynamic size: the pieces of the
    # one-token shape waited for a size 3 and ran eagerly at every replay.
    last = graphcap.models.build_model("tiny", logits="last")
    every = graphcap.models.build_model("tiny")
    r = graphcap.capture(last, "tc_piecewise", buckets=[1, 2, 4], max_requests=3,
                         attention="torch_varlen")
    for lens in ([1], [1, 1], [2, 2], [1]):
        ids = torch.randint(1, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
        pos = torch.cat([torch.arange(n) for n in lens])
        ends = torch.tensor(lens).cumsum(0) - 1
        torch.testing.assert_close(r(ids, pos, seq_lens=lens),
                                   every(ids, pos, seq_lens=lens)[ends])
    assert r.report()["segments"] == {1: 3, 2: 3, 4: 3}
    assert not r.model.compiler.stats["eager_runs"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_transformers_model_compiled_as_transformers_calls_it_runs_and_says_why_not_graphs(
        caplog, device):
    """[batch, tokens] ids, lengths changing so Dynamo recompiles with a dynamic token
    count: the piece whose code copies host values to the device (transformers' mask and
    position set-up) cannot be captured; it runs eagerly, said once, and every call is
    the model's own result (on the emulator, and on CUDA graphs, where the failed capture
    must leave the stream usable)."""
    pytest.importorskip("transformers")
    from tests.support.hf_families import hf_model

    model = hf_model("llama").eval().to(device)
    compiler = PiecewiseCompiler()
    compiled = torch.compile(model, backend=compiler)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode(), caplog.at_level("WARNING", "graphcap"):
        for batch, tokens in ((1, 5), (1, 7), (1, 16), (1, 16), (1, 16), (2, 8), (4, 16),
                              (4, 16), (4, 16)):
            ids = torch.randint(0, 128, (batch, tokens), generator=gen).to(device)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits,
                                       atol=1e-4, rtol=1e-4)
    told = [r.getMessage() for r in caplog.records if "ran eagerly" in r.getMessage()]
    assert len(told) == 2, told  # a size outside the capture sizes; a piece not capturable
    assert "a call of size 1" in told[0] and "cannot be captured" in told[1]
    assert compiler.stats["eager_runs"] > 0


def test_options_are_checked():
    with pytest.raises(graphcap.GraphcapError, match="unknown options"):
        PiecewiseCompiler({"capture_size": [8]})
    with pytest.raises(graphcap.GraphcapError, match="compiler"):
        PiecewiseCompiler({"compiler": "tvm"})


@pytest.mark.parametrize("options, needle", [
    ({"split_ops": "graphcap_test::split_a"}, "give a list of op names"),  # not its letters
    ({"split_ops": ["graphcap_test::no_such_op"]}, "'graphcap_test::no_such_op', which is no"),
    ({"split_ops": ["attention"]}, "'attention', which is no registered op"),
    ({"copy_outputs": "no"}, "copy_outputs='no'; give True or False"),
    ({"pool": "mine"}, "pool='mine' is no graphcap GraphPool"),
    ({"capture_sizes": []}, "capture_sizes must be a non-empty list"),  # not the default
    ({"capture_sizes": [4], "max_tokens": 64}, "capture_sizes or max_tokens, not both"),
    ({"capture_sizes": [4.0]}, "sgl_piecewise: capture_sizes: every capture size must be an "
                               "integer, got 4.0"),
    ({"max_tokens": 64.0}, "sgl_piecewise: max_tokens must be an integer, got 64.0"),
    ({"max_tokens": 0}, "sgl_piecewise: max_tokens must be >= 1, got 0"),
    ({"max_tokens": 2**20}, "at most 528384 tokens): give capture_sizes with the sizes")])
def test_an_option_of_the_wrong_kind_is_refused_naming_it(options, needle):
    with pytest.raises((graphcap.GraphcapError, ValueError), match=re.escape(needle)):
        PiecewiseCompiler(options)


def test_split_ops_may_name_a_registered_op_in_a_list():
    compiler = PiecewiseCompiler({"split_ops": ("graphcap_test::split_a",)})
    assert "graphcap_test::split_a" in compiler.split_names


def test_a_forward_dynamo_cannot_trace_whole_fails_naming_the_cause_and_breakable():
    class DataDependent(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # Python control flow on data
                return x * 2
            return x

    with pytest.raises(CaptureError, match="breakable"):
        graphcap.capture(DataDependent(), "tc_piecewise", buckets=[8],
                         example_inputs=(torch.randn(8, 4),))


@pytest.mark.parametrize("fake", ["given", "derived"])
def test_a_user_op_traces_under_fullgraph_with_a_given_or_derived_fake(fake):
    name = f"graphcap_test::scaled_{fake}"
    if name not in graphcap.opsdb.REGISTRY:
        graphcap.register_op(name, "(Tensor x, float alpha) -> Tensor",
                             reference=lambda x, alpha: x * alpha,
                             fake=(lambda x, alpha: torch.empty_like(x)) if fake == "given"
                             else None)
    op = getattr(torch.ops.graphcap_test, f"scaled_{fake}")

    class UsesOp(torch.nn.Module):
        def forward(self, x):
            return op(x + 1, 2.0) - 1

    m = UsesOp()
    r = graphcap.capture(m, "tc_piecewise", buckets=[4, 8], example_inputs=(torch.randn(8, 3),))
    for n in (3, 8):
        x = torch.randn(n, 3)
        torch.testing.assert_close(r(x), m(x))


@functools.cache
def inductor_runner():
    """A 2-layer decoder and its runner with Inductor pieces (compiled once per session)."""
    m = decoder(2)
    return m, graphcap.capture(m, "tc_piecewise", buckets=[4, 8, 16], max_requests=3,
                               attention="torch_masked", compiler="inductor")


@settings(max_examples=12, deadline=None)
@given(batch=prefill_batches(24, 3, vocab=256))  # up to 24 tokens: past the top bucket too
def test_inductor_pieces_match_eager(batch):
    # Replays (fused_add_rms_norm and rotary write intermediates and the residual in
    # place), padded replays, and eager runs of the compiled pieces past the top bucket.
    m, r = inductor_runner()
    ids, pos, lens = batch
    with torch.inference_mode():
        want = m(ids, pos, seq_lens=lens)
    torch.testing.assert_close(r(ids, pos, seq_lens=lens), want, atol=1e-4, rtol=1e-4)


def _made_from_the_size(x, first, second):
    torch.ops.graphcap_test.split_a(x, first)
    ramp = torch.arange(x.shape[0], dtype=x.dtype)[:, None].expand(-1, x.shape[1]) * 2.0
    torch.ops.graphcap_test.split_a(ramp, second)  # the piece before it: no tensor input
    return first + second


@pytest.mark.parametrize("compiler", ["eager", "inductor"])
def test_a_piece_of_no_tensor_input_is_captured(compiler):
    # The CPU emulator runs an Inductor piece as one op, which the dispatcher routes by
    # its tensors: one of none raised NotImplementedError ("no tensor arguments").
    options = {"capture_sizes": [4], "compiler": compiler, "split_ops": ["graphcap_test::split_a"]}
    compiled = torch.compile(_made_from_the_size, backend=PiecewiseCompiler(options),
                             fullgraph=True, dynamic=True)
    with torch.inference_mode():
        for seed in range(4):
            x = torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))
            got = compiled(x, torch.zeros(4, 3), torch.zeros(4, 3))
            torch.testing.assert_close(got, _made_from_the_size(x, torch.zeros(4, 3),
                                                                torch.zeros(4, 3)))


def test_inductor_pieces_run_fused_kernels_not_the_traced_ops(monkeypatch):
    # The ops a piece dispatches when it runs: Inductor fuses the ReLU into its own kernel;
    # a piece left uncompiled (or compiled as the frames it calls) would dispatch it.
    dispatched = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            dispatched.add(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    def recording(module):
        fn = compile_piece(module)

        def run(*args):
            with Record():
                return fn(*args)
        return run

    monkeypatch.setattr(piecewise_compiler, "compile_piece", recording)
    compiler = PiecewiseCompiler({"capture_sizes": [8], "compiler": "inductor"})
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16))
    compiled = torch.compile(mlp, backend=compiler, fullgraph=True, dynamic=True)
    x = torch.randn(5, 16)
    with torch.inference_mode():
        torch.testing.assert_close(compiled(x), mlp(x))
    assert dispatched and torch.ops.aten.relu not in dispatched


def test_a_piece_that_fails_to_compile_raises_capture_error_naming_compiler_and_cause(
        monkeypatch):
    def failing(module):
        raise KeyError("buf1")

    monkeypatch.setattr(piecewise_compiler, "compile_piece", failing)
    with pytest.raises(CaptureError, match=r"compiler='inductor': KeyError: 'buf1'"):
        graphcap.capture(decoder(1), "tc_piecewise", buckets=[8], max_requests=1,
                         attention="torch_masked", compiler="inductor")


@pytest.mark.slow
def test_the_backend_name_works_in_a_fresh_process_that_never_imports_graphcap():
    eps = importlib.metadata.entry_points(group="torch_dynamo_backends")
    if "sgl_piecewise" not in {e.name for e in eps}:
        pytest.skip("graphcap is not installed as a distribution here (run from the tree)")
    code = textwrap.dedent("""
        import sys, torch
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        f = torch.compile(m, backend="sgl_piecewise", options={"capture_sizes": [4]})
        with torch.inference_mode():
            for _ in range(3):
                x = torch.randn(4, 8)
                torch.testing.assert_close(f(x), m(x))
        assert "graphcap" in sys.modules  # loaded through the entry point only
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def test_many_runners_of_one_model_do_not_exhaust_dynamos_recompile_limit():
    m = decoder(1)
    ids, pos = torch.randint(1, 256, (6,)), torch.arange(6)
    with torch.inference_mode():
        want = m(ids, pos, seq_lens=[6])
    with torch._dynamo.config.patch(recompile_limit=8):
        for _ in range(10):
            r = graphcap.capture(m, "tc_piecewise", buckets=[8], max_requests=1,
                                 attention="torch_masked")
            torch.testing.assert_close(r(ids, pos, seq_lens=[6]), want)


@pytest.mark.parametrize("attention", ["torch_masked", "torch_varlen"])
def test_split_ops_replay_as_graphs_only_while_their_captured_metadata_is_current(attention):
    # A user's own loop: torch.compile with sgl_piecewise, new metadata every call. A split
    # op captured as a graph reads the buffers of the metadata it was captured with, so a
    # call under another metadata object must run it eagerly (torch_varlen: always eager).
    from graphcap.core.context import forward_context
    from graphcap.opsdb.attention import get_backend

    m = decoder(2)
    compiler = PiecewiseCompiler({"capture_sizes": [16]})
    compiled = torch.compile(m, backend=compiler, fullgraph=True)
    backend = get_backend(attention, "cpu")
    for lens in ([16], [16], [9, 7], [1, 15], [16]):  # warm-up, capture, then new batches
        ids = torch.randint(1, 256, (16,), generator=torch.Generator().manual_seed(len(lens)))
        pos = torch.cat([torch.arange(n) for n in lens])
        meta = backend.prepare(lens, "cpu", num_tokens=16)
        torch._dynamo.mark_dynamic(ids, 0)
        torch._dynamo.mark_dynamic(pos, 0)
        with torch.inference_mode(), forward_context(attention=meta):
            got = compiled(ids, pos)
            want = m(ids, pos, seq_lens=lens)
        torch.testing.assert_close(got, want, msg=lambda msg, b=lens: f"{b}: {msg}")
    graphs = 2 if attention == "torch_masked" else 0
    assert compiler.stats["split_captures"] == graphs


def test_models_with_different_float_attributes_compile_in_one_process():
    # One shared code name let Dynamo's automatic-dynamic record turn the second model's
    # norm eps into a dynamic value, which the ops' float arguments refuse.
    for eps in (1e-5, 1e-6, 1e-4):
        torch.manual_seed(0)
        m = Decoder(ModelArgs(layers=1, eps=eps)).eval()
        r = graphcap.capture(m, "tc_piecewise", buckets=[8], max_requests=1,
                             attention="torch_masked")
        _check_batches(m, r, batches=([8], [5]))


def test_a_shape_captured_whole_keeps_none_of_its_warmup_outputs():
    # Only where the outputs go is kept: a warm-up's logits for every token of every
    # shape would otherwise live as long as the runner.
    _, r, _ = _captured(1, "torch_masked")
    for entry in r.entries.values():
        call = entry.replay.__self__.call
        assert call.outputs is None
        assert not any(isinstance(c, torch.Tensor) for c in call.returns[1])


def _compiled_tiny(**compile_kwargs):
    """The tiny decoder compiled by the backend as torch.compile hands it ``mode=`` and
    ``options=``, called three times at 8 tokens (warm-up, capture, replay)."""
    model = graphcap.models.build_model("tiny")
    compiled = torch.compile(model, backend=piecewise_compiler.sgl_piecewise, fullgraph=True,
                             **compile_kwargs)
    before = piecewise_compiler.counters()
    with torch.inference_mode():
        for seed in range(3):
            ids = torch.randint(1, 256, (8,), generator=torch.Generator().manual_seed(seed))
            pos = torch.arange(8)
            with graphcap.packed([8], "cpu"):
                got, want = compiled(ids, pos), model(ids, pos)
            torch.testing.assert_close(got, want)
    after = piecewise_compiler.counters()
    return {k: after[k] - before[k] for k in ("graphs", "captures", "split_captures")}


def test_torch_compile_mode_reduce_overhead_is_accepted_and_ignored_with_a_warning(caplog):
    with caplog.at_level("WARNING", logger="graphcap"):
        counts = _compiled_tiny(mode="reduce-overhead")
    assert counts["graphs"] == 1 and counts["captures"] > 0  # the backend's own graphs
    warned = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert "mode='reduce-overhead'" in warned[0] and "capture_sizes" in warned[0]


def test_inductor_option_keys_are_ignored_with_a_warning_and_the_backend_s_own_kept(caplog):
    with caplog.at_level("WARNING", logger="graphcap"):
        counts = _compiled_tiny(options={"capture_sizes": [4], "max_autotune": True,
                                         "triton.cudagraphs": True})
    assert counts["captures"] == 0 and counts["split_captures"] == 0  # 8 is not captured
    warned = [r.getMessage() for r in caplog.records if "ignores" in r.getMessage()]
    assert len(warned) == 1 and "'max_autotune'" in warned[0] \
        and "'triton.cudagraphs'" in warned[0], caplog.text


def test_an_option_neither_inductor_s_nor_the_backend_s_is_an_error_naming_both():
    with pytest.raises(graphcap.GraphcapError, match="unknown options.*capture_size"):
        piecewise_compiler.sgl_piecewise(None, [], options={"capture_size": [8]})
    with pytest.raises(graphcap.GraphcapError, match="mode='fast'.*reduce-overhead"):
        piecewise_compiler.sgl_piecewise(None, [], mode="fast")


def test_a_compile_that_is_gone_still_counts_so_two_readings_always_compare():
    compile_ = PiecewiseCompiler()
    before = piecewise_compiler.counters()["graphs"]
    compile_.stats["graphs"] += 3
    del compile_
    gc.collect()
    assert piecewise_compiler.counters()["graphs"] == before + 3


class Counts(torch.nn.Linear):
    """Reads a Python counter it bumps every call: Dynamo compiles it again each time."""

    calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * (1 + 1e-6 * self.calls)


def test_python_state_that_changes_every_call_is_a_capture_error_naming_it():
    with torch._dynamo.config.patch(recompile_limit=8), \
            pytest.raises(CaptureError, match="compiled the forward again at every "
                                              "call until Dynamo's recompile limit"):
        r = graphcap.capture(Counts(4, 4), "tc_piecewise", buckets=list(range(1, 11)),
                             example_inputs=(torch.randn(4, 4),))
        for n in range(1, 12):
            r(torch.randn(n, 4))


class BuildsPerSize(torch.nn.Module):
    """Rebuilds a buffer for each new token count: its Python reads the size."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("ramp", None)

    def forward(self, x):
        if self.ramp is None or self.ramp.shape[0] != x.shape[0]:
            self.ramp = torch.arange(x.shape[0], dtype=x.dtype)[:, None] * 0.01
        return self.lin(x) + self.ramp


def test_a_forward_specialising_on_the_token_count_is_a_capture_error_naming_the_others():
    with pytest.raises(CaptureError, match="pins it to a constant.*'breakable' or 'full'"):
        graphcap.capture(BuildsPerSize(), "tc_piecewise", buckets=[4, 8])(torch.randn(5, 8))
    for strategy in ("breakable", "full"):
        m = BuildsPerSize()
        x = torch.randn(5, 8)
        got = graphcap.capture(m, strategy, buckets=[4, 8])(x)
        with torch.no_grad():
            torch.testing.assert_close(got, m(x))
