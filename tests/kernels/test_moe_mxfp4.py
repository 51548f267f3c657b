"""MXFP4 experts (gpt-oss as shipped): ``moe_experts`` with packed E2M1 weights and E8M0
scales against the reference (which dequantizes, then computes as the dense experts do),
through ``tl.dot_scaled`` and through the kernel's own decoding, with gpt-oss's biases,
clamped GLU and interleaved gate/up rows; bad scales refused by name (Triton's interpreter
without a GPU; on the GPU also gpt-oss's own sizes)."""

from __future__ import annotations

import pytest
import torch

from graphcap.opsdb import OpInputError, reference
from graphcap.opsdb.triton import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def experts(e: int, h: int, i: int, seed: int = 0):
    """Random MXFP4 experts (w13, w2, their scales) and biases, values of RMS about 0.3."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (e, 2 * i, h // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (e, h, i // 2), dtype=torch.uint8, generator=g)
    s13 = torch.randint(122, 125, (e, 2 * i, h // 32), dtype=torch.uint8, generator=g)
    s2 = torch.randint(122, 125, (e, h, i // 32), dtype=torch.uint8, generator=g)
    b13 = torch.randn(e, 2 * i, generator=g) * 0.3
    b2 = torch.randn(e, h, generator=g) * 0.3
    return [t.to(DEVICE) for t in (w13, w2, s13, s2, b13, b2)]


def routed(t: int, e: int, k: int, seed: int = 0):
    logits = torch.randn(t, e, generator=torch.Generator().manual_seed(seed))
    return [x.to(DEVICE) for x in reference.moe_topk_softmax(logits, k, True)]


SIZES = [(8, 64, 32)] + ([(4, 2880, 2880)] if DEVICE == "cuda" else [])  # (E, H, I)


@pytest.mark.parametrize("tokens", [1, 9, 40])
@pytest.mark.parametrize("size", SIZES, ids=lambda s: "x".join(map(str, s)))
def test_mxfp4_experts_are_the_reference_of_their_dequantized_weights(tokens, size):
    """bf16 rows, gpt-oss's biases, clamped GLU and interleaved gate/up rows."""
    e, h, i = size
    w13, w2, s13, s2, b13, b2 = experts(e, h, i, seed=tokens)
    b13, b2 = b13.bfloat16(), b2.bfloat16()
    x = (torch.randn(tokens, h, generator=torch.Generator().manual_seed(1))).to(
        DEVICE, torch.bfloat16)
    weights, ids = routed(tokens, e, 2, seed=tokens)
    args = (x, w13, w2, weights, ids, b13, b2, 1.702, 7.0, True, s13, s2)
    want = reference.moe_experts(*args).float()
    got = moe.moe_experts(*args).float()
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * scale)


def test_dequantizing_is_a_power_of_two_times_the_e2m1_value():
    # Bytes 0x21: codes 1 (0.5) then 2 (1.0); 0xF8: -0.0 then -6.0. Scale 127: 1; 129: 4.
    packed = torch.tensor([[0x21] * 16, [0xF8] * 16], dtype=torch.uint8)
    scales = torch.tensor([[127], [129]], dtype=torch.uint8)
    got = reference.mxfp4_dequantize(packed, scales)
    assert got[0].tolist() == [0.5, 1.0] * 16
    assert got[1].tolist() == [-0.0, -24.0] * 16


def test_mxfp4_experts_without_both_scales_or_of_odd_sizes_are_refused():
    w13, w2, s13, s2, _, _ = experts(4, 64, 32)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routed(3, 4, 2)
    op = torch.ops.graphcap.moe_experts
    with pytest.raises(OpInputError, match="take both w13_scale and w2_scale"):
        op(x, w13, w2, weights, ids, w13_scale=s13)
    with pytest.raises(OpInputError, match=r"the shape of w2_scale .* one scale per 32"):
        op(x, w13, w2, weights, ids, w13_scale=s13, w2_scale=s2[..., :0])
    with pytest.raises(OpInputError, match="w13 must be uint8|dtype"):
        op(x, w13.bfloat16(), w2, weights, ids, w13_scale=s13, w2_scale=s2)
