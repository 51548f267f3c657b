"""Reference models built from opsdb ops, written as plainly as the papers.

``Decoder`` is a Llama/Qwen-style decoder for prefill: ``forward(input_ids, positions)``
over requests packed along dim 0; attention reads its metadata from the forward context
(the runner prepares it), or, called eagerly with ``seq_lens=[...]``, prepares its own.
``MLP`` is a plain per-token network: the generic kind of model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from graphcap.core.context import forward_context
from graphcap.opsdb.activation import SILU_AND_MUL
from graphcap.opsdb.attention import ATTENTION, get_backend
from graphcap.opsdb.moe import MOE_EXPERTS, MOE_TOPK_SOFTMAX
from graphcap.opsdb.norm import FUSED_ADD_RMS_NORM
from graphcap.opsdb.qkv import QKV_NORM_ROPE
from graphcap.opsdb.reference import rope_cache


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 256
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    intermediate: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position: int = 4096
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before rotary
    tie_embeddings: bool = False  # the LM head reuses the embedding matrix
    experts: int = 0  # > 0: mixture-of-experts feed-forward (Qwen3-MoE style)
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = True  # renormalise the top-k routing weights
    qkv_bias: bool = False  # Qwen2: biases on the q, k, v projections


class Attention(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.a = a
        self.qkv = nn.Linear(a.hidden, (a.heads + 2 * a.kv_heads) * a.head_dim,
                             bias=a.qkv_bias)
        self.o = nn.Linear(a.heads * a.head_dim, a.hidden, bias=False)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))

    def forward(self, x, positions, cos_sin):
        a, t = self.a, x.shape[0]
        # Split q/k/v, RMSNorm each head of q and k (Qwen3), rotate: one kernel.
        norms = (self.q_norm, self.k_norm) if a.qk_norm else (None, None)
        q, k, v = QKV_NORM_ROPE(self.qkv(x), positions, *norms, cos_sin, a.heads,
                                a.kv_heads, a.head_dim, a.eps)
        out = torch.empty(t, a.heads, a.head_dim, dtype=x.dtype, device=x.device)
        ATTENTION(q, k, v, out, 1.0 / math.sqrt(a.head_dim))
        return self.o(out.view(t, a.heads * a.head_dim))


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.gate_up = nn.Linear(a.hidden, 2 * a.intermediate, bias=False)
        self.down = nn.Linear(a.intermediate, a.hidden, bias=False)

    def forward(self, x):
        return self.down(SILU_AND_MUL(self.gate_up(x)))


class MoE(nn.Module):
    """Top-k softmax routing over ``experts`` SwiGLU experts (Qwen3-MoE style)."""

    def __init__(self, a: ModelArgs):
        super().__init__()
        self.top_k, self.norm_topk = a.top_k, a.norm_topk
        self.router = nn.Linear(a.hidden, a.experts, bias=False)
        scale = a.hidden ** -0.5
        self.w13 = nn.Parameter(torch.randn(a.experts, 2 * a.moe_intermediate, a.hidden)
                                * scale)
        self.w2 = nn.Parameter(torch.randn(a.experts, a.hidden, a.moe_intermediate)
                               * a.moe_intermediate ** -0.5)

    def forward(self, x):
        weights, ids = MOE_TOPK_SOFTMAX(self.router(x), self.top_k, self.norm_topk)
        return MOE_EXPERTS(x, self.w13, self.w2, weights, ids)


class Block(nn.Module):
    def __init__(self, a: ModelArgs):
        super().__init__()
        self.eps = a.eps
        self.attn_norm = nn.Parameter(torch.ones(a.hidden))
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden))
        self.attn = Attention(a)
        self.mlp = MoE(a) if a.experts else FeedForward(a)

    def forward(self, x, residual, positions, cos_sin):
        FUSED_ADD_RMS_NORM(x, residual, self.attn_norm, self.eps)  # residual += x; x = norm
        x = self.attn(x, positions, cos_sin)
        FUSED_ADD_RMS_NORM(x, residual, self.mlp_norm, self.eps)
        return self.mlp(x)


class Decoder(nn.Module):
    """Token ids [T] and positions [T] of packed requests -> logits [T, vocab], or with
    ``logits="last"`` (prefill producing one token) logits [requests, vocab] of each
    request's last token."""

    def __init__(self, a: ModelArgs, logits: str = "all"):
        super().__init__()
        if logits not in ("all", "last"):
            raise ValueError(f"logits={logits!r}: choose 'all' (every token) or 'last' "
                             "(each request's last token)")
        self.args = a
        self.output_rows = "tokens" if logits == "all" else "requests"
        self.embed = nn.Embedding(a.vocab_size, a.hidden)
        self.blocks = nn.ModuleList(Block(a) for _ in range(a.layers))
        self.norm = nn.Parameter(torch.ones(a.hidden))
        self.lm_head = nn.Linear(a.hidden, a.vocab_size, bias=False)
        if a.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("cos_sin", rope_cache(a.head_dim, a.max_position, a.rope_theta),
                             persistent=False)

    def reset_rope(self, device) -> None:
        """Recompute the rotary cache (after building on the meta device)."""
        a = self.args
        self.cos_sin = rope_cache(a.head_dim, a.max_position, a.rope_theta).to(device)

    def forward(self, input_ids, positions, last_rows=None, seq_lens=None):
        """``last_rows`` [requests] (``logits="last"``): the row of each request's last
        token; the runner passes it, an eager call with ``seq_lens`` derives it."""
        if seq_lens is not None:  # eager use: prepare this batch's attention metadata
            meta = get_backend(None, input_ids.device).prepare(seq_lens, input_ids.device)
            if self.output_rows == "requests":
                last_rows = meta.last_token_rows()
            with forward_context(attention=meta):
                return self.forward(input_ids, positions, last_rows)
        x = self.embed(input_ids)
        residual = torch.zeros_like(x)
        for block in self.blocks:
            x = block(x, residual, positions, self.cos_sin)
        if self.output_rows == "requests":  # only the last token of each request
            if last_rows is None:
                raise ValueError("a Decoder built with logits='last' needs last_rows (or "
                                 "seq_lens=[...] in an eager call)")
            x, residual = x[last_rows], residual[last_rows]
        FUSED_ADD_RMS_NORM(x, residual, self.norm, self.args.eps)
        return self.lm_head(x)


class MLP(nn.Module):
    """A per-token MLP: rows never mix, the simplest generic model."""

    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, width))

    def forward(self, x):
        return self.net(x)
