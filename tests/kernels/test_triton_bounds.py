"""Inputs at the edges of what the Triton kernels take, against the references."""

from __future__ import annotations

import pytest
import torch

from graphcap.opsdb import get_op

device = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if device == "cuda" else []
P, S = 3, 2


@pytest.fixture(autouse=True)
def _triton_runs_here():
    if get_op("kv_write").available(device)["triton"] is not None:
        pytest.skip("the Triton kernels: on a GPU or under Triton's interpreter")


def test_kv_write_of_no_kv_heads_or_no_head_dim_writes_nothing_as_the_reference():
    # The launch took tl.arange(0, 0) and failed.
    for heads, dim in ((0, 16), (1, 0)):
        k = torch.ones(2, heads, dim, device=device)
        caches = [torch.zeros(P, S, heads, dim, device=device) for _ in range(2)]
        get_op("kv_write")(k, k, *caches, torch.tensor([0, 1], device=device),
                           kernel="triton")
