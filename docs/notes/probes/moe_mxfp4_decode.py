"""gpt-oss-120b's MXFP4 expert projections (128 experts, 4 a token, H = I = 2880; gate/up
with gate and up rows interleaved, biases, clamped GLU; down with biases and routing
weights) by opsdb's kernels (``tl.dot_scaled``) against candidates that decode E2M1
themselves (device side):

    PYTHONPATH=. [PROBE_TOKENS=128,512] [PROBE_GROUPS=1,2] [PROBE_DECODES=asm,triton] \
        python3 docs/notes/probes/moe_mxfp4_decode.py
    PROBE_ONCE=1 [PROBE_TILES='{...}'] ncu ... python3 docs/notes/probes/moe_mxfp4_decode.py

The candidate takes the weights as the left operand (rows of w13 by tokens, so a tile's
decoded values feed the tensor cores from registers), decodes each nibble to float16 by
placing its three bits in the exponent's low bits and the mantissa's high bit (the value
times 2^-14, E2M1's subnormal included: float16 has subnormals; by inline PTX two values
an instruction, or by Triton's element-wise ops), multiplies even and odd
K positions against the activation's even and odd columns (no interleaving shuffle), one
32-value scale group a step, and scales each group's float32 partial sum per weight row
(2^(scale - 113)) instead of every value. Per token count: device ms of each, captured
in a CUDA graph, over a sweep of the candidate's tiles, and the largest difference
between their outputs. JSON in $OUT/moe-mxfp4-decode.json. With TRITON_INTERPRET=1 and no
GPU it checks the candidate (Triton's decode: the interpreter runs no PTX) on small
shapes against the dequantized reference; the PTX decode is checked on the device,
against opsdb's kernels (max_diff)."""

import gc
import itertools
import json
import os

import torch
import triton
import triton.language as tl

from graphcap.opsdb import reference
from graphcap.opsdb.triton import moe, moe_routing


@triton.jit
def _e2m1_f16(nibble):
    """Each E2M1 value of ``nibble`` (uint8, low 4 bits) as float16 times 2^-14."""
    bits = ((nibble & 7).to(tl.uint16) << 9) | ((nibble & 8).to(tl.uint16) << 12)
    return bits.to(tl.float16, bitcast=True)


# Four bytes a register: the low nibbles of bytes 0 and 2 (then 1 and 3, shifted down a
# byte) land in float16's exponent and mantissa with two masks and two shifts each, two
# values an instruction; a byte permute puts the four in element order. The same for the
# high nibbles. Outputs: the low nibbles' values, the high nibbles' (times 2^-14).
_E2M1_PTX = tl.constexpr("""
{
.reg .b32 w8, a0, a1, t;
shr.b32 w8, $4, 8;
and.b32 a0, $4, 0x00070007; shl.b32 a0, a0, 9;
and.b32 t, $4, 0x00080008; shl.b32 t, t, 12; or.b32 a0, a0, t;
and.b32 a1, w8, 0x00070007; shl.b32 a1, a1, 9;
and.b32 t, w8, 0x00080008; shl.b32 t, t, 12; or.b32 a1, a1, t;
prmt.b32 $0, a0, a1, 0x5410;
prmt.b32 $1, a0, a1, 0x7632;
and.b32 a0, $4, 0x00700070; shl.b32 a0, a0, 5;
and.b32 t, $4, 0x00800080; shl.b32 t, t, 8; or.b32 a0, a0, t;
and.b32 a1, w8, 0x00700070; shl.b32 a1, a1, 5;
and.b32 t, w8, 0x00800080; shl.b32 t, t, 8; or.b32 a1, a1, t;
prmt.b32 $2, a0, a1, 0x5410;
prmt.b32 $3, a0, a1, 0x7632;
}
""")


@triton.jit
def _e2m1_pairs(b, ASM: tl.constexpr, PTX: tl.constexpr):
    """The values of the low and the high nibbles of bytes ``b`` (float16): inline ``PTX``
    four bytes at a time (``_E2M1_PTX``: times 2^-14), or Triton's own element-wise ops
    (times 2^-14)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(PTX, "=r,=r,=r,=r,r", [b],
                                           dtype=(tl.float16, tl.float16), is_pure=True,
                                           pack=4)
    else:
        lo = _e2m1_f16(b)
        hi = _e2m1_f16(b >> 4)
    return lo, hi


@triton.jit
def tile_of(sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, N: tl.constexpr,
            BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: whether it holds pairs, its expert (int64), its pairs and
    which are real, its rows of N and their mask."""
    row0 = tl.program_id(0) * BLOCK_M
    expert, total = moe._tile_expert(cum_padded_ptr, num_experts, row0, BLOCK_E)
    rows = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + rows, mask=rows < total, other=num_pairs)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return row0 < total, expert.to(tl.int64), pair, pair < num_pairs, offs_n, offs_n < N


@triton.jit
def glu_store(gate, up, b13_ptr, e, offs_n, nmask, pair, valid, inter_ptr, stride_it, alpha,
              limit, INTER: tl.constexpr):
    """Gate/up sums [rows, pairs] (float32) plus their biases through gpt-oss's clamped
    GLU into the pairs' rows of ``inter``."""
    bias = b13_ptr + e * (2 * INTER) + offs_n * 2
    gate += tl.load(bias, mask=nmask, other=0.0).to(tl.float32)[:, None]
    up += tl.load(bias + 1, mask=nmask, other=0.0).to(tl.float32)[:, None]
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    h = (up + 1.0) * gate / (1.0 + tl.exp(-alpha * gate))
    out = inter_ptr + pair[None, :].to(tl.int64) * stride_it + offs_n[:, None]
    tl.store(out, h.to(inter_ptr.dtype.element_ty), mask=nmask[:, None] & valid[None, :])


@triton.jit
def down_store(acc, b2_ptr, e, offs_n, nmask, pair64, valid, topk_weights_ptr, pairs_ptr,
               stride_pt, H: tl.constexpr):
    """Down sums [rows, pairs] (float32) plus the bias, times each pair's routing weight,
    into the pairs' rows."""
    acc += tl.load(b2_ptr + e * H + offs_n, mask=nmask, other=0.0).to(tl.float32)[:, None]
    w = tl.load(topk_weights_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
    acc = acc * w[None, :]
    out = pairs_ptr + pair64[None, :] * stride_pt + offs_n[:, None]
    tl.store(out, acc.to(pairs_ptr.dtype.element_ty), mask=nmask[:, None] & valid[None, :])


@triton.jit
def _gate_up_decoded(
    x_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, cum_padded_ptr, s13_ptr,
    num_pairs, num_experts, alpha, limit,
    stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_it,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    live, e, pair, valid, offs_n, nmask = tile_of(
        sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, INTER, BLOCK_E,
        BLOCK_M, BLOCK_N)
    if not live:
        return
    token = (pair // TOP_K).to(tl.int64)
    rows = (offs_n * 2).to(tl.int64)  # gate rows; the up row follows each
    offs_b = tl.arange(0, 16)  # the bytes of one scale group
    g_ptrs = w13_ptr + e * stride_we + rows[:, None] * stride_wn + offs_b[None, :]
    gs_ptrs = s13_ptr + e * stride_se + rows * stride_sn
    xe_ptrs = x_ptr + token[None, :] * stride_xt + (2 * offs_b)[:, None]  # even columns

    acc_g = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in range(0, H // 32, GROUPS):
        for i in tl.static_range(GROUPS):
            group = step + i
            b_g = tl.load(g_ptrs + group * 16, mask=nmask[:, None], other=0)
            b_u = tl.load(g_ptrs + stride_wn + group * 16, mask=nmask[:, None], other=0)
            s_g = tl.load(gs_ptrs + group, mask=nmask, other=127).to(tl.float32)
            s_u = tl.load(gs_ptrs + stride_sn + group, mask=nmask, other=127).to(tl.float32)
            x_e = tl.load(xe_ptrs + group * 32, mask=valid[None, :], other=0.0).to(tl.float16)
            x_o = tl.load(xe_ptrs + group * 32 + 1, mask=valid[None, :],
                          other=0.0).to(tl.float16)
            g_lo, g_hi = _e2m1_pairs(b_g, ASM, _E2M1_PTX)
            u_lo, u_hi = _e2m1_pairs(b_u, ASM, _E2M1_PTX)
            p_g = tl.dot(g_lo, x_e)
            p_g = tl.dot(g_hi, x_o, p_g)
            p_u = tl.dot(u_lo, x_e)
            p_u = tl.dot(u_hi, x_o, p_u)
            acc_g += p_g * tl.exp2(s_g - 113.0)[:, None]
            acc_u += p_u * tl.exp2(s_u - 113.0)[:, None]

    glu_store(acc_g, acc_u, b13_ptr, e, offs_n, nmask, pair, valid, inter_ptr, stride_it,
              alpha, limit, INTER)


@triton.jit
def _down_decoded(
    inter_ptr, w2_ptr, b2_ptr, pairs_ptr, sorted_pairs_ptr, cum_padded_ptr,
    topk_weights_ptr, s2_ptr, num_pairs, num_experts,
    stride_it, stride_we, stride_wn, stride_se, stride_sn, stride_pt,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, ASM: tl.constexpr,
):
    """The down projection as the candidate gate/up: rows of w2 by pairs, each pair's
    row scaled by its routing weight (opsdb's _moe_down_kernel's contract)."""
    live, e, pair, valid, offs_n, nmask = tile_of(
        sorted_pairs_ptr, cum_padded_ptr, num_pairs, num_experts, H, BLOCK_E,
        BLOCK_M, BLOCK_N)
    if not live:
        return
    pair64 = pair.to(tl.int64)
    offs_b = tl.arange(0, 16)
    w_ptrs = w2_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_b[None, :]
    s_ptrs = s2_ptr + e * stride_se + offs_n.to(tl.int64) * stride_sn
    ie_ptrs = inter_ptr + pair64[None, :] * stride_it + (2 * offs_b)[:, None]

    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for step in range(0, INTER // 32, GROUPS):
        for i in tl.static_range(GROUPS):
            group = step + i
            b = tl.load(w_ptrs + group * 16, mask=nmask[:, None], other=0)
            sc = tl.load(s_ptrs + group, mask=nmask, other=127).to(tl.float32)
            a_e = tl.load(ie_ptrs + group * 32, mask=valid[None, :], other=0.0).to(tl.float16)
            a_o = tl.load(ie_ptrs + group * 32 + 1, mask=valid[None, :],
                          other=0.0).to(tl.float16)
            w_lo, w_hi = _e2m1_pairs(b, ASM, _E2M1_PTX)
            part = tl.dot(w_lo, a_e)
            part = tl.dot(w_hi, a_o, part)
            acc += part * tl.exp2(sc - 113.0)[:, None]

    down_store(acc, b2_ptr, e, offs_n, nmask, pair64, valid, topk_weights_ptr, pairs_ptr,
               stride_pt, H)


def routed(ids, experts):
    block_m = moe_routing.rows_per_tile(ids.numel(), experts)
    sorted_pairs, cum_padded = moe_routing.align_pairs(ids, experts, block_m)
    return block_m, sorted_pairs, cum_padded


def decoded(x, w13, s13, b13, ids, alpha, limit, tiles):
    """The candidate's gate/up rows [T * k, I] (bf16)."""
    experts, inter = w13.shape[0], w13.shape[1] // 2
    assert x.shape[1] // 32 % tiles["groups"] == 0, "whole steps of scale groups"
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    pairs = ids.numel()
    out = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(inter, tiles["n"]))
    _gate_up_decoded[grid](
        x, w13, b13, out, sorted_pairs, cum_padded, s13, pairs, experts, alpha, limit,
        x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        out.stride(0), H=x.shape[1], INTER=inter, TOP_K=ids.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        GROUPS=tiles["groups"], ASM=tiles.get("decode") == "asm", num_warps=tiles["warps"],
        num_stages=tiles["stages"])
    return out


def current(x, w13, s13, b13, ids, alpha, limit):
    """opsdb's gate/up rows [T * k, I] (bf16), launched as moe_experts launches them."""
    experts, inter = w13.shape[0], w13.shape[1] // 2
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    pairs = ids.numel()
    out = torch.empty(pairs, inter, dtype=torch.bfloat16, device=x.device)
    block_k = 64 if x.shape[1] % 64 == 0 and inter % 64 == 0 else 32
    moe._moe_gate_up_kernel[(triton.cdiv(sorted_pairs.numel(), block_m),
                             triton.cdiv(inter, 64))](
        x, w13, b13, out, sorted_pairs, cum_padded, s13, pairs, experts, alpha, limit,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2),
        s13.stride(0), s13.stride(1), s13.stride(2), out.stride(0), out.stride(1),
        H=x.shape[1], INTER=inter, TOP_K=ids.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_K=block_k, EVEN_K=True, IEEE=False, INTERPRET=False, HAS_BIAS=True,
        CLAMPED_GLU=True, CLAMP=True, INTERLEAVED=True, MXFP4=True,
        num_warps=4 if block_m <= 32 else 8, num_stages=3)
    return out


def decoded_down(inter, w2, s2, b2, weights, ids, tiles):
    """The candidate's down rows [T * k, H] (bf16), each times its routing weight."""
    experts, hidden = w2.shape[0], w2.shape[1]
    assert inter.shape[1] // 32 % tiles["groups"] == 0, "whole steps of scale groups"
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    out = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device=inter.device)
    grid = (triton.cdiv(sorted_pairs.numel(), block_m), triton.cdiv(hidden, tiles["n"]))
    _down_decoded[grid](
        inter, w2, b2, out, sorted_pairs, cum_padded, weights.reshape(-1), s2, ids.numel(),
        experts, inter.stride(0), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        out.stride(0), H=hidden, INTER=inter.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=tiles["n"],
        GROUPS=tiles["groups"], ASM=tiles.get("decode") == "asm", num_warps=tiles["warps"],
        num_stages=tiles["stages"])
    return out


def current_down(inter, w2, s2, b2, weights, ids):
    """opsdb's down rows [T * k, H] (bf16), launched as moe_experts launches them."""
    experts, hidden = w2.shape[0], w2.shape[1]
    block_m, sorted_pairs, cum_padded = routed(ids, experts)
    out = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device=inter.device)
    block_k = 64 if hidden % 64 == 0 and inter.shape[1] % 64 == 0 else 32
    moe._moe_down_kernel[(triton.cdiv(sorted_pairs.numel(), block_m),
                          triton.cdiv(hidden, 64))](
        inter, w2, b2, out, sorted_pairs, cum_padded, weights.reshape(-1), s2, ids.numel(),
        experts, inter.stride(0), inter.stride(1), w2.stride(0), w2.stride(1),
        w2.stride(2), s2.stride(0), s2.stride(1), s2.stride(2), out.stride(0),
        out.stride(1), H=hidden, INTER=inter.shape[1],
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_M=block_m, BLOCK_N=64,
        BLOCK_K=block_k, EVEN_K=True, IEEE=False, INTERPRET=False, HAS_BIAS=True,
        MXFP4=True, num_warps=4 if block_m <= 32 else 8, num_stages=3)
    return out


def dequantized(x, w13, s13, b13, ids, alpha, limit):
    """The reference's gate/up rows [T * k, I] (float32)."""
    rows = []
    for p, expert in enumerate(ids.flatten().tolist()):
        w = reference.mxfp4_dequantize(w13[expert], s13[expert])  # [2I, H]
        gu = w @ x[p // ids.shape[1]].float() + b13[expert].float()
        gate, up = gu[0::2].clamp(max=limit), gu[1::2].clamp(-limit, limit)
        rows.append((up + 1) * gate * torch.sigmoid(alpha * gate))
    return torch.stack(rows)


def dequantized_down(inter, w2, s2, b2, weights, ids):
    """The reference's down rows [T * k, H] (float32), each times its routing weight."""
    rows = []
    for p, expert in enumerate(ids.flatten().tolist()):
        w = reference.mxfp4_dequantize(w2[expert], s2[expert])  # [H, I]
        rows.append((w @ inter[p].float() + b2[expert].float()) * weights.flatten()[p])
    return torch.stack(rows)


def random_layer(experts, hidden, inter, device, lo=119, hi=122):
    """w13, s13, b13, w2, s2, b2 of an MXFP4 expert layer (gate and up interleaved)."""
    def packed(rows, cols):
        return (torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8,
                              device=device),
                torch.randint(lo, hi, (experts, rows, cols // 32), dtype=torch.uint8,
                              device=device),
                (torch.randn(experts, rows, device=device) * 0.1).bfloat16())
    return (*packed(2 * inter, hidden), *packed(hidden, inter))


def tiny_layer():
    """A small MXFP4 expert layer on the CPU (4 experts, H = I = 64, 2 a token) and 5
    tokens routed over it: w13, s13, b13, w2, s2, b2, x, weights, ids."""
    torch.manual_seed(0)
    experts, hidden, inter, k = 4, 64, 64, 2
    layer = random_layer(experts, hidden, inter, "cpu", lo=124, hi=128)
    x = (torch.randn(5, hidden) * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(5, experts), k, True)
    return (*layer, x, weights, ids)


def interpreted_check() -> None:
    w13, s13, b13, w2, s2, b2, x, weights, ids = tiny_layer()
    tiles = {"n": 16, "groups": 2, "warps": 4, "stages": 1}
    checks = (("gate/up", dequantized(x, w13, s13, b13, ids, 1.702, 7.0),
               decoded(x, w13, s13, b13, ids, 1.702, 7.0, tiles)),)
    inter_rows = checks[0][2]
    checks += (("down", dequantized_down(inter_rows, w2, s2, b2, weights, ids),
                decoded_down(inter_rows, w2, s2, b2, weights, ids, tiles)),)
    for name, want, got in checks:
        err = (got.float() - want).abs().max().item()
        print(f"interpreted {name}: max |candidate - reference| {err:.3g} (rows of max "
              f"{want.abs().max().item():.3g})")
        assert err <= 0.02 * want.abs().max().item() + 1e-3, (name, err)


def compare_tiles(gate_up, down, sweep, what: str, name: str) -> None:
    """gpt-oss-120b's expert layer at each of PROBE_TOKENS: opsdb's gate/up and down
    against ``gate_up`` and ``down`` (a candidate's launchers, taking the tiles last) at
    each tile of ``sweep``, CUDA-graph device ms and the largest difference from opsdb's
    rows; JSON in $OUT/``name``.json."""
    from graphcap.bench.common import environment
    from graphcap.bench.timing import graphed_ms

    experts, hidden, inter, k = 128, 2880, 2880, 4
    torch.manual_seed(0)
    w13, s13, b13, w2, s2, b2 = random_layer(experts, hidden, inter, "cuda")
    glu = (1.702, 7.0)
    rows = []
    for tokens in [int(t) for t in os.environ.get("PROBE_TOKENS", "128,512").split(",")]:
        x = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16()
        weights, ids = reference.moe_topk_softmax(
            torch.randn(tokens, experts, device="cuda"), k, True)
        inter_rows = current(x, w13, s13, b13, ids, *glu)
        for projection, now, candidate, args in (
                ("gate/up", current, gate_up, (x, w13, s13, b13, ids, *glu)),
                ("down", current_down, down, (inter_rows, w2, s2, b2, weights, ids))):
            base = now(*args)
            row = {"tokens": tokens, "projection": projection,
                   "current_ms": graphed_ms(lambda a=args, f=now: f(*a), calls=4, reps=10),
                   "candidates": []}
            for tiles in sweep:
                entry = {"tiles": tiles}
                try:
                    got = candidate(*args, tiles)
                    entry["max_diff"] = round((got.float() - base.float()).abs().max().item(),
                                              4)
                    entry["ms"] = graphed_ms(lambda a=args, t=tiles, f=candidate: f(*a, t),
                                             calls=4, reps=10)
                except Exception as exc:  # noqa: BLE001 - a probe records what failed
                    entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                row["candidates"].append(entry)
                # Each timing's graph pool goes back before the next (without this the
                # sweep held 133 GB of graph pools by 512 tokens and ran out of memory).
                gc.collect()
                torch.cuda.empty_cache()
            timed = [c for c in row["candidates"] if "ms" in c]
            row["best"] = min(timed, key=lambda c: c["ms"]) if timed else None
            rows.append(row)
            print(tokens, projection, "current", row["current_ms"], "best", row["best"],
                  "errors", len(row["candidates"]) - len(timed))
            out = {"what": what, **environment(), "rows": rows}  # written row by row
            with open(os.path.join(os.environ.get("OUT", "."), f"{name}.json"), "w") as f:
                json.dump(out, f, indent=1)


def main() -> None:
    groups = [int(g) for g in os.environ.get("PROBE_GROUPS", "1,2").split(",")]
    decodes = os.environ.get("PROBE_DECODES", "asm,triton").split(",")
    sweep = [dict(decode=d, n=n, groups=g, warps=w, stages=s) for d, n, g, w, s in
             itertools.product(decodes, (64, 128), groups, (4, 8), (3, 4))]
    compare_tiles(decoded, decoded_down, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down: tl.dot_scaled against an own "
                  "float16 decode, weights as the left operand", "moe-mxfp4-decode")


def launch_once() -> None:
    """Each projection once by opsdb's kernel and once by the candidate of PROBE_TILES
    (JSON), eagerly, at the first of PROBE_TOKENS: for a profiler (``ncu -k regex:...``)."""
    experts, hidden, inter, k = 128, 2880, 2880, 4
    torch.manual_seed(0)
    w13, s13, b13, w2, s2, b2 = random_layer(experts, hidden, inter, "cuda")
    tiles = json.loads(os.environ.get(
        "PROBE_TILES", '{"decode": "asm", "n": 128, "groups": 1, "warps": 8, "stages": 3}'))
    tokens = int(os.environ.get("PROBE_TOKENS", "128").split(",")[0])
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(tokens, experts, device="cuda"), k,
                                              True)
    inter_rows = current(x, w13, s13, b13, ids, 1.702, 7.0)
    decoded(x, w13, s13, b13, ids, 1.702, 7.0, tiles)
    current_down(inter_rows, w2, s2, b2, weights, ids)
    decoded_down(inter_rows, w2, s2, b2, weights, ids, tiles)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if torch.cuda.is_available():
        launch_once() if os.environ.get("PROBE_ONCE") else main()
    else:
        interpreted_check()
