"""A user's own Triton kernel, registered with graphcap and property-tested against its
reference. The Triton kernel runs on a GPU, or on CPU under TRITON_INTERPRET=1 (set it
before importing this file, as graphcap's test suite does)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

import graphcap
from graphcap.opsdb import Kernel
from graphcap.testing import check_op


@triton.jit
def _scaled_tanh_kernel(x_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask).to(tl.float32)
    e = tl.exp(2 * x)
    tl.store(out_ptr + offs, (alpha * (e - 1) / (e + 1)).to(out_ptr.dtype.element_ty),
             mask=mask)


def scaled_tanh_triton(x: torch.Tensor, alpha: float) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        _scaled_tanh_kernel[(triton.cdiv(n, 256),)](x, out, n, alpha, BLOCK=256)
    return out


def scaled_tanh_reference(x: torch.Tensor, alpha: float) -> torch.Tensor:
    return (alpha * torch.tanh(x.float())).to(x.dtype)


def scaled_tanh_inputs(device, dtype, max_tokens: int = 64):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t, h = d(st.integers(0, max_tokens)), d(st.sampled_from([1, 8, 33, 100]))
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        x = (torch.randn(t, h, generator=gen) * 3).to(device=device, dtype=dtype)
        return x, d(st.sampled_from([0.5, 1.0, 2.0]))

    return draw()


NAME = "example::scaled_tanh"
if NAME not in graphcap.opsdb.REGISTRY:
    graphcap.register_op(
        NAME, "(Tensor x, float alpha) -> Tensor", reference=scaled_tanh_reference,
        kernels={"triton": Kernel(scaled_tanh_triton, requires=("triton",))},
        inputs=scaled_tanh_inputs)  # no fake: derived from the reference


def test_the_triton_kernel_matches_its_reference(graphcap_device):
    errors = check_op(NAME, device=graphcap_device, examples=10)
    assert set(errors) == {"triton"}  # it ran (on the GPU, or in the interpreter)
