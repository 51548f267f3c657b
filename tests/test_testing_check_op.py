"""check_op compares everything an op gives back, on the inputs its strategy gives."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphcap.opsdb as opsdb
from graphcap.opsdb import Kernel
from graphcap.testing import check_op, full_batch, prefill_batches
from graphcap.testing.ops import _clone

CPU = ("cpu", "cuda")


def _register(name, schema, **kw):
    if name not in opsdb.REGISTRY:
        opsdb.register_op(name, schema, **kw)
    return name


def _one(make):
    """A strategy of one-argument tuples from ``make(rows)``, 1 to 4 rows."""
    return lambda device, dtype: st.integers(1, 4).map(lambda t: (make(t, device, dtype),))


def _late_argmax(t, device, dtype):  # the argmax among the columns 100..199
    x = torch.zeros(t, 200, device=device, dtype=dtype)
    x[torch.arange(t), 100 + torch.randint(0, 100, (t,))] = 1
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_integer_outputs_are_compared_exactly_not_within_the_dtype_s_tolerance(dtype):
    # An index of 150 off by one is within bfloat16's relative 2e-2 of it: another row.
    name = _register("graphcap_test::argmax_ids", "(Tensor x) -> Tensor",
                     reference=lambda x: x.float().argmax(-1), inputs=_one(_late_argmax),
                     kernels={"off_by_one": Kernel(lambda x: x.float().argmax(-1) + 1,
                                                   devices=CPU)})
    with pytest.raises(AssertionError, match=r"argmax_ids\[off_by_one\].*output 0"):
        check_op(name, kernel="off_by_one", dtypes=(dtype,), examples=5, opcheck=False)


def _to_bfloat16_toward_zero(x):  # x * 3 rounded to bfloat16 toward zero: an ulp off
    y = x * 3
    b = y.to(torch.bfloat16)
    return torch.where(b.float().abs() > y.abs(), torch.nextafter(b, torch.zeros_like(b)), b)


def test_a_float_output_takes_the_looser_of_the_example_s_and_its_own_tolerance():
    name = _register("graphcap_test::to_bf16", "(Tensor x) -> Tensor",
                     reference=lambda x: (x * 3).to(torch.bfloat16),
                     inputs=_one(lambda t, device, dtype: torch.randn(t, 64, dtype=dtype)),
                     kernels={"trunc": Kernel(_to_bfloat16_toward_zero, devices=CPU)})
    report = check_op(name, kernel="trunc", dtypes=(torch.float32,), examples=5,
                      opcheck=False)
    assert 0 < report["trunc"] < 0.1
    name = _register("graphcap_test::f64_times_two", "(Tensor x) -> Tensor",
                     reference=lambda x: x * 2,
                     inputs=_one(lambda t, device, dtype: torch.randn(t, 64, dtype=dtype)),
                     kernels={"reordered": Kernel(lambda x: x * 0.1 * 20, devices=CPU)})
    report = check_op(name, kernel="reordered", dtypes=(torch.float64,), examples=5,
                      opcheck=False)
    assert report["reordered"] < 1e-12


_VIEWS = {
    "slice": lambda x: x[:, 8:16],  # q of a fused qkv
    "transpose": lambda x: x.t(),
    "expand": lambda x: x[:, :1].expand(-1, 5),
    "step": lambda x: x[::2, ::3],
}


@settings(max_examples=20, deadline=None)
@given(view=st.sampled_from(sorted(_VIEWS)), rows=st.integers(1, 5),
       grad=st.booleans())
def test_each_call_gets_a_copy_of_its_inputs_with_their_strides(view, rows, grad):
    x = _VIEWS[view](torch.randn(rows, 24))
    x.requires_grad_(grad and x.is_leaf)
    (copy,) = _clone((x,))
    assert copy.shape == x.shape and copy.stride() == x.stride() and torch.equal(copy, x)
    assert copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    assert copy.requires_grad == x.requires_grad


def _flat_times_two(q):  # reads q's memory as if q were contiguous
    return (torch.as_strided(q, (q.numel(),), (1,)) * 2).view(q.shape)


def test_a_kernel_that_ignores_its_input_s_strides_fails_on_a_strided_strategy():
    name = _register(
        "graphcap_test::strided_q", "(Tensor q) -> Tensor", reference=lambda q: q * 2,
        inputs=_one(lambda t, device, dtype: torch.randn(t + 1, 24, dtype=dtype)[:, 8:16]),
        kernels={"flat": Kernel(_flat_times_two, devices=CPU)})
    with pytest.raises(AssertionError, match=r"strided_q\[flat\]"):
        check_op(name, kernel="flat", dtypes=(torch.float32,), examples=5, opcheck=False)


def _gather_rows(x, lengths):  # reads lengths on the host: a data-dependent size
    return torch.cat([x[i, : int(n)] for i, n in enumerate(lengths.tolist())])


def _gather_rows_inputs(device, dtype):
    @st.composite
    def draw(d):
        b, t = d(st.integers(1, 3)), d(st.integers(1, 4))
        lengths = torch.tensor([d(st.integers(0, t)) for _ in range(b)], device=device)
        return torch.randn(b, t, 8, dtype=dtype, device=device), lengths

    return draw()


def _dynamic_fake(width, dtype=None):
    def fake(x, lengths):
        n = torch.library.get_ctx().new_dynamic_size()
        return x.new_empty(n, width, dtype=dtype)

    return fake


@pytest.mark.parametrize("label,fake,right", [
    ("right", _dynamic_fake(8), True), ("wide", _dynamic_fake(9), False),
    ("half", _dynamic_fake(8, torch.float16), False)])
def test_a_fake_of_a_data_dependent_size_is_checked_on_the_rest(label, fake, right):
    # docs/ops.md's gather_rows: the fake leaves the row count to the data.
    name = _register(f"graphcap_test::gather_rows_{label}",
                     "(Tensor x, Tensor lengths) -> Tensor", reference=_gather_rows,
                     fake=fake, capturable=False, inputs=_gather_rows_inputs)
    if right:
        report = check_op(name, dtypes=(torch.float32,), examples=5, opchecks=1)
        assert report.examples == 5 and report.opchecked == 1
    else:
        with pytest.raises(AssertionError, match="its fake returns"):
            check_op(name, dtypes=(torch.float32,), examples=5, opcheck=False)


def test_host_values_an_op_returns_are_compared_too():
    name = _register(
        "graphcap_test::with_count", "(Tensor x) -> (Tensor, float)",
        reference=lambda x: (x * 2, float(x.shape[0])),
        fake=lambda x: (torch.empty_like(x), 0.0),
        inputs=_one(lambda t, device, dtype: torch.randn(t, 4, dtype=dtype)),
        kernels={"miscount": Kernel(lambda x: (x * 2, x.shape[0] + 1.0), devices=CPU)})
    with pytest.raises(AssertionError, match=r"output 1 is 2.0, the reference's 1.0"):
        check_op(name, kernel="miscount", dtypes=(torch.float32,), examples=5,
                 opcheck=False)


def _list_inputs(device, dtype):
    return st.integers(1, 3).map(lambda t: (
        torch.randn(t, 4, dtype=dtype), [torch.zeros(t, 4, dtype=dtype) for _ in range(2)]))


def _fill_all(x, outs):
    for out in outs:
        out.copy_(x)


def _scale_in_place(xs):
    for x in xs:
        x.mul_(2)
    return [x.clone() for x in xs]


def test_tensors_in_list_arguments_are_compared_where_written_and_kept_elsewhere():
    name = _register("graphcap_test::fill_all", "(Tensor x, Tensor(a!)[] outs) -> ()",
                     reference=_fill_all, inputs=_list_inputs,
                     kernels={"first_only": Kernel(lambda x, outs: _fill_all(x, outs[:1]),
                                                   devices=CPU)})
    with pytest.raises(AssertionError, match="written argument outs"):
        check_op(name, kernel="first_only", dtypes=(torch.float32,), examples=5,
                 opcheck=False)
    name = _register("graphcap_test::scale_list", "(Tensor[] xs) -> Tensor[]",
                     reference=lambda xs: [x * 2 for x in xs],
                     inputs=lambda device, dtype: _list_inputs(device, dtype).map(
                         lambda a: (a[1] + [a[0]],)),
                     kernels={"in_place": Kernel(_scale_in_place, devices=CPU)})
    with pytest.raises(AssertionError, match=r"argument 0 \(xs\).*does not declare"):
        check_op(name, kernel="in_place", dtypes=(torch.float32,), examples=5,
                 opcheck=False)


def _raises(x):
    raise IndexError("out of range")


def test_errors_name_the_kernel_and_what_differs():
    rows = _one(lambda t, device, dtype: torch.randn(t, 4, dtype=dtype))
    name = _register("graphcap_test::two_out", "(Tensor x) -> (Tensor, Tensor)",
                     reference=lambda x: (x * 2, x * 3), inputs=rows,
                     kernels={"short": Kernel(lambda x: (x * 2,), devices=CPU),
                              "raises": Kernel(_raises, devices=CPU)})
    with pytest.raises(AssertionError, match=r"returns 1 values, the reference 2"):
        check_op(name, kernel="short", dtypes=(torch.float32,), examples=3, opcheck=False)
    with pytest.raises(IndexError) as info:
        check_op(name, kernel="raises", dtypes=(torch.float32,), examples=3, opcheck=False)
    assert any("raised by graphcap_test::two_out[raises]" in n for n in info.value.__notes__)
    name = _register("graphcap_test::bare_tensor", "(Tensor x) -> Tensor",
                     reference=lambda x: x * 2,
                     inputs=lambda device, dtype: st.integers(1, 3).map(torch.randn))
    with pytest.raises(TypeError, match="gave a Tensor, not a tuple of the op's arguments"):
        check_op(name, dtypes=(torch.float32,), examples=3)


@pytest.mark.parametrize("call,message", [
    (lambda: prefill_batches(0, 2, 100), "max_tokens 0 and max_requests 2"),
    (lambda: prefill_batches(8, 0, 100), "max_tokens 8 and max_requests 0"),
    (lambda: full_batch(4, 0, 100), "max_tokens 4 and max_requests 0"),
    (lambda: prefill_batches(8, 2, 1), "vocab 1 leaves no token id"),
    (lambda: full_batch(8, 2, 3, min_token_id=3), "vocab 3 leaves no token id")])
def test_a_batch_range_without_a_request_or_a_token_id_is_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def _times_two_writing_beside(x):  # a wrong row stride: also writes the next columns
    if x.shape[0] > 1:
        x.as_strided((x.shape[0] - 1,), (x.stride(0),), x.storage_offset() + 8).fill_(7)
    return x * 2


def _times_two_writing_past_the_end(x):  # a missing mask: one element past x's last
    x.as_strided((1,), (1,), x.storage_offset() + (x.shape[0] - 1) * x.stride(0) + 8).fill_(7)
    return x * 2


@pytest.mark.parametrize("kernel", [_times_two_writing_beside, _times_two_writing_past_the_end])
def test_a_kernel_that_writes_beside_its_argument_s_view_fails(kernel):
    name = _register(
        f"graphcap_test::{kernel.__name__}", "(Tensor q) -> Tensor", reference=lambda q: q * 2,
        inputs=_one(lambda t, device, dtype: torch.randn(t + 1, 24, dtype=dtype)[:, 8:16]
                    if t > 1 else torch.randn(t, 8, dtype=dtype)),
        kernels={"stray": Kernel(kernel, devices=CPU)})
    with pytest.raises(AssertionError, match=r"\[stray\] wrote outside its argument 0 \(q\)"):
        check_op(name, kernel="stray", dtypes=(torch.float32,), examples=5, opcheck=False)


@pytest.mark.parametrize("shape,arguments", [("short", lambda x: (x,)),
                                             ("long", lambda x: (x, 2.0, 3))])
def test_an_input_strategy_of_the_wrong_number_of_arguments_is_named_with_the_schema(
        shape, arguments):
    name = _register(f"graphcap_test::{shape}_args", "(Tensor x, float a) -> Tensor",
                     reference=lambda x, a: x * a,
                     inputs=lambda device, dtype: st.integers(1, 3).map(
                         lambda t: arguments(torch.randn(t))))
    with pytest.raises(TypeError, match=r"gave \(Tensor.*not a tuple of the op's arguments "
                                        r"\(Tensor x, float a\)"):
        check_op(name, dtypes=(torch.float32,), examples=3)
