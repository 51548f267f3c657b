"""MXFP4 experts (gpt-oss as shipped): ``moe_experts`` with packed E2M1 weights and E8M0
scales against the reference (which dequantizes, then computes as the dense experts do),
with gpt-oss's biases, clamped GLU and interleaved gate/up rows: in the published order
through the Triton kernels (``tl.dot_scaled``), and in the CUDA kernel's operand order
(:mod:`graphcap.opsdb.mxfp4`: its layout and its decode's bit operations checked on the
CPU, the kernel itself on the GPU); bad inputs refused by name (Triton's interpreter and
the reference without a GPU; on the GPU also gpt-oss's own sizes)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from graphcap.opsdb import OpInputError, mxfp4, reference
from graphcap.opsdb.moe import MOE_EXPERTS
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


# --------------------------------------------------------------- the CUDA kernel's order


def test_the_operand_order_round_trips_and_reorders_in_place():
    torch.manual_seed(0)
    for gate_up, interleaved in ((True, True), (True, False), (False, False)):
        w = torch.randint(0, 256, (3, 64, 96), dtype=torch.uint8)
        s = torch.randint(110, 129, (3, 64, 6), dtype=torch.uint8)
        packed, scales = mxfp4.operand_order(w, s, gate_up, interleaved)
        assert packed.shape == (3, 4, 3, 32, 16) and scales.shape == (3, 4, 3, 8, 2, 2)
        back = mxfp4.published_order(packed, scales, gate_up, interleaved)
        assert torch.equal(back[0], w) and torch.equal(back[1], s)
        ptr = w.data_ptr()
        w2, s2 = mxfp4.to_operand_order_(w, s, gate_up, interleaved)
        assert w2.data_ptr() == ptr and torch.equal(w2, packed) and torch.equal(s2, scales)


def kernel_shifts() -> tuple[tuple[int, int], ...]:
    """The shifts operand() in mxfp4_operands.cuh decodes its registers 0-3 with."""
    header = Path(mxfp4.__file__).parent / "cuda" / "mxfp4_operands.cuh"
    found = re.findall(r"a\[(\d)\] = bf16x2_mul\(e2m1_pair<(-?\d+), (-?\d+)>",
                       header.read_text())
    assert [int(p) for p, _, _ in found] == [0, 1, 2, 3], found
    return tuple((int(m), int(s)) for _, m, s in found)


def test_the_operand_order_places_bits_where_the_kernel_decodes_them():
    assert kernel_shifts() == mxfp4.SHIFTS


def kernel_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """moe_mxfp4.cu's decode in torch: each lane's word j, register p (shifts of the word by
    moe_mxfp4.cu's constants: the magnitudes to bits 6-8 and 22-24, the signs to 15 and 31)
    as bf16 bits, times 2^(s - 1) in bf16, placed where its product reads it: [E, N, K] in
    the stored rows, real K."""
    def bf16(bits):
        return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16).view(
            torch.bfloat16)

    def shifted(q, by):
        return (q << by) & 0xFFFFFFFF if by >= 0 else q >> -by

    e, blocks, chunks = packed.shape[:3]
    b = packed.view(e, blocks, chunks, 8, 4, 4, 4).to(torch.int64)  # [e, R, c, g, t, j, byte]
    q = b[..., 0] | b[..., 1] << 8 | b[..., 2] << 16 | b[..., 3] << 24
    out = torch.empty(e, blocks, 2, 8, chunks, 4, 2, 4, 2)  # [e, R, half, g, c, j, qh, t, qe]
    for p, (mag, sign) in enumerate(kernel_shifts()):
        pair = (shifted(q, mag) & 0x01C001C0) | (shifted(q, sign) & 0x80008000)
        half = p & 1  # registers 0 and 2 hold row g, 1 and 3 row g + 8 (the A operand)
        # products 0-1 take the chunk's first group of 32, 2-3 its second: [e, R, c, g, 1, j]
        scale = bf16((scales[:, :, :, :, [0, 0, 1, 1], half].long() + 126) << 7).unsqueeze(4)
        for qe in range(2):
            value = bf16((pair >> (16 * qe)) & 0xFFFF) * scale
            out[:, :, half, :, :, :, p >> 1, :, qe] = value.float().permute(0, 1, 3, 2, 5, 4)
    return out.reshape(e, blocks * 16, chunks * 64)


@pytest.mark.parametrize("gate_up,interleaved", [(True, True), (True, False), (False, False)])
def test_the_kernels_decode_of_the_operand_order_is_the_dequantized_weights(gate_up,
                                                                           interleaved):
    """The bit operations of moe_mxfp4.cu on every code and scale 115..128 (subnormal 0.5,
    -0 and 6 included)."""
    torch.manual_seed(1)
    w = torch.randint(0, 256, (2, 32, 128), dtype=torch.uint8)
    s = torch.randint(115, 129, (2, 32, 8), dtype=torch.uint8)
    got = kernel_decode(*mxfp4.operand_order(w, s, gate_up, interleaved))
    rows = mxfp4.block_rows(32, gate_up, interleaved)
    want = torch.stack([reference.mxfp4_dequantize(w[e], s[e]) for e in range(2)])[:, rows]
    assert torch.equal(got, want.float())


OPERAND_SIZES = [(8, 64, 64)] + ([(4, 2880, 2880)] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("tokens", [1, 9, 40, 200])
@pytest.mark.parametrize("size", OPERAND_SIZES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("glu", ["gpt-oss", "swiglu"])
def test_experts_in_operand_order_are_the_reference_of_their_published_order(tokens, size,
                                                                             glu):
    """On the GPU the CUDA kernels (0.5-100 rows an expert: 8-row ``mma.sync`` tiles, then
    warpgroup tiles of 32 and 64 rows on Hopper, 16-row ``mma.sync`` tiles elsewhere), on
    the CPU the reference; both against the published order's reference."""
    e, h, i = size
    w13, w2, s13, s2, b13, b2 = experts(e, h, i, seed=tokens)
    interleaved = glu == "gpt-oss"
    b13, b2 = (b13.bfloat16(), b2.bfloat16()) if interleaved else (None, None)
    alpha, limit = (1.702, 7.0) if interleaved else (0.0, 0.0)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1)).to(
        DEVICE, torch.bfloat16)
    weights, ids = routed(tokens, e, 2, seed=tokens)
    want = reference.moe_experts(x, w13, w2, weights, ids, b13, b2, alpha, limit, interleaved,
                                 s13, s2).float()
    ow13, os13 = mxfp4.operand_order(w13, s13, True, interleaved)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    op = torch.ops.graphcap.moe_experts
    got = op(x, ow13, ow2, weights, ids, b13, b2, alpha, limit, interleaved, os13, os2).float()
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_the_operand_order_refuses_what_its_kernel_cannot_hold():
    w13, w2, s13, s2, _, _ = experts(4, 64, 64)
    with pytest.raises(ValueError, match="scales above 128"):
        mxfp4.operand_order(w13, s13.clone().fill_(129), True, True)
    with pytest.raises(ValueError, match="multiples of 16 .* multiples of 64"):
        mxfp4.operand_order(w13[:, :, :16], s13[:, :, :1], True, True)
    x = torch.randn(3, 64, device=DEVICE, dtype=torch.bfloat16)
    weights, ids = routed(3, 4, 2)
    ow13, os13 = mxfp4.operand_order(w13, s13, True, True)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    op = torch.ops.graphcap.moe_experts
    with pytest.raises(OpInputError, match="w2_scale.*operand order"):
        op(x, ow13, ow2, weights, ids, w13_scale=os13, w2_scale=os2[:, :1])
    with pytest.raises(OpInputError, match="kernel 'triton' cannot take these inputs: takes "
                                           "experts in the published order"):
        MOE_EXPERTS(x, ow13, ow2, weights, ids, None, None, 0.0, 0.0, True, os13, os2,
                    kernel="triton")


def test_a_models_mxfp4_experts_take_the_operand_order_on_a_gpu_with_the_same_result():
    """gpt-oss's MoE block (sizes of whole 64-value chunks): reordered in place on the
    GPU, its output within bf16 rounding of the published order's; on the CPU it stays
    published and says why."""
    from dataclasses import replace

    from graphcap.models import PRESETS
    from graphcap.models.decoder import MoE

    args = replace(PRESETS["tiny-gpt-oss-mxfp4"], hidden=128, moe_intermediate=64)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        block = MoE(args).to(torch.bfloat16)
    h = torch.randn(7, 128, device=DEVICE, dtype=torch.bfloat16)
    norm = torch.ones(128, device=DEVICE, dtype=torch.bfloat16)
    before = block(h, norm).float()
    ptr = block.w13.data_ptr()
    why = block.to_operand_order()
    if DEVICE == "cpu":
        assert why == "the experts are not on a CUDA device" and block.w13.dim() == 3
        return
    assert why is None and block.w13.dim() == 5 and block.w13.data_ptr() == ptr
    torch.testing.assert_close(block(h, norm).float(), before, rtol=2e-2,
                               atol=2e-2 * before.abs().max().item())
    assert block.to_operand_order() is None  # once is enough


@pytest.mark.parametrize("rows", ["float32", "strided bf16"])
def test_experts_in_operand_order_take_float32_or_strided_rows(rows):
    """Rows the CUDA kernel cannot read in place (float32; a view 2 bytes past an aligned
    row) are rounded into a bf16 copy, and the result has x's dtype."""
    e, h, i = 8, 64, 64
    w13, w2, s13, s2, b13, b2 = experts(e, h, i, seed=5)
    base = torch.randn(6, h + 1, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = base[:, :h].contiguous() if rows == "float32" else base.bfloat16()[:, 1:]
    weights, ids = routed(6, e, 2, seed=5)
    args = (weights, ids, b13.bfloat16(), b2.bfloat16(), 1.702, 7.0, True)
    want = reference.moe_experts(x, w13, w2, *args, s13, s2)
    ow13, os13 = mxfp4.operand_order(w13, s13, True, True)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    got = torch.ops.graphcap.moe_experts(x, ow13, ow2, *args, os13, os2)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * want.float().abs().max().item())


@pytest.mark.parametrize("tokens", [9, 200])  # on the GPU: mma.sync, then warpgroup tiles
def test_a_slot_of_an_id_outside_the_experts_adds_nothing_in_operand_order(tokens):
    """-1, E or far past it: the slot is routed to no expert by the CUDA kernels (their
    alignment skips it, the sum too; no device-side assert), as by the reference."""
    e, h, i = OPERAND_SIZES[0]
    w13, w2, s13, s2, b13, b2 = experts(e, h, i, seed=3)
    b13, b2 = b13.bfloat16(), b2.bfloat16()
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(4)).to(
        DEVICE, torch.bfloat16)
    weights, ids = routed(tokens, e, 2, seed=5)
    strays = ids.long()
    strays[0, 1], strays[1, 0], strays[2], strays[3, 1] = -1, e, -5, 2**40
    kept = (strays >= 0) & (strays < e)
    glu = (1.702, 7.0, True)
    want = reference.moe_experts(x, w13, w2, weights * kept, ids, b13, b2, *glu, s13, s2)
    ow13, os13 = mxfp4.operand_order(w13, s13, True, True)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    got = MOE_EXPERTS(x, ow13, ow2, weights, strays, b13, b2, *glu, os13, os2)
    assert (got[2] == 0).all()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                               atol=2e-2 * want.float().abs().max().item())


@pytest.mark.skipif(DEVICE == "cpu", reason="the CUDA kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("tokens,experts_n,block", [(1, 4, 8), (37, 8, 8), (512, 128, 32),
                                                    (3000, 128, 64)])
def test_the_cuda_alignment_groups_each_experts_pairs_as_the_torch_one(dtype, tokens,
                                                                       experts_n, block):
    """moe_mxfp4.cu's align: the same padded ends as moe_routing.align_pairs and, within
    each expert's rows, the same pairs (their order may differ), padding rows n."""
    from graphcap.opsdb.cuda import extension
    from graphcap.opsdb.triton import moe_routing

    _, ids = routed(tokens, experts_n, 4, seed=tokens)
    ids = ids.to(dtype)
    ids[::3, 1] = -1  # ids of no expert: in no group
    ids[1::5, 2] = experts_n
    got_pairs, got_ends = extension("moe_mxfp4").align(ids, experts_n, block)
    want_pairs, want_ends = moe_routing.align_pairs(ids, experts_n, block)
    assert torch.equal(got_ends, want_ends)
    assert got_pairs.shape == want_pairs.shape
    start = 0
    for end in want_ends.tolist():
        assert torch.equal(got_pairs[start:end].sort().values, want_pairs[start:end].sort().values)
        start = end
    assert (got_pairs[start:] == ids.numel()).all()
