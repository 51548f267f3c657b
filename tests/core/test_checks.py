"""Host values of a call: lengths and positions read as ints (the usual list of ints
taken as it is, anything else converted or refused by name), and staged as the host tensor
a copy reads, equal to what ``torch.tensor`` makes of them."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.core.checks import check_tensors, host_lengths, staged
from graphcap.errors import BadBatch

INTS = st.integers(-2**31, 2**31 - 1)


@given(rows=st.integers(1, 3), width=st.integers(0, 70), data=st.data(),
       dtype=st.sampled_from([torch.int64, torch.int32, torch.float32]))
def test_staged_values_equal_torch_tensors_of_them(rows, width, data, dtype):
    values = st.floats(-1e6, 1e6, width=32) if dtype == torch.float32 else INTS
    lists = [data.draw(st.lists(values, min_size=width, max_size=width)) for _ in range(rows)]
    got = staged(lists if rows > 1 else lists[0], dtype, "cpu")
    want = torch.tensor(lists if rows > 1 else lists[0], dtype=dtype)
    assert got.dtype == dtype and got.device.type == "cpu"
    assert torch.equal(got, want)


def test_staged_values_of_a_dtype_without_a_numpy_twin_still_stage():
    assert torch.equal(staged([1, 0, 1], torch.bool, "cpu"),
                       torch.tensor([True, False, True]))


@given(st.lists(st.integers(0, 10**6), max_size=70))
def test_lengths_of_ints_come_back_as_a_new_list_of_them(lens):
    got = host_lengths(lens, "positions")
    assert got == lens and got is not lens  # the caller's list is never aliased
    assert host_lengths(tuple(lens)) == lens
    assert host_lengths(torch.tensor(lens, dtype=torch.long)) == lens


@pytest.mark.parametrize("lens, match", [
    ([3, -1], "positions must be non-negative"),
    ([3, True], "every entry of positions must be an integer, got True"),
    ([3, 2.0], "every entry of positions must be an integer, got 2.0"),
    ("12", "positions must be a list"),
])
def test_lengths_that_are_not_ints_or_negative_are_refused_by_name(lens, match):
    with pytest.raises(BadBatch, match=match):
        host_lengths(lens, "positions")


@settings(max_examples=200)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), min_size=1, max_size=3))
def test_repeats_memory_is_whether_two_elements_share_a_place(dims):
    import itertools

    from graphcap.core.trees import repeats_memory

    sizes, strides = zip(*dims, strict=True)
    span = sum((n - 1) * s for n, s in dims if n) + 1
    t = torch.as_strided(torch.zeros(span), sizes, strides)
    places = [sum(i * s for i, s in zip(index, strides, strict=True))
              for index in itertools.product(*map(range, sizes))]
    assert repeats_memory(t) == (len(set(places)) < len(places)), (sizes, strides)


def test_an_argument_of_another_dtype_is_refused_naming_the_cast_and_the_capture():
    specs = [(torch.float32, (8,))]
    assert check_tensors([torch.zeros(3, 8)], specs, torch.device("cpu")) == 3
    with pytest.raises(BadBatch, match=r"argument 0 has dtype torch.float64; the runner "
                                       r"captured torch.float32: cast it with "
                                       r"\.to\(torch.float32\).*capture_all\(example\)"):
        check_tensors([torch.zeros(3, 8, dtype=torch.float64)], specs, torch.device("cpu"))


@pytest.mark.parametrize("layout", ["to_sparse", "to_sparse_csr"])
def test_an_argument_of_another_layout_than_dense_is_refused_before_it_is_copied(layout):
    specs = [(torch.float32, (8,))]
    with pytest.raises(BadBatch, match=r"argument 0 is a sparse_\w+ tensor.*to_dense"):
        check_tensors([getattr(torch.randn(3, 8), layout)()], specs, torch.device("cpu"))


def test_arguments_of_other_row_counts_are_refused_naming_the_argument_and_both_counts():
    specs = [(torch.float32, (8,)), (torch.int64, ())]
    with pytest.raises(BadBatch, match="argument 1 has 4 rows along dim 0 but argument 0 "
                                       "has 3"):
        check_tensors([torch.zeros(3, 8), torch.zeros(4, dtype=torch.long)], specs,
                      torch.device("cpu"))
