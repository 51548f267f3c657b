"""Attention in plain torch: ``torch_varlen`` (a host loop over requests, eager only) and
``torch_masked`` (one attention under a block-diagonal causal mask built on the device)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from graphcap.opsdb.attention.base import (
    AttentionBackend,
    AttentionMetadata,
    guard_kv,
    zero_padding_rows,
)
from graphcap.opsdb.attention.variant import OPTIONS, PLAIN, Variant
from graphcap.opsdb.reference import attention_varlen, seen_keys, softmax_v


def _sdpa(q, k, v, scale, mask=None, causal=False):
    """q [L, Hq, D], k/v [L, Hk, D] -> [L, Hq, D], GQA by repeating kv heads."""
    group = q.shape[1] // k.shape[1]
    qh, kh, vh = (t.transpose(0, 1) for t in (q, k, v))
    if group > 1:
        kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, is_causal=causal, scale=scale).transpose(0, 1)


class TorchVarlen(AttentionBackend):
    """Loops over the requests with their host lengths: exact and simple, but the loop
    is Python on the host, so it runs as a break (breakable) or split op (tc_piecewise)."""

    name = "torch_varlen"
    static_metadata = False
    options = frozenset(OPTIONS)

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        if variant.used:  # SDPA has no sinks nor soft-capping: the reference, per request
            out.copy_(attention_varlen(q, k, v, meta.cu_seqlens_host, scale, True,
                                       variant.window, variant.softcap, variant.sinks))
            return
        out.zero_()
        start = 0
        for n in meta.seq_lens:
            if n:
                end = start + n
                out[start:end] = _sdpa(q[start:end], k[start:end], v[start:end], scale,
                                       causal=True)
                start = end


class TorchMasked(AttentionBackend):
    """One attention over the whole bucket with a block-diagonal causal mask computed on
    the device from per-token request ids: no host lengths inside, so it captures. The
    mask is applied by assignment (``masked_fill``), and k and v pass through ``guard_kv``,
    so a NaN or an infinity in one request never reaches another's rows (SDPA adds a
    boolean mask as ``-inf``, and NaN + -inf is NaN)."""

    name = "torch_masked"
    options = frozenset(OPTIONS)

    def metadata(self, num_tokens, num_slots, device):
        meta = super().metadata(num_tokens, num_slots, device)
        meta.request_ids = torch.full((num_tokens,), -1, dtype=torch.int32, device=device)
        return meta

    def plan(self, meta: AttentionMetadata) -> None:
        ids = [i for i, n in enumerate(meta.seq_lens) for _ in range(n)]
        ids += [-1] * (meta.num_tokens - len(ids))  # padding rows: their own request
        meta.request_ids.copy_(torch.tensor(ids, dtype=torch.int32), non_blocking=True)

    def forward(self, q, k, v, out, meta: AttentionMetadata, scale: float,
                variant: Variant = PLAIN) -> None:
        rid = meta.request_ids
        rows = torch.arange(rid.shape[0], device=rid.device)
        # Rows of one request sit side by side: a window over rows is one over positions.
        allowed = (rid[:, None] == rid[None, :]) & seen_keys(rows, rows, True, variant.window)
        k, v = guard_kv(k, v, meta)
        group = q.shape[1] // k.shape[1]
        qh, kh, vh = (t.transpose(0, 1).float() for t in (q, k, v))  # [H, T, D]
        if group > 1:
            kh, vh = kh.repeat_interleave(group, 0), vh.repeat_interleave(group, 0)
        scores = (qh @ kh.transpose(1, 2)).mul_(scale)
        out.copy_(softmax_v(scores, allowed, vh, variant.softcap, variant.sinks)
                  .transpose(0, 1))
        zero_padding_rows(out, meta)
