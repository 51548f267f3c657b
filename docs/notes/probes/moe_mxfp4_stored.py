"""gpt-oss-120b's MXFP4 expert projections with the weights in ``mxfp4_swizzled.py``'s
stored order (a thread's 16 loaded bytes its register-A operand values), against opsdb's
kernels (``tl.dot_scaled``) (device side):

    PYTHONPATH=. [PROBE_TOKENS=128,512] python3 docs/notes/probes/moe_mxfp4_stored.py

Each expert's rows of w13 (gate and up interleaved) and of w2 stored in that order once;
a program takes a tile of one expert's pairs (``moe_mxfp4_decode.py``'s routing) and
``BLOCK_N`` weight rows, the weights as the left operand, each K step one stored tile
decoded (Triton's element-wise ops, or inline PTX four bytes at a time) and scaled
per value before the product; gate/up splits its interleaved rows after the product into
the clamped GLU. Tiles swept; device ms in a CUDA graph against opsdb's, and the largest
difference from opsdb's rows. With TRITON_INTERPRET=1 and no GPU it checks both kernels
(Triton's decode) against the dequantized reference on small shapes, and the PTX's bit
logic in numpy. JSON in $OUT/moe-mxfp4-stored.json."""

import itertools
import os

import numpy as np
import torch
import triton
import triton.language as tl
from moe_mxfp4_decode import (
    compare_tiles,
    dequantized,
    dequantized_down,
    down_store,
    glu_store,
    routed,
    tile_of,
    tiny_layer,
)
from mxfp4_swizzled import scaled_product, stored_tile, swizzle

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def stored(w: torch.Tensor) -> torch.Tensor:
    """[E, rows, K/2] packed experts -> [E, rows/4, 2K] in the stored order."""
    return torch.stack([swizzle(w[e]) for e in range(w.shape[0])])


@triton.jit
def _gate_up_stored(
    x_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, cum_padded_ptr, s13_ptr,
    num_pairs, num_experts, alpha, limit, stride_xt, stride_we, stride_wr, stride_se,
    stride_sn, stride_it,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ASM: tl.constexpr, INTERPRET: tl.constexpr,
):
    # BLOCK_N weight rows: BLOCK_N / 2 intermediate columns, gate and up interleaved.
    live, e, pair, valid, offs_i, imask = tile_of(
        sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, INTER, BLOCK_E,
        BLOCK_M, BLOCK_N // 2)
    if not live:
        return
    row0 = tl.program_id(1) * BLOCK_N
    n = row0 + tl.arange(0, BLOCK_N)
    token = (pair // TOP_K).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_e, s_e = w13_ptr + e * stride_we, s13_ptr + e * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        w = stored_tile(w_e, row0, stride_wr, k0, BLOCK_N, BLOCK_K, ASM, INTERPRET)
        x = tl.load(x_ptr + token[None, :] * stride_xt + (k0 + ks)[:, None],
                    mask=valid[None, :], other=0.0)
        acc = scaled_product(w, s_e, n, stride_sn, k0, x, acc, BLOCK_N, BLOCK_K, INTERPRET)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1)))
    glu_store(gate, up, b13_ptr, e, offs_i, imask, pair, valid, inter_ptr, stride_it,
              alpha, limit, INTER)


@triton.jit
def _down_stored(
    inter_ptr, w2_ptr, b2_ptr, pairs_ptr, sorted_pairs_ptr, cum_padded_ptr,
    topk_weights_ptr, s2_ptr, num_pairs, num_experts, stride_it, stride_we, stride_wr,
    stride_se, stride_sn, stride_pt,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ASM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    tile = tile_of(sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, H, BLOCK_E,
                   BLOCK_M, BLOCK_N)
    if not tile[0]:  # no pairs in this tile
        return
    _, e, pair, valid, offs_n, nmask = tile
    pair64 = pair.to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_e, s_e = w2_ptr + e * stride_we, s2_ptr + e * stride_se
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        w = stored_tile(w_e, tl.program_id(1) * BLOCK_N, stride_wr, k0, BLOCK_N, BLOCK_K,
                        ASM, INTERPRET)
        a = tl.load(inter_ptr + pair64[None, :] * stride_it + (k0 + ks)[:, None],
                    mask=valid[None, :], other=0.0)
        acc = scaled_product(w, s_e, offs_n, stride_sn, k0, a, acc, BLOCK_N, BLOCK_K,
                             INTERPRET)
    down_store(acc, b2_ptr, e, offs_n, nmask, pair64, valid, topk_weights_ptr, pairs_ptr,
               stride_pt, H)


def _check_tiles(rows: int, k: int, tiles: dict) -> int:
    """BLOCK_K for ``k``; the weights are read without masks: whole tiles only."""
    block_k = 128 if k % 128 == 0 else 64
    assert rows % tiles["n"] == 0 and k % block_k == 0, (rows, k, tiles)
    return block_k


def gate_up(x, w13s, s13, b13, ids, alpha, limit, tiles):
    """Gate/up rows [T * k, I] (bf16) from stored w13 ``w13s`` [E, 2I/4, 2H]."""
    experts, inter, hidden = w13s.shape[0], w13s.shape[1] * 2, x.shape[1]
    block_k = _check_tiles(2 * inter, hidden, tiles)
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    out = torch.empty(ids.numel(), inter, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), 2 * inter // tiles["n"])
    _gate_up_stored[grid](
        x, w13s, b13, out, sorted_pairs, cum_padded, s13, ids.numel(), experts, alpha, limit,
        x.stride(0), w13s.stride(0), w13s.stride(1), s13.stride(0), s13.stride(1),
        out.stride(0), H=hidden, INTER=inter, TOP_K=ids.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        BLOCK_K=block_k, ASM=tiles.get("decode") == "asm", INTERPRET=INTERPRET,
        num_warps=tiles["warps"], num_stages=tiles["stages"])
    return out


def down(inter, w2s, s2, b2, weights, ids, tiles):
    """Down rows [T * k, H] (bf16) from stored w2 ``w2s`` [E, H/4, 2I], each times its
    routing weight."""
    experts, hidden = w2s.shape[0], w2s.shape[1] * 4
    block_k = _check_tiles(hidden, inter.shape[1], tiles)
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    out = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device=inter.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), hidden // tiles["n"])
    _down_stored[grid](
        inter, w2s, b2, out, sorted_pairs, cum_padded, weights.reshape(-1), s2, ids.numel(),
        experts, inter.stride(0), w2s.stride(0), w2s.stride(1), s2.stride(0), s2.stride(1),
        out.stride(0), H=hidden, INTER=inter.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        BLOCK_K=block_k, ASM=tiles.get("decode") == "asm", INTERPRET=INTERPRET,
        num_warps=tiles["warps"], num_stages=tiles["stages"])
    return out


def ptx_bits_check() -> None:
    """The inline PTX's masks, shifts and byte permutes, in numpy, against the
    element-wise decode's bits for every byte value."""
    rng = np.random.default_rng(0)
    words = rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    words[:64] = np.arange(256, dtype=np.uint32).reshape(64, 4) @ np.array(
        [1, 1 << 8, 1 << 16, 1 << 24], dtype=np.uint32)  # every byte value, in each place

    def halves(w, lo_mask, lo_shift, sign_mask, sign_shift):
        return ((w & lo_mask) << lo_shift) | ((w & sign_mask) << sign_shift)

    w8 = words >> 8
    out = []
    for masks in ((0x00070007, 6, 0x00080008, 12), (0x00700070, 2, 0x00800080, 8)):
        a0, a1 = halves(words, *masks), halves(w8, *masks)
        out += [(a0 & 0xFFFF) | (a1 << 16), (a0 >> 16) | (a1 & 0xFFFF0000)]  # 0x5410, 0x7632
    got = np.stack(out, 1).astype(np.uint32).view(np.uint16).reshape(-1, 2, 4)
    b = words.view(np.uint8).reshape(-1, 4).astype(np.uint16)

    def bits(nibble):
        return ((nibble & 7) << 6) | ((nibble & 8) << 12)

    assert (got[:, 0] == bits(b & 15)).all() and (got[:, 1] == bits(b >> 4)).all()
    print("PTX decode bits equal the element-wise decode's for every byte value")


def interpreted_check() -> None:
    w13, s13, b13, w2, s2, b2, x, weights, ids = tiny_layer()
    tiles = {"n": 32, "warps": 4, "stages": 1}
    want = dequantized(x, w13, s13, b13, ids, 1.702, 7.0)
    got = gate_up(x, stored(w13), s13, b13, ids, 1.702, 7.0, tiles)
    want_down = dequantized_down(got, w2, s2, b2, weights, ids)
    got_down = down(got, stored(w2), s2, b2, weights, ids, tiles)
    for name, w, g in (("gate/up", want, got), ("down", want_down, got_down)):
        err, top = (g.float() - w).abs().max().item(), w.abs().max().item()
        print(f"interpreted {name}: max error {err:.3g}, {err / top:.2%} of the largest")
        assert err <= 0.02 * top + 1e-3, (name, err)


def main() -> None:
    stored_w = {}  # each layer's experts in the stored order, made on first use

    def gate_up_of(x, w13, s13, b13, ids, alpha, limit, tiles):
        key = ("w13", w13.data_ptr())
        stored_w.setdefault(key, stored(w13))
        return gate_up(x, stored_w[key], s13, b13, ids, alpha, limit, tiles)

    def down_of(inter, w2, s2, b2, weights, ids, tiles):
        key = ("w2", w2.data_ptr())
        stored_w.setdefault(key, stored(w2))
        return down(inter, stored_w[key], s2, b2, weights, ids, tiles)

    sweep = [dict(decode=d, n=n, warps=w, stages=s) for d, n, w, s in
             itertools.product(("asm", "triton"), (64, 128), (4, 8), (3, 4))]
    compare_tiles(gate_up_of, down_of, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down with the weights stored as the "
                  "tensor cores' register operands, against tl.dot_scaled",
                  "moe-mxfp4-stored")


def check_on_cpu() -> None:
    ptx_bits_check()
    interpreted_check()


if __name__ == "__main__":
    (main if torch.cuda.is_available() else check_on_cpu)()
