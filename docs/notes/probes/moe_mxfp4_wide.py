"""gpt-oss-120b's MXFP4 expert projections with wide K steps and a cheaper decode, against
opsdb's kernels (``tl.dot_scaled``) and the best of ``moe_mxfp4_decode.py`` (device side):

    PYTHONPATH=. [PROBE_TOKENS=128,512] python3 docs/notes/probes/moe_mxfp4_wide.py

Nsight Compute found opsdb's kernel and ``moe_mxfp4_decode.py``'s candidate bound by
instruction issue (about 9.5 thread instructions a weight value, DRAM at 20%), the
decode about 2 of them: the rest is the work around each 32-value scale group (a 16-byte
load a row, addresses, a tensor-core product and its wait, the scale). Here a step takes
``G`` scale groups at once (``16 G`` bytes a row, one load) as a batched product
``[G, rows, 16] x [G, 16, tokens]`` whose ``G`` partials are scaled per group and row and
kept apart until the end (one sum after the loop, no reduction a step); the activation's
even and odd columns come from one load of column pairs. The decode (inline PTX, four
bytes a register): each nibble's bits placed as an E4M3 byte (E2M1 times 2^-6 exactly,
its subnormal included), two values an instruction converted to float16 by
``cvt.rn.f16x2.e4m3x2`` (sm_89 and later): about 1.4 instructions a value against 3.1.
With TRITON_INTERPRET=1 and no GPU it checks the kernels (the decode in Triton's own
ops: the interpreter runs no PTX) against the dequantized reference; the PTX's bit logic
is checked in numpy. JSON in $OUT/moe-mxfp4-wide.json."""

import itertools

import numpy as np
import torch
import triton
import triton.language as tl
from moe_mxfp4_decode import (
    _e2m1_pairs,
    compare_tiles,
    dequantized,
    dequantized_down,
    down_store,
    glu_store,
    random_layer,
    routed,
    tile_of,
)

from graphcap.opsdb import reference

# Four bytes a register. Low nibbles: bits 0-2 to 2-4 (shift left 2), bit 3 to 7 (shift
# left 4), one lop3 choosing between them, a mask; high nibbles: bits 4-6 to 2-4 (shift
# right 2), bit 7 stays. The E4M3 bytes, two a conversion, become float16 pairs in
# element order. Outputs: the low nibbles' values, the high nibbles' (times 2^-6).
_E4M3_PTX = tl.constexpr("""
{
.reg .b32 t, u, lo, hi;
.reg .b16 l0, l1, h0, h1;
shl.b32 t, $4, 2;
shl.b32 u, $4, 4;
lop3.b32 lo, t, u, 0x1C1C1C1C, 0xE4;
and.b32 lo, lo, 0x9C9C9C9C;
shr.b32 t, $4, 2;
lop3.b32 hi, t, $4, 0x1C1C1C1C, 0xE4;
and.b32 hi, hi, 0x9C9C9C9C;
mov.b32 {l0, l1}, lo;
mov.b32 {h0, h1}, hi;
cvt.rn.f16x2.e4m3x2 $0, l0;
cvt.rn.f16x2.e4m3x2 $1, l1;
cvt.rn.f16x2.e4m3x2 $2, h0;
cvt.rn.f16x2.e4m3x2 $3, h1;
}
""")


@triton.jit
def _step(acc, w_ptrs, s_ptrs, x_ptrs, k0, nmask, valid, G: tl.constexpr,
          ASM: tl.constexpr):
    """``acc`` [G, rows, tokens] plus scale groups ``k0 .. k0 + G - 1``: the rows' bytes
    [G, rows, 16], their scales [G, rows], the activation's column pairs [G, 16, tokens,
    2]."""
    b = tl.load(w_ptrs + k0 * 16, mask=nmask[None, :, None], other=0)
    sc = tl.load(s_ptrs + k0, mask=nmask[None, :], other=127).to(tl.float32)
    x = tl.load(x_ptrs + k0 * 32, mask=valid[None, None, :, None], other=0.0)
    x_e, x_o = tl.split(x.to(tl.float16))
    lo, hi = _e2m1_pairs(b, ASM, _E4M3_PTX)  # times 2^-6 by the PTX, 2^-14 without
    part = tl.dot(lo, x_e)
    part = tl.dot(hi, x_o, part)
    # The decode's factor folded into the scale: 2^(s - 127) / 2^-6 (PTX) or / 2^-14.
    return acc + part * tl.exp2(sc - (121.0 if ASM else 113.0))[:, :, None]


@triton.jit
def _pointers(w_base, s_base, x_base, rows, stride_wn, stride_sn, stride_x, tokens,
              G: tl.constexpr):
    """Step pointers at scale group 0: bytes [G, rows, 16], scales [G, rows], the
    activation's column pairs [G, 16, tokens, 2]."""
    g = tl.arange(0, G)
    j = tl.arange(0, 16)
    w = w_base + rows[None, :, None] * stride_wn + (g[:, None, None] * 16 + j[None, None, :])
    s = s_base + rows[None, :] * stride_sn + g[:, None]
    col = 2 * (g[:, None] * 16 + j[None, :])  # [G, 16]: the even column of each pair
    x = x_base + tokens[None, None, :, None] * stride_x + col[:, :, None, None] \
        + tl.arange(0, 2)[None, None, None, :]
    return w, s, x


@triton.jit
def _gate_up_wide(
    x_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, cum_padded_ptr, s13_ptr,
    num_pairs, num_experts, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_it,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr,
    ASM: tl.constexpr,
):
    live, e, pair, valid, offs_n, nmask = tile_of(
        sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, INTER, BLOCK_E,
        BLOCK_M, BLOCK_N)
    if not live:
        return
    token = (pair // TOP_K).to(tl.int64)
    rows = (offs_n * 2).to(tl.int64)  # gate rows; the up row follows each
    w_base = w13_ptr + e * stride_we
    s_base = s13_ptr + e * stride_se
    wg, sg, xp = _pointers(w_base, s_base, x_ptr, rows, stride_wn, stride_sn, stride_xt,
                           token, G)
    acc_g = tl.zeros([G, BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([G, BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in range(0, (H // 32) // G):
        acc_g = _step(acc_g, wg, sg, xp, step * G, nmask, valid, G, ASM)
        acc_u = _step(acc_u, wg + stride_wn, sg + stride_sn, xp, step * G, nmask, valid, G,
                      ASM)
    gate = tl.sum(acc_g, axis=0)
    up = tl.sum(acc_u, axis=0)
    if TAIL > 0:  # the scale groups past the last whole step
        k0 = (H // 32) // G * G
        wt, st, xt = _pointers(w_base, s_base, x_ptr, rows, stride_wn, stride_sn,
                               stride_xt, token, TAIL)
        zero = tl.zeros([TAIL, BLOCK_N, BLOCK_M], dtype=tl.float32)
        gate += tl.sum(_step(zero, wt, st, xt, k0, nmask, valid, TAIL, ASM), axis=0)
        up += tl.sum(_step(zero, wt + stride_wn, st + stride_sn, xt, k0, nmask, valid, TAIL,
                           ASM), axis=0)
    glu_store(gate, up, b13_ptr, e, offs_n, nmask, pair, valid, inter_ptr, stride_it, alpha,
              limit, INTER)


@triton.jit
def _down_wide(
    inter_ptr, w2_ptr, b2_ptr, pairs_ptr, sorted_pairs_ptr, cum_padded_ptr,
    topk_weights_ptr, s2_ptr, num_pairs, num_experts,
    stride_it, stride_we, stride_wn, stride_se, stride_sn, stride_pt,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, G: tl.constexpr, TAIL: tl.constexpr,
    ASM: tl.constexpr,
):
    live, e, pair, valid, offs_n, nmask = tile_of(
        sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, H, BLOCK_E,
        BLOCK_M, BLOCK_N)
    if not live:
        return
    pair64 = pair.to(tl.int64)
    rows = offs_n.to(tl.int64)
    w_base = w2_ptr + e * stride_we
    s_base = s2_ptr + e * stride_se
    wp, sp, xp = _pointers(w_base, s_base, inter_ptr, rows, stride_wn, stride_sn,
                           stride_it, pair64, G)
    acc = tl.zeros([G, BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in range(0, (INTER // 32) // G):
        acc = _step(acc, wp, sp, xp, step * G, nmask, valid, G, ASM)
    out = tl.sum(acc, axis=0)
    if TAIL > 0:
        k0 = (INTER // 32) // G * G
        wt, st, xt = _pointers(w_base, s_base, inter_ptr, rows, stride_wn, stride_sn,
                               stride_it, pair64, TAIL)
        zero = tl.zeros([TAIL, BLOCK_N, BLOCK_M], dtype=tl.float32)
        out += tl.sum(_step(zero, wt, st, xt, k0, nmask, valid, TAIL, ASM), axis=0)
    down_store(out, b2_ptr, e, offs_n, nmask, pair64, valid, topk_weights_ptr, pairs_ptr,
               stride_pt, H)


def _tail(groups: int, g: int) -> int:
    tail = groups % g
    assert tail & (tail - 1) == 0, f"{groups} scale groups leave {tail} past steps of {g}"
    return tail


def wide(x, w13, s13, b13, ids, alpha, limit, tiles):
    """The candidate's gate/up rows [T * k, I] (bf16)."""
    experts, inter = w13.shape[0], w13.shape[1] // 2
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    pairs = ids.numel()
    out = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(inter, tiles["n"]))
    _gate_up_wide[grid](
        x, w13, b13, out, sorted_pairs, cum_padded, s13, pairs, experts, alpha, limit,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        out.stride(0), H=x.shape[1], INTER=inter, TOP_K=ids.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        G=tiles["g"], TAIL=_tail(x.shape[1] // 32, tiles["g"]),
        ASM=tiles.get("decode") == "asm", num_warps=tiles["warps"],
        num_stages=tiles["stages"])
    return out


def wide_down(inter, w2, s2, b2, weights, ids, tiles):
    """The candidate's down rows [T * k, H] (bf16), each times its routing weight."""
    experts, hidden = w2.shape[0], w2.shape[1]
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    out = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device=inter.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(hidden, tiles["n"]))
    _down_wide[grid](
        inter, w2, b2, out, sorted_pairs, cum_padded, weights.reshape(-1), s2, ids.numel(),
        experts, inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        out.stride(0), H=hidden, INTER=inter.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        G=tiles["g"], TAIL=_tail(inter.shape[1] // 32, tiles["g"]),
        ASM=tiles.get("decode") == "asm", num_warps=tiles["warps"],
        num_stages=tiles["stages"])
    return out


def ptx_bits_check() -> None:
    """The PTX's bit logic in numpy over every byte, with E4M3's decoding by its
    definition: each nibble's value times 2^-6, in element order."""
    b = np.arange(256, dtype=np.uint32)
    words = b[0::4] | (b[1::4] << 8) | (b[2::4] << 16) | (b[3::4] << 24)  # 4 bytes a word
    mask32 = np.uint32(0xFFFFFFFF)

    def lop3_e4(a, c_in, c):  # LUT 0xE4: (a & c) | (b & ~c)
        return (a & c) | (c_in & (~c & mask32))

    t, u = (words << 2) & mask32, (words << 4) & mask32
    lo = lop3_e4(t, u, np.uint32(0x1C1C1C1C)) & np.uint32(0x9C9C9C9C)
    hi = lop3_e4(words >> 2, words, np.uint32(0x1C1C1C1C)) & np.uint32(0x9C9C9C9C)

    def e4m3(byte):
        sign = -1.0 if byte & 0x80 else 1.0
        exp, man = (byte >> 3) & 15, byte & 7
        return sign * (2.0 ** -6 * man / 8 if exp == 0 else 2.0 ** (exp - 7) * (1 + man / 8))

    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for w_i, (lo_w, hi_w) in enumerate(zip(lo, hi, strict=True)):
        for k in range(4):  # byte k of the word: element k
            byte = int(b[4 * w_i + k])
            for word, nibble in ((lo_w, byte & 15), (hi_w, byte >> 4)):
                want = (-1.0 if nibble & 8 else 1.0) * e2m1[nibble & 7] * 2.0 ** -6
                got = e4m3((int(word) >> (8 * k)) & 255)
                assert got == want or (got == 0 == want), (byte, nibble, got, want)
    print("PTX bit logic: every byte's two nibbles decode to E2M1 times 2^-6 in order")


def interpreted_check() -> None:
    torch.manual_seed(0)
    experts, hidden, inter, k = 4, 160, 128, 2  # 5 and 4 scale groups: steps and a tail
    w13, s13, b13, w2, s2, b2 = random_layer(experts, hidden, inter, "cpu", lo=124, hi=128)
    x = (torch.randn(5, hidden) * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(5, experts), k, True)
    for tiles in ({"n": 16, "g": 4, "warps": 4, "stages": 1},
                  {"n": 16, "g": 2, "warps": 4, "stages": 1}):
        rows = wide(x, w13, s13, b13, ids, 1.702, 7.0, tiles)
        for name, want, got in (
                ("gate/up", dequantized(x, w13, s13, b13, ids, 1.702, 7.0), rows),
                ("down", dequantized_down(rows, w2, s2, b2, weights, ids),
                 wide_down(rows, w2, s2, b2, weights, ids, tiles))):
            err = (got.float() - want).abs().max().item()
            print(f"interpreted {name} {tiles}: max |candidate - reference| {err:.3g} "
                  f"(rows of max {want.abs().max().item():.3g})")
            assert err <= 0.02 * want.abs().max().item() + 1e-3, (name, err)


def main() -> None:
    sweep = [dict(decode="asm", n=n, g=g, warps=w, stages=3) for n, g, w in
             itertools.product((32, 64, 128), (2, 4), (4, 8))]
    compare_tiles(wide, wide_down, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down: tl.dot_scaled against wide K "
                  "steps (G scale groups a batched product) with an E4M3-conversion decode",
                  "moe-mxfp4-wide")


if __name__ == "__main__":
    if torch.cuda.is_available():
        main()
    else:
        ptx_bits_check()
        interpreted_check()
