"""graphcap.testing: the public helpers our own suites are built on."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from graphcap.testing import op_inputs, prefill_batches


@settings(max_examples=10, deadline=None)
@given(batch=prefill_batches(32, 3, 100))
def test_prefill_batches_are_valid_packed_requests(batch):
    ids, pos, lens = batch
    assert 1 <= len(lens) <= 3 and sum(lens) == ids.shape[0] <= 32 and sum(lens) >= 1
    assert all(n >= 0 for n in lens) and int(ids.min()) >= 1 and int(ids.max()) < 100
    start = 0
    for n in lens:
        assert pos[start:start + n].tolist() == list(range(n))
        start += n


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


def test_the_plugin_gives_the_device_to_test_on(graphcap_device):
    assert graphcap_device.type == ("cuda" if torch.cuda.is_available() else "cpu")
