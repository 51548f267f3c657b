"""Mixture-of-experts kernels: grouped gated experts (routing: :mod:`.moe_routing`).

Specification: :func:`graphcap.opsdb.reference.moe_experts`.

Algorithm
---------
``moe_experts`` handles N = T * k (token, slot) pairs; pair ``p`` is token ``p // k``,
slot ``p % k``, expert ``topk_ids.flatten()[p]``.

1. Align (a few static-shaped torch ops, :func:`.moe_routing.align_pairs`): per-expert counts by
   ``scatter_add_``; each expert's count is rounded up to BLOCK_M and prefix-summed into
   ``cum_padded`` [E] (expert e owns rows ``[cum_padded[e-1], cum_padded[e])`` of the
   padded order); a stable ``torch.sort`` of the expert ids gives each pair its row, and
   ``sorted_pairs`` [T*k + E*(BLOCK_M-1)] holds the pair ids in that order with padding
   rows set to N. Every BLOCK_M-row tile belongs to one expert. A pair of no expert (an
   id outside [0, E)) sorts past the rows in use.
2. ``_moe_gate_up_kernel``: grid (max tiles, I / BLOCK_N). A tile finds its expert by
   counting the ``cum_padded`` entries at or below its first row, exits early when it
   starts at or past ``cum_padded[E-1]`` (read from device memory), gathers its tokens'
   rows of x, computes gate and up with two ``tl.dot`` accumulators in float32, applies
   ``silu(gate) * up`` in registers and stores the rows into the workspace
   ``inter`` [T*k, I] at their pair ids.
3. ``_moe_down_kernel``: the same tiling over ``inter`` with w2 (grid (max tiles,
   H / BLOCK_N)); it scales each row by its routing weight and stores ``pairs``
   [T*k, H] at the pair ids (no atomics: deterministic).
4. ``_moe_sum_kernel``: out[t] = sum over the k slots of ``pairs`` (but a pair of no
   expert's), in float32, cast to x.dtype.

Capture contract
----------------
The launchers synchronise nothing with the host: no ``.item()``, ``.tolist()``,
``nonzero`` or data-dependent shapes. Every buffer size and every grid follows from host
shapes (T, k, E, H, I and the block sizes chosen from them), and the routing is read by
the kernels from device memory, so a CUDA graph captured once replays correctly for any
new router logits / routing copied into the captured tensors. Temporaries are allocated
inside the launcher (from the graph's pool during capture). T == 0 returns an empty
result without launching anything.

Compilation: H, I, k, BLOCK_M (picked from T*k/E) and the dtypes are compile-time
constants, so warm up each shape bucket outside capture (the first launch JITs). Under
``TRITON_INTERPRET=1`` the dot products run in float32 (the interpreter mis-multiplies
bfloat16) and the K loops have constant bounds (it cannot take tensor bounds in range()).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from graphcap.opsdb.triton import moe_routing
from graphcap.opsdb.triton.common import dot, interpreting
from graphcap.opsdb.triton.moe_routing import moe_topk_softmax

__all__ = ["moe_topk_softmax", "moe_experts"]

# The MXFP4 kernels' tiles where given (BLOCK_N of each kernel, BLOCK_K dividing H and I,
# warps, stages): a probe's switch (docs/notes/probes/moe_mxfp4.py).
MXFP4_TILES: dict | None = None


# --------------------------------------------------------------------------- experts


@triton.jit
def _mxfp4_ptrs(w_ptr, s_ptr, expert, rows, stride_we, stride_wn, stride_wk,
                stride_se, stride_sn, stride_sk, BLOCK_K: tl.constexpr):
    """The first K step of MXFP4 weight rows ``rows`` of ``expert``: pointers to its bytes
    [BLOCK_K // 2, rows] (two values each along K) and its scales [rows, BLOCK_K // 32]
    (one per 32 values)."""
    rows = rows.to(tl.int64)
    e = expert.to(tl.int64)
    w = (w_ptr + e * stride_we + rows[None, :] * stride_wn
         + tl.arange(0, BLOCK_K // 2)[:, None] * stride_wk)
    s = (s_ptr + e * stride_se + rows[:, None] * stride_sn
         + tl.arange(0, BLOCK_K // 32)[None, :] * stride_sk)
    return w, s


@triton.jit
def _tile_expert(cum_padded_ptr, num_experts, row0, BLOCK_E: tl.constexpr):
    """(expert of the tile starting at padded row ``row0``, rows used in total)."""
    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(cum_padded_ptr + offs_e, mask=offs_e < num_experts, other=0x7FFFFFFF)
    expert = tl.sum((ends <= row0).to(tl.int32), axis=0)
    total = tl.load(cum_padded_ptr + num_experts - 1)
    return expert, total


@triton.jit
def _moe_gate_up_kernel(
    x_ptr, w13_ptr, b13_ptr, inter_ptr, sorted_pairs_ptr, cum_padded_ptr, s13_ptr,
    num_pairs, num_experts, alpha, limit,
    stride_xt, stride_xh,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_it, stride_ii,
    H: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_BIAS: tl.constexpr, CLAMPED_GLU: tl.constexpr, CLAMP: tl.constexpr,
    INTERLEAVED: tl.constexpr, MXFP4: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    expert, total = _tile_expert(cum_padded_ptr, num_experts, row0, BLOCK_E)
    if row0 >= total:
        return

    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    valid = pair < num_pairs
    token = (pair // TOP_K).to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + token[:, None] * stride_xt + offs_k[None, :] * stride_xh
    w_base = w13_ptr + expert.to(tl.int64) * stride_we
    if INTERLEAVED:  # gpt-oss: gate and up alternate along w13's rows (and b13)
        step, up = 2, 1
    else:  # the gate rows, then the up rows
        step, up = 1, INTER
    if MXFP4:
        g_ptrs, gs_ptrs = _mxfp4_ptrs(w13_ptr, s13_ptr, expert, offs_n * step, stride_we,
                                      stride_wn, stride_wk, stride_se, stride_sn, stride_sk,
                                      BLOCK_K)
        us_ptrs = gs_ptrs + up * stride_sn
    else:
        g_ptrs = (w_base + offs_n[None, :].to(tl.int64) * (step * stride_wn)
                  + offs_k[:, None] * stride_wk)
    u_ptrs = g_ptrs + up * stride_wn

    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        if MXFP4:  # K a multiple of BLOCK_K (the launcher's choice)
            b_g = tl.load(g_ptrs, mask=nmask[None, :], other=0)
            b_u = tl.load(u_ptrs, mask=nmask[None, :], other=0)
            s_g = tl.load(gs_ptrs, mask=nmask[:, None], other=127)
            s_u = tl.load(us_ptrs, mask=nmask[:, None], other=127)
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(tl.bfloat16)
            acc_g = tl.dot_scaled(a, None, "bf16", b_g, s_g, "e2m1", acc_g)
            acc_u = tl.dot_scaled(a, None, "bf16", b_u, s_u, "e2m1", acc_u)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += (BLOCK_K // 2) * stride_wk
            u_ptrs += (BLOCK_K // 2) * stride_wk
            gs_ptrs += (BLOCK_K // 32) * stride_sk
            us_ptrs += (BLOCK_K // 32) * stride_sk
        else:
            if EVEN_K:  # no mask along the contiguous K dim: vectorised loads
                b_g = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
                b_u = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                kmask = offs_k < H - k0
                b_g = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                b_u = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            a = a.to(b_g.dtype)
            acc_g = dot(a, b_g, acc_g, IEEE, INTERPRET)
            acc_u = dot(a, b_u, acc_u, IEEE, INTERPRET)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += BLOCK_K * stride_wk
            u_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:  # b13 [E, 2I], laid out as w13's rows
        b_row = b13_ptr + expert.to(tl.int64) * (2 * INTER) + offs_n * step
        acc_g += tl.load(b_row, mask=nmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_row + up, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if CLAMPED_GLU:  # gpt-oss: (up + 1) * gate * sigmoid(alpha * gate), clamped first
        if CLAMP:
            acc_g = tl.minimum(acc_g, limit)
            acc_u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (acc_u + 1.0) * acc_g / (1.0 + tl.exp(-alpha * acc_g))
    else:
        h = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    out_ptrs = (inter_ptr + pair[:, None].to(tl.int64) * stride_it
                + offs_n[None, :] * stride_ii)
    tl.store(out_ptrs, h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_down_kernel(
    inter_ptr, w2_ptr, b2_ptr, pairs_ptr, sorted_pairs_ptr, cum_padded_ptr,
    topk_weights_ptr, s2_ptr, num_pairs, num_experts,
    stride_it, stride_ii,
    stride_we, stride_wn, stride_wk,
    stride_se, stride_sn, stride_sk,
    stride_pt, stride_ph,
    H: tl.constexpr, INTER: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    row0 = pid_m * BLOCK_M
    expert, total = _tile_expert(cum_padded_ptr, num_experts, row0, BLOCK_E)
    if row0 >= total:
        return

    offs_m = row0 + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pairs_ptr + offs_m)
    valid = pair < num_pairs
    pair64 = pair.to(tl.int64)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = inter_ptr + pair64[:, None] * stride_it + offs_k[None, :] * stride_ii
    if MXFP4:
        b_ptrs, s_ptrs = _mxfp4_ptrs(w2_ptr, s2_ptr, expert, offs_n, stride_we, stride_wn,
                                     stride_wk, stride_se, stride_sn, stride_sk, BLOCK_K)
    else:
        b_ptrs = (w2_ptr + expert.to(tl.int64) * stride_we
                  + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk)

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        if MXFP4:
            b = tl.load(b_ptrs, mask=nmask[None, :], other=0)
            scale = tl.load(s_ptrs, mask=nmask[:, None], other=127)
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(tl.bfloat16)
            acc = tl.dot_scaled(a, None, "bf16", b, scale, "e2m1", acc)
            a_ptrs += BLOCK_K * stride_ii
            b_ptrs += (BLOCK_K // 2) * stride_wk
            s_ptrs += (BLOCK_K // 32) * stride_sk
        else:
            if EVEN_K:
                b = tl.load(b_ptrs, mask=nmask[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=valid[:, None], other=0.0)
            else:
                kmask = offs_k < INTER - k0
                b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                a = tl.load(a_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
            a = a.to(b.dtype)
            acc = dot(a, b, acc, IEEE, INTERPRET)
            a_ptrs += BLOCK_K * stride_ii
            b_ptrs += BLOCK_K * stride_wk

    if HAS_BIAS:  # b2 [E, H]
        bias = tl.load(b2_ptr + expert.to(tl.int64) * H + offs_n, mask=nmask, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    w = tl.load(topk_weights_ptr + pair64, mask=valid, other=0.0).to(tl.float32)
    acc = acc * w[:, None]
    out_ptrs = pairs_ptr + pair64[:, None] * stride_pt + offs_n[None, :] * stride_ph
    tl.store(out_ptrs, acc.to(pairs_ptr.dtype.element_ty), mask=valid[:, None] & nmask[None, :])


@triton.jit
def _moe_sum_kernel(
    pairs_ptr, ids_ptr, out_ptr, H, num_experts,
    stride_pt, stride_ph, stride_it, stride_ik, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * stride_it + j * stride_ik)  # no expert's: never written
        routed = offs < tl.where((e >= 0) & (e < num_experts), H, 0)
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * stride_pt + offs * stride_ph,
                       mask=routed, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + offs * stride_oh,
             acc.to(out_ptr.dtype.element_ty), mask=offs < H)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                alpha: float = 0.0, limit: float = 0.0, interleaved: bool = False,
                w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped gated experts with routing weights, summed over the k slots. With biases
    ``b13`` [E, 2I] and ``b2`` [E, H], and ``alpha > 0``: gpt-oss's clamped GLU in place
    of SwiGLU (:func:`graphcap.opsdb.reference.moe_experts`). ``interleaved``: gate and up
    alternate along w13's rows and b13 (gpt-oss's checkpoints). w13 and w2 may be any
    strided views (a transposed parameter: the weights are read where they lie).

    x [T, H]; w13 [E, 2*I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights
    [T, k] (float32 or any float); topk_ids [T, k] int32/int64, a slot of an id outside
    [0, E) (expert parallelism's -1, say) routed to no expert, adding nothing.
    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(gate) * up)`` with
    ``e = topk_ids[t, j]`` and gate / up the halves of ``w13[e] @ x[t]``. Products
    accumulate in float32; the SwiGLU intermediate and the per-slot rows are kept in
    x.dtype (float32 inputs use IEEE, not TF32, dot products). Writes ``out`` [T, H] (x.dtype)
    if given, else a new tensor, and returns it.

    MXFP4 experts (``w13_scale`` and ``w2_scale`` given, the reference's layout): w13
    [E, 2*I, H // 2] and w2 [E, H, I // 2] uint8, H and I multiples of 32; each K step
    multiplies bfloat16 rows by the packed values and their scales (``tl.dot_scaled``,
    which upcasts them to bfloat16 in registers where the GPU has no FP4 tensor cores),
    so the weights are read at about a quarter of bfloat16's bytes. The activation
    between the projections is kept in bfloat16.

    No host synchronisation: the routing is read on the device, buffers and grids
    depend only on shapes, so the call can be captured in a CUDA graph and replayed with
    new routing copied into ``topk_weights`` / ``topk_ids``.
    """
    num_tokens, hidden = x.shape
    num_experts, two_i, hidden_w = w13.shape
    quantized = w13_scale is not None
    if quantized:
        hidden_w *= 2  # two values a byte
    inter_size = two_i // 2
    if hidden_w != hidden or two_i != 2 * inter_size:
        raise ValueError(f"w13 {tuple(w13.shape)} does not match x {tuple(x.shape)}")
    w2_in = inter_size // 2 if quantized else inter_size
    if tuple(w2.shape) != (num_experts, hidden, w2_in):
        raise ValueError(f"w2 {tuple(w2.shape)}: expected {(num_experts, hidden, w2_in)}")
    if quantized and (w2_scale is None or hidden % 32 or inter_size % 32):
        raise ValueError("MXFP4 experts need both scales and H and I multiples of 32")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights "
                         f"{tuple(topk_weights.shape)} must both be [T={num_tokens}, k]")
    top_k = topk_ids.shape[1]
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ValueError(f"out must be {tuple(x.shape)} {x.dtype}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    if num_tokens == 0 or hidden == 0 or inter_size == 0 or top_k == 0:
        out = x.new_empty(x.shape) if out is None else out
        return out.zero_()  # no expert adds anything (or there is nothing to write)

    device = x.device
    num_pairs = num_tokens * top_k
    block_m = moe_routing.rows_per_tile(num_pairs, num_experts)
    sorted_pairs, cum_padded = moe_routing.align_pairs(topk_ids, num_experts, block_m)
    max_tiles = triton.cdiv(sorted_pairs.numel(), block_m)
    block_e = triton.next_power_of_2(num_experts)
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    interpret = interpreting()
    ieee = x.dtype == torch.float32 or w13.dtype == torch.float32
    # Smaller tiles for 4-byte inputs keep the pipelined shared memory in budget.
    wide = w13.element_size() <= 2
    block_k = 64 if wide else 32
    stages = 3 if wide else 2
    warps = 4 if block_m <= 32 else 8
    if quantized:  # a whole number of K steps of whole scale blocks
        block_k = 64 if hidden % 64 == 0 and inter_size % 64 == 0 else 32
        ieee = False
    s13 = w13_scale if quantized else w13  # (a placeholder pointer without scales)
    s2 = w2_scale if quantized else w2

    inter = torch.empty((num_pairs, inter_size),
                        dtype=torch.bfloat16 if quantized else w2.dtype, device=device)
    block_n1 = 64
    block_n2 = 128 if wide and block_m >= 64 else 64
    if quantized and MXFP4_TILES:
        block_n1, block_n2 = MXFP4_TILES["n1"], MXFP4_TILES["n2"]
        block_k, warps, stages = (MXFP4_TILES[key] for key in ("k", "warps", "stages"))
    b13, b2 = (None if b is None else b.contiguous() for b in (b13, b2))  # a broadcast one
    _moe_gate_up_kernel[(max_tiles, triton.cdiv(inter_size, block_n1))](
        x, w13, w13 if b13 is None else b13, inter, sorted_pairs, cum_padded, s13,
        num_pairs, num_experts, float(alpha), float(limit),
        x.stride(0), x.stride(1),
        w13.stride(0), w13.stride(1), w13.stride(2),
        s13.stride(0), s13.stride(1), s13.stride(2),
        inter.stride(0), inter.stride(1),
        H=hidden, INTER=inter_size, TOP_K=top_k, BLOCK_E=block_e,
        BLOCK_M=block_m, BLOCK_N=block_n1, BLOCK_K=block_k, EVEN_K=hidden % block_k == 0,
        IEEE=ieee, INTERPRET=interpret, HAS_BIAS=b13 is not None, CLAMPED_GLU=alpha > 0,
        CLAMP=limit > 0, INTERLEAVED=bool(interleaved), MXFP4=quantized, num_warps=warps,
        num_stages=stages,
    )

    pairs = torch.empty((num_pairs, hidden), dtype=x.dtype, device=device)
    _moe_down_kernel[(max_tiles, triton.cdiv(hidden, block_n2))](
        inter, w2, w2 if b2 is None else b2, pairs, sorted_pairs, cum_padded, weights, s2,
        num_pairs, num_experts,
        inter.stride(0), inter.stride(1),
        w2.stride(0), w2.stride(1), w2.stride(2),
        s2.stride(0), s2.stride(1), s2.stride(2),
        pairs.stride(0), pairs.stride(1),
        H=hidden, INTER=inter_size, BLOCK_E=block_e,
        BLOCK_M=block_m, BLOCK_N=block_n2, BLOCK_K=block_k, EVEN_K=inter_size % block_k == 0,
        IEEE=ieee, INTERPRET=interpret, HAS_BIAS=b2 is not None, MXFP4=quantized,
        num_warps=warps, num_stages=stages,
    )
    del inter  # before out is made, which may take its memory (a peak of inter and pairs)
    return sum_slots(pairs, topk_ids, num_experts, x.new_empty(x.shape) if out is None else out)


def sum_slots(pairs: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
              out: torch.Tensor) -> torch.Tensor:
    """``out[t]`` = the sum of ``pairs``' rows ``t * k`` .. ``t * k + k - 1`` (each
    expert's output times its routing weight) in float32, but those of no expert's id."""
    num_tokens, hidden = out.shape
    block_h = min(1024, triton.next_power_of_2(hidden))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        pairs, topk_ids, out, hidden, num_experts,
        pairs.stride(0), pairs.stride(1), topk_ids.stride(0), topk_ids.stride(1),
        out.stride(0), out.stride(1),
        TOP_K=topk_ids.shape[1], BLOCK_H=block_h, num_warps=4,
    )
    return out
