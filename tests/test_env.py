"""``graphcap.env``: the variables of other tools read as those tools read them."""

from __future__ import annotations

import pytest
import torch

import graphcap.env


@pytest.mark.parametrize("value", ["1", "true", "True", "on", "yes", "y", "0", "false",
                                   "off", "no", "t", "2", ""])
def test_triton_s_interpreter_is_on_where_triton_reads_it_on(environ, value):
    knobs = pytest.importorskip("triton.knobs")
    environ.set("TRITON_INTERPRET", value)
    assert graphcap.env.settings().triton_interpret == knobs.runtime.interpret, value


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter on CPU tensors")
def test_check_op_compares_the_triton_kernels_under_any_spelling_triton_takes(environ):
    pytest.importorskip("triton")
    from graphcap.testing import check_op

    environ.set("TRITON_INTERPRET", "true")
    report = check_op("rms_norm", device="cpu", dtypes=(torch.float32,), examples=2,
                      opcheck=False)
    assert "triton" in report, str(report)  # not skipped as "runs on cuda tensors"


@pytest.mark.parametrize(("value", "on"), [
    ("1", True), ("true", True), ("On", True), ("yes", True), (" 1 ", True),
    ("0", False), ("false", False), ("", False)])
def test_graphcap_s_debug_flag_takes_the_spellings_its_pdl_flag_takes(environ, value, on):
    """GRAPHCAP_DEBUG_CUDA_GRAPH is on as GRAPHCAP_PDL is off: under any usual spelling."""
    environ.set("GRAPHCAP_DEBUG_CUDA_GRAPH", value)
    assert graphcap.env.settings().debug_cuda_graph is on, value


@pytest.mark.parametrize(("name", "value", "read"), [
    ("GRAPHCAP_PDL", "maybe", "pdl"), ("GRAPHCAP_DEBUG_CUDA_GRAPH", "2", "debug_cuda_graph")])
def test_a_switch_of_another_value_is_told_and_read_as_its_default(environ, name, value,
                                                                    read):
    default = getattr(graphcap.env.Settings(), read)
    with pytest.warns(UserWarning, match=rf"{name}='{value}' is neither on .* nor off .*: "
                                         rf"read as {'on' if default else 'off'}"):
        environ.set(name, value)
    assert getattr(graphcap.env.settings(), read) is default
