"""Programmatic dependent launch (PDL): where the project's Triton kernels use it, how it
is switched off, and, on the GPU, that kernels launched with it give the same bits as
without it, eagerly and replayed from a CUDA graph, in a chain where each kernel reads
the one before it (a kernel that skipped its wait would read stale or half-written
rows). That the kernels carry the wait and the release in their code is checked on the
CPU by compiling them for sm_90 (test_triton_compiles_for_sm90.py)."""

from __future__ import annotations

import pytest
import torch

import graphcap
from graphcap.models import build_model
from graphcap.opsdb.triton import attention, common, linear, norm, qkv
from tests.conftest import requires_cuda


def test_no_pdl_off_cuda_or_under_the_interpreter(environ):
    environ.unset("GRAPHCAP_PDL")  # off for the right reason
    assert not common.pdl(torch.device("cpu"))
    assert common.pdl_args(torch.device("cpu"), 16, "gemv") == {"PDL": False}
    environ.set("TRITON_INTERPRET", "1")
    assert not common.pdl(torch.device("cuda", 0))  # decided before any device query


def test_switched_off_by_the_environment_or_a_block(monkeypatch, environ):
    monkeypatch.setattr(common, "_PDL_IN_TRITON", True)
    monkeypatch.setattr(common, "_SM90", {0: True})
    environ.unset("TRITON_INTERPRET")
    environ.unset("GRAPHCAP_PDL")
    cuda = torch.device("cuda", 0)
    assert common.pdl(cuda)
    with common.programmatic_launch(False):
        assert not common.pdl(cuda)
        with common.programmatic_launch(True):
            assert common.pdl(cuda)
        assert not common.pdl(cuda)
    assert common.pdl(cuda)
    # Only launches over few rows: past them it was measured slower.
    on = {"PDL": True, "launch_pdl": True}
    assert common.pdl_args(cuda, common.PDL_MAX_ROWS, "gemv") == on
    assert common.pdl_args(cuda, common.PDL_MAX_ROWS + 1, "gemv") == {"PDL": False}
    # A block may leave some kernels out, by name; nested blocks restore what they found.
    with common.programmatic_launch(without=("decode_attention", "gemv")):
        assert common.pdl_args(cuda, 1, "gemv") == {"PDL": False}
        assert common.pdl_args(cuda, 1, "decode_attention") == {"PDL": False}
        assert common.pdl_args(cuda, 1, "skinny_linear") == on
        with common.programmatic_launch(True):
            assert common.pdl_args(cuda, 1, "gemv") == on
        assert common.pdl_args(cuda, 1, "gemv") == {"PDL": False}
    assert common.pdl_args(cuda, 1, "gemv") == on
    with pytest.raises(ValueError, match="kernel names of"):
        common.programmatic_launch(without=("gemm",))
    with pytest.raises(ValueError, match="kernel names of"):
        common.programmatic_launch(without="gemv")  # a string is no list of names
    for off in ("0", "false", "OFF", "no"):
        environ.set("GRAPHCAP_PDL", off)
        assert not common.pdl(cuda)
    with common.programmatic_launch(True):  # a block outranks the environment
        assert common.pdl(cuda)
    monkeypatch.setattr(common, "_SM90", {0: False})  # sm80: never
    with common.programmatic_launch(True):
        assert not common.pdl(cuda)


def _chain(x, positions, cu, w):
    """A decoder layer's kernels in order, each reading the last one's output: norm
    (asking L2 for the next weight while it waits, under PDL), q/k/v (plain fused
    linear), q/k norm and rotary, attention, o (residual), norm, gate/up with SwiGLU,
    down (split K, residual)."""
    T = x.shape[0]
    h = norm.rms_norm(x, w["n1"], 1e-6, prefetch=w["qkv"])
    proj = linear.skinny_linear(h, w["qkv"])
    q, k, v = qkv.qkv_norm_rope(proj, positions, w["qn"], w["kn"], w["cache"], 4, 2, 64,
                                1e-6)
    out = torch.empty_like(q)
    attention.attention_varlen(q, k, v, out, cu, T, 64 ** -0.5)
    x = linear.skinny_linear(out.view(T, -1), w["o"], residual=x)
    h = norm.rms_norm(x, w["n2"], 1e-6)
    act = linear.skinny_linear(h, w["gate_up"], swiglu=True)
    return linear.skinny_linear(act, w["down"], residual=x)


def _weights(device, hidden=512, inter=1536):
    g = torch.Generator().manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16).to(device)

    angles = torch.arange(4096)[:, None] * torch.pow(1e4, -torch.arange(32) / 32)
    return {"n1": rnd(hidden) + 1, "n2": rnd(hidden) + 1, "qn": rnd(64) + 1,
            "kn": rnd(64) + 1, "qkv": rnd(512, hidden, scale=hidden ** -0.5),
            "o": rnd(hidden, 256, scale=256 ** -0.5),
            "gate_up": rnd(2 * inter, hidden, scale=hidden ** -0.5),
            "down": rnd(hidden, inter, scale=inter ** -0.5),
            "cache": torch.cat([angles.cos(), angles.sin()], -1).to(device)}


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 7, 16, 64])
def test_a_kernel_chain_gives_the_same_bits_with_and_without_pdl(rows):
    from graphcap.core import new_pool

    device = torch.device("cuda")
    if not common.pdl(device):
        pytest.skip("no PDL on this GPU or Triton")
    w = _weights(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 512, generator=g).to(torch.bfloat16).to(device)
    pos = torch.arange(rows, device=device) + 5
    cu = torch.tensor([0, rows], dtype=torch.int32, device=device)

    def layers():  # four layers deep, so that every kernel follows a PDL kernel
        y = x
        for _ in range(4):
            y = _chain(y, pos, cu, w)
        return y

    with common.programmatic_launch(False):
        want = layers()
    torch.testing.assert_close(layers(), want, atol=0, rtol=0)
    graphs = {}
    for enabled in (True, False):
        pool = new_pool("cuda")
        with common.programmatic_launch(enabled):
            with pool.warmup():
                layers()
            graphs[enabled] = pool.graph()
            outs = graphs[enabled].capture(layers)
        graphs[enabled] = (graphs[enabled], outs)
    for _ in range(3):  # new inputs into the same buffers, replayed outside the blocks
        x.copy_(torch.randn(rows, 512, generator=g).to(torch.bfloat16))
        with common.programmatic_launch(False):
            want = layers()
        for enabled, (graph, out) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            torch.testing.assert_close(out, want, atol=0, rtol=0,
                                       msg=lambda m, e=enabled: f"pdl={e}: {m}")


@pytest.mark.gpu
@requires_cuda
def test_a_full_capture_of_a_decoder_replays_the_same_logits_with_and_without_pdl():
    device = torch.device("cuda")
    if not common.pdl(device):
        pytest.skip("no PDL on this GPU or Triton")
    model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
    runners = {}
    for enabled in (True, False):
        with common.programmatic_launch(enabled):
            runners[enabled] = graphcap.capture(model, "full", buckets=[16, 64, 256],
                                                max_requests=2, attention="triton")
    g = torch.Generator().manual_seed(0)
    for lens in ([16], [9, 7], [40, 24], [200, 3], [12]):
        n = sum(lens)
        ids = torch.randint(1, 1000, (n,), generator=g).to(device)
        pos = torch.cat([torch.arange(k) for k in lens]).to(device)
        on, off = (runners[e](ids, pos, seq_lens=lens) for e in (True, False))
        torch.testing.assert_close(on, off, atol=0, rtol=0, msg=lambda m, s=lens: f"{s}: {m}")
    for runner in runners.values():
        assert sum(runner.report()["replays"].values()) == 5


def test_only_weights_that_fit_l2_are_prefetched():
    # llama3-8b's o and down projections ran slower with their whole weight prefetched.
    assert linear._prefetches(torch.empty(2 * 3072, 1024, dtype=torch.bfloat16))  # 12 MiB
    assert not linear._prefetches(torch.empty(4096, 4096, dtype=torch.bfloat16))  # 32 MiB


def test_the_setting_is_per_thread():
    import threading

    seen = []
    with common.programmatic_launch(False):
        worker = threading.Thread(target=lambda: seen.append(common._pdl_override.get()))
        worker.start()
        worker.join()
        assert common._pdl_override.get() is False
    assert seen == [None] and common._pdl_override.get() is None


def test_every_launch_names_a_kernel_that_a_block_can_leave_out():
    """Each pdl_args call of the project's kernels gives one of PDL_KERNELS, so that
    programmatic_launch(without=...) reaches every kernel by its name."""
    import ast
    from pathlib import Path

    named = set()
    for path in Path(common.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "pdl_args":
                assert len(node.args) == 3 and isinstance(node.args[2], ast.Constant), \
                    f"{path.name}:{node.lineno}: pdl_args(device, rows, 'kernel name')"
                named.add(node.args[2].value)
    assert named == set(common.PDL_KERNELS)
