"""The expert kernels of :mod:`graphcap.opsdb.triton.moe` (its docstring gives the
algorithm and the capture contract): gate/up with the gated activation, and down scaled
by the routing weights, each over tiles of one expert's (token, slot) pairs, in the
experts' dtype or MXFP4 through ``tl.dot_scaled``."""

from __future__ import annotations

import triton
import triton.language as tl

from graphcap.opsdb.triton.common import dot


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
def _mxfp4_tile(b_ptrs, s_ptrs, nmask, ok):
    """One K step's MXFP4 bytes and scales of ``_mxfp4_ptrs``' rows (none where not ``ok``)."""
    b = tl.load(b_ptrs, mask=nmask[None, :] & ok, other=0)
    return b, tl.load(s_ptrs, mask=nmask[:, None] & ok, other=127)


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
    INTERLEAVED: tl.constexpr, MXFP4: tl.constexpr, LOOKAHEAD: tl.constexpr,
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
    if LOOKAHEAD:  # the first K step's tiles, before the loop
        b_g, s_g = _mxfp4_tile(g_ptrs, gs_ptrs, nmask, True)
        b_u, s_u = _mxfp4_tile(u_ptrs, us_ptrs, nmask, True)
    for k0 in range(0, H, BLOCK_K):
        if MXFP4:  # K a multiple of BLOCK_K (the launcher's choice)
            if not LOOKAHEAD:
                b_g, s_g = _mxfp4_tile(g_ptrs, gs_ptrs, nmask, True)
                b_u, s_u = _mxfp4_tile(u_ptrs, us_ptrs, nmask, True)
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(tl.bfloat16)
            a_ptrs += BLOCK_K * stride_xh
            g_ptrs += (BLOCK_K // 2) * stride_wk
            u_ptrs += (BLOCK_K // 2) * stride_wk
            gs_ptrs += (BLOCK_K // 32) * stride_sk
            us_ptrs += (BLOCK_K // 32) * stride_sk
            if LOOKAHEAD:  # the next step's tiles in flight during this step's products
                nb_g, ns_g = _mxfp4_tile(g_ptrs, gs_ptrs, nmask, k0 + BLOCK_K < H)
                nb_u, ns_u = _mxfp4_tile(u_ptrs, us_ptrs, nmask, k0 + BLOCK_K < H)
            acc_g = tl.dot_scaled(a, None, "bf16", b_g, s_g, "e2m1", acc_g)
            acc_u = tl.dot_scaled(a, None, "bf16", b_u, s_u, "e2m1", acc_u)
            if LOOKAHEAD:
                b_g, s_g, b_u, s_u = nb_g, ns_g, nb_u, ns_u
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
    HAS_BIAS: tl.constexpr, MXFP4: tl.constexpr, LOOKAHEAD: tl.constexpr,
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
    if LOOKAHEAD:
        b, scale = _mxfp4_tile(b_ptrs, s_ptrs, nmask, True)
    for k0 in range(0, INTER, BLOCK_K):
        if MXFP4:
            if not LOOKAHEAD:
                b, scale = _mxfp4_tile(b_ptrs, s_ptrs, nmask, True)
            a = tl.load(a_ptrs, mask=valid[:, None], other=0.0).to(tl.bfloat16)
            a_ptrs += BLOCK_K * stride_ii
            b_ptrs += (BLOCK_K // 2) * stride_wk
            s_ptrs += (BLOCK_K // 32) * stride_sk
            if LOOKAHEAD:
                nb, ns = _mxfp4_tile(b_ptrs, s_ptrs, nmask, k0 + BLOCK_K < INTER)
            acc = tl.dot_scaled(a, None, "bf16", b, scale, "e2m1", acc)
            if LOOKAHEAD:
                b, scale = nb, ns
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
