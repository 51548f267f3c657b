"""graphcap.testing's op checks: ``op_inputs`` draws an op's inputs, and ``check_op`` finds
and shrinks planted kernel bugs (wrong values, undeclared writes, a fake's shape or
strides), checks ops of ``torch.library`` by any of their forms, and refuses what it could
not check."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from graphcap.testing import check_op, op_inputs


@settings(max_examples=10, deadline=None)
@given(args=op_inputs("rms_norm", dtype=torch.float16, max_tokens=5))
def test_op_inputs_follow_the_constraints(args):
    x, w, eps = args
    assert x.dtype == torch.float16 and x.shape[0] <= 5 and w.shape == x.shape[1:]


def test_an_op_without_an_input_strategy_says_how_to_add_one():
    import graphcap.opsdb as opsdb

    if "graphcap_test::no_inputs" not in opsdb.REGISTRY:
        opsdb.register_op("graphcap_test::no_inputs", "(Tensor x) -> Tensor",
                          reference=lambda x: x + 1)
    with pytest.raises(ValueError, match="inputs="):
        op_inputs("graphcap_test::no_inputs")


def test_op_inputs_names_the_keywords_an_op_takes_when_given_one_it_does_not():
    with pytest.raises(TypeError, match=r"rms_norm's input strategy takes no keyword "
                       r"'max_len'.*max_tokens"):
        op_inputs("rms_norm", max_len=5)


def _buggy_double(x):
    out = x * 2
    if x.shape[0] % 16:  # the planted bug: wrong whenever T is not a multiple of 16
        out[-1] += 1
    return out


def test_check_op_finds_and_shrinks_a_kernel_wrong_off_multiples_of_16():
    import graphcap.opsdb as opsdb
    from graphcap.opsdb import Kernel

    def inputs(device, dtype, max_tokens=64):
        from hypothesis import strategies as st

        return st.integers(0, max_tokens).map(
            lambda t: (torch.ones(t, 8, device=device, dtype=dtype),))

    name = "graphcap_test::buggy_double"
    if name not in opsdb.REGISTRY:
        opsdb.register_op(name, "(Tensor x) -> Tensor", reference=lambda x: x * 2,
                          kernels={"buggy": Kernel(_buggy_double, devices=("cpu", "cuda"))},
                          inputs=inputs)
    with pytest.raises(AssertionError) as info:
        check_op(name, kernel="buggy", dtypes=(torch.float32,), examples=50,
                 opcheck=False)
    text = str(info.value)
    assert "graphcap_test::buggy_double[buggy]" in text
    # hypothesis shrinks to the smallest failing token count: one row
    assert "inputs (Tensor(float32, (1, 8)))" in text and "max error 1" in text, text


def _register_once(name, schema, **kw):
    import graphcap.opsdb as opsdb

    if name not in opsdb.REGISTRY:
        opsdb.register_op(name, schema, **kw)
    return name


def _rows(device, dtype, max_tokens=16):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t, h = d(st.integers(0, max_tokens)), d(st.sampled_from([1, 3, 8]))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        return (torch.randn(t, h, generator=gen).to(device, dtype),)

    return draw()


def _zeros(device, dtype):
    from hypothesis import strategies as st

    return st.integers(1, 8).map(lambda n: (torch.zeros(n, 4, device=device, dtype=dtype),))


def _negates_in_place(x):
    x.neg_()  # 0.0 becomes -0.0: equal in value, another bit pattern in memory
    return x * 2


def test_check_op_compares_an_undeclared_argument_bit_for_bit():
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::signs", "(Tensor x) -> Tensor", reference=lambda x: x * 6,
        kernels={"signs": Kernel(_negates_in_place, devices=("cpu", "cuda"))},
        inputs=_zeros)
    with pytest.raises(AssertionError, match="does not declare written"):
        check_op(name, dtypes=(torch.float32,), examples=3, opcheck=False)


def test_check_op_fails_on_a_fake_that_returns_the_wrong_shape():
    # Right on the minimal example (a 1 x 1 or empty input), wrong on any other.
    name = _register_once("graphcap_test::bad_fake", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, fake=lambda x: x.new_empty(x.shape[::-1]),
                          inputs=_rows)
    with pytest.raises(AssertionError, match="its fake returns"):
        check_op(name, dtypes=(torch.float32,), examples=10, opcheck=False)


def _scales_in_place(x):
    x.mul_(3)  # writes its input, which the schema below does not declare
    return x * 2


def test_check_op_fails_on_a_kernel_that_writes_an_undeclared_argument():
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::sneaky", "(Tensor x) -> Tensor", reference=lambda x: x * 6,
        kernels={"sneaky": Kernel(_scales_in_place, devices=("cpu", "cuda"))}, inputs=_rows)
    with pytest.raises(AssertionError, match="does not declare written"):
        check_op(name, kernel="sneaky", dtypes=(torch.float32,), examples=10, opcheck=False)


def _column_major_double(x):
    return (x * 2).t().contiguous().t()  # the right values, column-major


def test_check_op_fails_on_a_kernel_or_fake_whose_strides_are_not_the_references():
    # Inductor asserts the strides the fake gave (assert_size_stride), so a kernel that
    # returns the right values column-major fails a compiled model: check_op says so.
    from graphcap.opsdb import Kernel

    name = _register_once(
        "graphcap_test::column_major", "(Tensor x) -> Tensor", reference=lambda x: x * 2,
        kernels={"colmajor": Kernel(_column_major_double, devices=("cpu", "cuda"))},
        inputs=_rows)
    with pytest.raises(AssertionError, match=r"strides \(1, "):
        check_op(name, kernel="colmajor", dtypes=(torch.float32,), examples=10,
                 opcheck=False)
    name = _register_once(
        "graphcap_test::column_major_fake", "(Tensor x) -> Tensor",
        reference=lambda x: x * 2, fake=lambda x: x.new_empty(x.shape[::-1]).t(),
        inputs=_rows)
    with pytest.raises(AssertionError, match="its fake returns"):
        check_op(name, dtypes=(torch.float32,), examples=10, opcheck=False)


def _rows_nan_when_long(device, dtype):
    """Rows of 2 to 8 tokens; from 6 tokens on (the largest examples) one value NaN."""
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t = d(st.integers(2, 8))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        x = torch.randn(t, 4, generator=gen)
        if t >= 6:
            x[-1, -1] = float("nan")
        return (x.to(device, dtype),)

    return draw()


def test_opcheck_prefers_examples_whose_outputs_hold_no_nan():
    # opcheck compares the traced op's outputs with eager's by assert_close, NaN unequal
    # to NaN: an op that passes NaN on (moe_topk_softmax on a NaN logit) must not fail
    # check_op for it when finite examples were drawn too.
    name = _register_once("graphcap_test::nan_through", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, inputs=_rows_nan_when_long)
    report = check_op(name, kernel="torch", dtypes=(torch.float32,), examples=20)
    assert report.opchecked == 3


def test_opcheck_runs_on_several_non_degenerate_examples():
    calls = []
    import graphcap.testing.ops as ops

    real = torch.library.opcheck
    try:
        torch.library.opcheck = lambda op, args, **kw: calls.append(args) or real(op, args, **kw)
        report = ops.check_op("rms_norm", kernel="torch", dtypes=(torch.float32,),
                              examples=12)
    finally:
        torch.library.opcheck = real
    assert report.opchecked == 3 == len(calls)
    assert all(min(args[0].shape) >= 2 for args in calls)


def test_check_op_says_which_kernels_it_compared_and_which_it_skipped_and_why():
    report = check_op("rms_norm", device="cpu", dtypes=(torch.float16,), examples=3,
                      opcheck=False)
    assert "flashinfer" in report.skipped and "cuda" in report.skipped["flashinfer"]
    text = str(report)
    assert "skipped flashinfer" in text and "3 examples" in text
    if report.get("triton") is not None:  # the interpreter (TRITON_INTERPRET=1)
        assert "compared triton" in text


@torch.library.custom_op("graphcap_test::shifted_square", mutates_args=())
def shifted_square(x: torch.Tensor, shift: float) -> torch.Tensor:
    return (x + shift) ** 2


@shifted_square.register_fake
def _(x, shift):
    return torch.empty_like(x)


@torch.library.custom_op("graphcap_test::wrong_square", mutates_args=())
def wrong_square(x: torch.Tensor, shift: float) -> torch.Tensor:
    return (x + shift) ** 2 + (x.shape[0] > 2)  # the planted bug: off by one past 2 rows


@wrong_square.register_fake
def _(x, shift):
    return torch.empty_like(x)


def _square_reference(x, shift):
    return (x + shift) ** 2


def _rows_and_shift(device, dtype):
    from hypothesis import strategies as st

    return st.tuples(_rows(device, dtype), st.sampled_from([0.0, 0.5, -2.0])).map(
        lambda both: (*both[0], both[1]))


@pytest.mark.parametrize("form", ["CustomOpDef", "OpOverloadPacket", "OpOverload", "name"])
def test_check_op_checks_an_op_defined_with_torch_library_custom_op(form):
    op = {"CustomOpDef": shifted_square, "OpOverloadPacket": torch.ops.graphcap_test.shifted_square,
          "OpOverload": torch.ops.graphcap_test.shifted_square.default,
          "name": "graphcap_test::shifted_square"}[form]
    report = check_op(op, reference=_square_reference, inputs=_rows_and_shift,
                      dtypes=(torch.float32,), examples=8, opchecks=1)
    assert report.qualname == "graphcap_test::shifted_square"
    assert report == {"op": 0.0} and report.examples == 8 and report.opchecked == 1


def test_check_op_finds_a_custom_op_that_differs_from_the_reference_given():
    with pytest.raises(AssertionError) as info:
        check_op(wrong_square, reference=_square_reference, inputs=_rows_and_shift,
                 dtypes=(torch.float32,), examples=30, opcheck=False)
    text = str(info.value)
    assert "graphcap_test::wrong_square[op]" in text and "(3, " in text, text  # shrunk: 3 rows


def test_check_op_on_an_op_outside_opsdb_says_it_needs_a_reference_and_inputs():
    with pytest.raises(ValueError, match=r"not registered in opsdb.*reference=.*inputs="):
        check_op(shifted_square, inputs=_rows_and_shift)
    with pytest.raises(ValueError, match="inputs="):
        check_op(shifted_square, reference=_square_reference)


def test_check_op_on_a_name_no_library_defines_says_so():
    with pytest.raises(ValueError, match="'graphcap_test::nowhere' is not in opsdb; no op "
                                         "'graphcap_test::nowhere' in torch.ops"):
        check_op("graphcap_test::nowhere", reference=_square_reference)


def test_check_op_takes_an_opsdb_op_by_its_overload_with_its_registered_reference():
    report = check_op(torch.ops.graphcap.rms_norm.default, kernel="torch",
                      dtypes=(torch.float32,), examples=2, opcheck=False)
    assert report.qualname == "graphcap::rms_norm" and report == {"torch": 0.0}
    with pytest.raises(ValueError, match="registered with; reference= is for ops"):
        check_op(torch.ops.graphcap.rms_norm, reference=lambda x, w, eps: x)


def test_check_op_takes_inputs_for_an_opsdb_op_registered_without_them():
    import graphcap.opsdb as opsdb

    if "graphcap_test::no_inputs" not in opsdb.REGISTRY:
        opsdb.register_op("graphcap_test::no_inputs", "(Tensor x) -> Tensor",
                          reference=lambda x: x + 1)
    report = check_op("graphcap_test::no_inputs", kernel="torch", inputs=_rows,
                      dtypes=(torch.float32,), examples=3, opchecks=1)
    assert report == {"torch": 0.0} and report.opchecked == 1


def test_check_op_refuses_to_check_nothing_or_on_a_gpu_it_does_not_have():
    with pytest.raises(ValueError, match="dtypes is empty"):
        check_op("rms_norm", dtypes=())
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="torch sees no CUDA GPU here"):
            check_op("rms_norm", device="cuda")


def test_check_op_refuses_to_pass_a_kernel_it_was_asked_for_and_never_ran():
    from graphcap.opsdb import Kernel

    name = _register_once("graphcap_test::cuda_only_double", "(Tensor x) -> Tensor",
                          reference=lambda x: x * 2, inputs=_rows,
                          kernels={"mine": Kernel(lambda x: x * 3, devices=("cuda",))})
    with pytest.raises(ValueError, match="kernel 'mine' of .* was not checked: it runs on"):
        check_op(name, kernel="mine", device="cpu", dtypes=(torch.float32,), examples=3,
                 opcheck=False)


def test_check_op_takes_a_fake_right_where_an_optional_written_argument_is_none():
    from hypothesis import strategies as st

    def twice(x, out=None):
        if out is not None:
            out.copy_(x * 2)
        return x * 2

    name = _register_once(
        "graphcap_test::twice_maybe_out", "(Tensor x, Tensor(a!)? out) -> Tensor",
        reference=twice,
        inputs=lambda device, dtype: st.tuples(_rows(device, dtype), st.just(None)).map(
            lambda both: (*both[0], both[1])))
    report = check_op(name, dtypes=(torch.float32,), examples=3, opcheck=False)
    assert report.examples == 3
