"""Torch reference implementations of every opsdb op: the specification kernels are
tested against. Plain, readable, computed in float32 and cast back to the input dtype.

Shapes: T tokens, H hidden, Hq / Hk query / key-value heads, D head dim, R requests,
E experts, I expert intermediate size, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcap.opsdb import mxfp4


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dim. x [T, H], weight [H]."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (normed * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> None:
    """In place: ``residual <- x + residual``; ``x <- rms_norm(residual)``."""
    total = x.float() + residual.float()
    residual.copy_(total.to(residual.dtype))
    x.copy_(rms_norm(total, weight, eps).to(x.dtype))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2*I] -> silu(x[:, :I]) * x[:, I:], shape [T, I]."""
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def rope_cache(rot_dim: int, max_position: int, theta: float) -> torch.Tensor:
    """The neox cos/sin cache [max_position, rot_dim]: cos in the first half, sin in the
    second, frequencies ``theta ** (-2i / rot_dim)``, float32."""
    inv = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def rotary_embedding(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                     cos_sin_cache: torch.Tensor, head_size: int) -> None:
    """Neox-style rotary embedding, in place on ``query`` [T, Hq*D] and ``key`` [T, Hk*D].

    ``cos_sin_cache`` [max_position, rot_dim] holds cos in its first half and sin in its
    second; the first ``rot_dim`` (<= head_size) dims of each head rotate, pairing dim i
    with dim i + rot_dim/2.
    """
    rot = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)  # [T, rot/2]
    for t in (query, key):
        heads = t.view(t.shape[0], t.shape[1] // head_size, head_size)
        x = heads[..., :rot].float()
        x1, x2 = x.chunk(2, dim=-1)
        c, s = cos[:, None, :], sin[:, None, :]
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
        heads[..., :rot] = rotated.to(t.dtype)


def attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float, causal: bool = True,
                     window: int = 0, softcap: float = 0.0,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill attention over requests packed along dim 0 (no KV cache).

    q [T, Hq, D], k and v [T, Hk, D] with Hq a multiple of Hk (GQA); ``cu_seqlens``
    [R + 1] int32 offsets of each request (zero-length requests allowed). Rows past
    ``cu_seqlens[-1]`` (padding) come out zero. ``window``, ``softcap`` and ``sinks``:
    :mod:`graphcap.opsdb.attention.variant` (each request's tokens at positions 0, 1, ...).
    """
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end <= start:
            continue
        qs = q[start:end].float().transpose(0, 1)  # [Hq, L, D]
        ks = k[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        vs = v[start:end].float().transpose(0, 1).repeat_interleave(group, dim=0)
        pos = torch.arange(end - start, device=q.device)
        seen = seen_keys(pos, pos, causal, window)
        out[start:end] = softmax_v(qs @ ks.transpose(1, 2) * scale, seen, vs, softcap,
                                    sinks).transpose(0, 1).to(q.dtype)
    return out


def seen_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: int
              ) -> torch.Tensor:
    """``[Lq, Lk]``: which keys each query sees (causal: none after it; a window: none
    ``window`` or more positions before it)."""
    seen = torch.ones(q_pos.shape[0], k_pos.shape[0], dtype=torch.bool, device=q_pos.device)
    if causal:
        seen &= k_pos[None, :] <= q_pos[:, None]
    if window > 0:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen


def softmax_v(scores: torch.Tensor, seen: torch.Tensor, v: torch.Tensor, softcap: float,
              sinks: torch.Tensor | None) -> torch.Tensor:
    """``softmax(scores) @ v`` in float32 over the ``seen`` keys (scores ``[H, Lq, Lk]``,
    ``v`` ``[H, Lk, D]``), scores soft-capped first, a sink logit per head joining the
    softmax without a value; a row that sees no key comes out zero."""
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~seen, float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        scores = torch.cat([scores, sink], dim=-1)
    any_seen = seen.any(dim=-1)[None, :, None]
    probs = torch.where(any_seen | (sinks is not None), scores, 0.0).softmax(-1)
    probs = probs[..., :v.shape[1]] * any_seen
    return probs @ v


def moe_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, then the top-k: weights [T, k] float32, ids [T, k] int32, by
    decreasing logit (so by decreasing probability), ties to the lowest expert id, a NaN
    logit above every other (as torch.topk ranks them). The experts are chosen by their
    logits, not their float32 probabilities: two logits a few units in the last place
    apart (or 0 and 1e-8) can round to one probability, which would hand the choice to
    the lower id where torch.topk over the logits (gpt-oss's router) takes the larger one.
    A NaN or +inf logit makes its row's weights NaN."""
    logits = router_logits.float()
    probs = logits.softmax(dim=-1)
    ids = logits.sort(dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(-1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    # Both [T, k] contiguous, as the kernels give, whatever the logits' layout (the
    # sort of column-major logits is column-major, and so were the ids cast from it).
    return (weights.contiguous(),
            ids.to(torch.int32, memory_format=torch.contiguous_format))


# MXFP4's 4-bit values (E2M1), by code: the low 3 bits the magnitude, the high bit the sign.
FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def mxfp4_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 (the OCP microscaling format gpt-oss ships its experts in) to float32:
    ``packed`` [..., K // 2] uint8, two 4-bit E2M1 values a byte, the low nibble first;
    ``scales`` [..., K // 32] uint8, a power of two biased by 127 (E8M0) for each block of
    32 values -> [..., K]."""
    table = torch.tensor(FP4, dtype=torch.float32, device=packed.device)
    values = torch.stack((table[(packed & 0x0F).long()], table[(packed >> 4).long()]), -1)
    values = values.flatten(-2).unflatten(-1, (scales.shape[-1], 32))
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                b13: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                alpha: float = 0.0, limit: float = 0.0, interleaved: bool = False,
                w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped gated experts. x [T, H]; w13 [E, 2*I, H] (gate rows, then up rows; with
    ``interleaved`` gate and up alternate, as gpt-oss stores them) and its bias b13
    [E, 2*I], laid out alike; w2 [E, H, I] and its bias b2 [E, H]; out[t] = sum_j
    topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]), an expert being
    ``w2 @ act(gate, up) + b2`` of ``(gate, up) = w13 @ x + b13``: ``act`` is SwiGLU
    (``silu(gate) * up``) with ``alpha == 0``, else gpt-oss's clamped GLU
    (:func:`clamped_glu`).

    MXFP4 experts (``w13_scale`` and ``w2_scale`` given): w13 [E, 2*I, H // 2] and w2
    [E, H, I // 2] uint8 with their E8M0 scales [E, 2*I, H // 32] and [E, H, I // 32]
    (:func:`mxfp4_dequantize`), or both in the operand order of :mod:`graphcap.opsdb.mxfp4`;
    x and the activation between the projections are rounded to bfloat16, the products
    of the dequantized values accumulate in float32.

    A slot whose id lies outside ``[0, E)`` (expert parallelism's -1, say) is routed to
    no expert: it adds nothing (the kernels' contract too; the ids are not checked, which
    would synchronise with the host).

    Dense over experts (every expert sees every token, and adds nothing where it is not
    routed): slow but free of data-dependent shapes, so the reference itself can be
    captured."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    quantized = w13_scale is not None
    if quantized and mxfp4.is_operand_order(w13):
        w13, w13_scale = mxfp4.published_order(w13, w13_scale, True, interleaved)
        w2, w2_scale = mxfp4.published_order(w2, w2_scale, False, False)
    x32 = x.to(torch.bfloat16).float() if quantized else x.float()
    inter = w13.shape[1] // 2
    for e in range(w13.shape[0]):
        routed = topk_ids == e  # [T, k]
        weight = (topk_weights.float() * routed).sum(dim=-1, keepdim=True)  # [T, 1]
        w13_e = mxfp4_dequantize(w13[e], w13_scale[e]) if quantized else w13[e].float()
        w2_e = mxfp4_dequantize(w2[e], w2_scale[e]) if quantized else w2[e].float()
        gate_up = x32 @ w13_e.t()
        if b13 is not None:
            gate_up = gate_up + b13[e].float()
        if interleaved:  # to gate rows, then up rows
            gate_up = torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=-1)
        if alpha:
            h = clamped_glu(gate_up[:, :inter], gate_up[:, inter:], alpha, limit)
        else:
            h = silu_and_mul(gate_up)
        if quantized:
            h = h.to(torch.bfloat16).float()
        y = h @ w2_e.t()
        if b2 is not None:
            y = y + b2[e].float()
        # A token not routed here takes nothing of it, even where y is not finite.
        out += torch.where(routed.any(dim=-1, keepdim=True), weight * y, 0.0)
    return out.to(x.dtype)


def clamped_glu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float
                ) -> torch.Tensor:
    """gpt-oss's expert activation: ``(up + 1) * gate * sigmoid(alpha * gate)``, gate
    clamped from above and up to ``[-limit, limit]`` first (``limit`` 0: no clamp)."""
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * gate * torch.sigmoid(alpha * gate)
