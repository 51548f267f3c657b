"""The peer ``graphcap bench decode`` has to beat: the gpt-fast recipe
(https://github.com/pytorch-labs/gpt-fast) for a preset, on the same weights.

What a user writes instead of graphcap for fast decode: a static K/V cache
``[batch, kv_heads, max_len, head_dim]`` per layer, each layer's its own buffer (as
gpt-fast's ``KVCache`` modules hold them), written at the step's position; attention by
``scaled_dot_product_attention`` over the whole cache under a mask of the positions
written so far, the key/value heads repeated to the query heads as gpt-fast does
(``gqa=True``: SDPA's ``enable_gqa`` instead); plain torch ops for the rest (RMSNorm in
float32, neox rotary, SwiGLU); the step compiled with
``torch.compile(mode="reduce-overhead", fullgraph=True)`` (Inductor's kernels, replayed
from CUDA graphs). As gpt-fast's ``generate.py`` runs it: Inductor's coordinate-descent
tuning on while it compiles, the cache's length rounded up to a multiple of 8, and each
step under SDPA's math backend (``math=True``; "better for Inductor to codegen attention
here"), or under SDPA's own choice of kernel (``math=False``). Dense presets only:
windows, sinks, soft-capping and experts are not part of the recipe.

gpt-fast compiles one batch size and cache length a process, so its shapes are static; the
bench compiles a step per arm, batch size and context in one process, where Dynamo's
automatic dynamic shapes would compile every step after a shape changed with symbolic
sizes (batch 8's after batch 1's): each is compiled with ``dynamic=False``.

Every layer's cache as a slice of one ``[layers, batch, ...]`` buffer made Inductor copy
whole slices of it each step: qwen3-0.6b at batch 8 took 12.2 ms a step against 2.67 with
a buffer per layer (1.64 with ``enable_gqa``;
``docs/results/2026-12-04-gptfast-probe-940b2e3-h200.json``).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from graphcap import compat
from graphcap.models.decoder import Decoder


def _rms_norm(x, weight, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * weight


class StaticCacheDecoder(nn.Module):
    """One decode step of ``model``'s weights (shared, not copied) for ``batch`` requests
    over a static cache of ``max_len`` positions: ``forward(ids [batch, 1], pos [1])`` ->
    logits [batch, vocab]. ``gqa``: attention by SDPA's ``enable_gqa`` rather than the
    key/value heads repeated to the query heads."""

    def __init__(self, model: Decoder, batch: int, max_len: int, gqa: bool = False):
        super().__init__()
        a = model.args
        refused = [name for name, on in (("a window", a.window), ("sinks", a.sinks),
                                         ("soft-capping", a.softcap), ("experts", a.experts),
                                         ("a q/k/v bias", a.qkv_bias), ("an o bias", a.o_bias))
                   if on]
        if refused or model.tp is not None:
            raise ValueError(f"the gpt-fast recipe covers dense decoders; this preset has "
                             f"{', '.join(refused) or 'tensor parallelism'}")
        self.model, self.a, self.gqa = model, a, gqa
        max_len = -(-max_len // 8) * 8  # as gpt-fast's setup_caches rounds it
        dev, dtype = model.norm.device, model.norm.dtype
        shape = (batch, a.kv_heads, max_len, a.head_dim)
        for i in range(a.layers):
            for kind in "kv":
                self.register_buffer(f"{kind}_cache{i}",
                                     torch.randn(shape, device=dev, dtype=dtype),
                                     persistent=False)
        self.register_buffer("causal", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool,
                                                             device=dev)), persistent=False)

    def cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value cache buffers."""
        return getattr(self, f"k_cache{layer}"), getattr(self, f"v_cache{layer}")

    def attend(self, layer: int, q, k, v, pos, mask) -> torch.Tensor:
        """Layer ``layer``'s new ``k``, ``v`` [batch, kv_heads, 1, head_dim] written to its
        cache at ``pos``, then SDPA of ``q`` [batch, heads, 1, head_dim] over the cache."""
        k_cache, v_cache = self.cache(layer)
        k_cache[:, :, pos] = k
        v_cache[:, :, pos] = v
        if self.gqa:
            return F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                  enable_gqa=True)
        group = self.a.heads // self.a.kv_heads  # gpt-fast expands the cache's heads
        return F.scaled_dot_product_attention(q, k_cache.repeat_interleave(group, dim=1),
                                              v_cache.repeat_interleave(group, dim=1),
                                              attn_mask=mask)

    def _rope(self, x, cos, sin):
        rot = cos.shape[-1] * 2
        x1, x2, rest = x[..., : rot // 2], x[..., rot // 2: rot], x[..., rot:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        return torch.cat((out, rest), -1) if rest.shape[-1] else out

    def forward(self, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        a, m = self.a, self.model
        b = ids.shape[0]
        x = m.embed.weight[ids]  # [b, 1, hidden]
        cos_sin = m.cos_sin[pos].float()  # [1, rot]
        half = cos_sin.shape[-1] // 2
        cos, sin = cos_sin[:, :half], cos_sin[:, half:]
        mask = self.causal[None, None, pos]  # [1, 1, 1, max_len]
        q_size, kv_size = a.heads * a.head_dim, a.kv_heads * a.head_dim
        for i, block in enumerate(m.blocks):
            attn = block.attn
            qkv = F.linear(_rms_norm(x, block.attn_norm, a.eps), attn.qkv.weight)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(b, 1, a.heads, a.head_dim)
            k = k.view(b, 1, a.kv_heads, a.head_dim)
            v = v.view(b, 1, a.kv_heads, a.head_dim)
            if a.qk_norm:
                q, k = _rms_norm(q, attn.q_norm, a.eps), _rms_norm(k, attn.k_norm, a.eps)
            q = self._rope(q.float(), cos, sin).type_as(x).transpose(1, 2)
            k = self._rope(k.float(), cos, sin).type_as(x).transpose(1, 2)
            y = self.attend(i, q, k, v.transpose(1, 2), pos, mask)
            x = x + F.linear(y.transpose(1, 2).reshape(b, 1, q_size), attn.o.weight)
            gate, up = F.linear(_rms_norm(x, block.mlp_norm, a.eps),
                                block.mlp.gate_up.weight).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, block.mlp.down.weight)
        return F.linear(_rms_norm(x, m.norm, a.eps), m.lm_head.weight)[:, 0]


def compiled_step(model: Decoder, ids: torch.Tensor, pos: torch.Tensor, max_len: int,
                  gqa: bool = False, math: bool = True, warmup: int = 3):
    """``step(ids [batch, 1], pos [1])``: the recipe's decode step, compiled as gpt-fast
    compiles it, on ``ids`` and ``pos`` ``warmup`` times (compiling, recording the graph)
    before it is returned."""
    module = StaticCacheDecoder(model, ids.shape[0], max_len, gqa)
    # Static shapes, as gpt-fast's one compile a process has them (see the module's notes).
    compiled = torch.compile(module, mode="reduce-overhead", fullgraph=True, dynamic=False)
    backend = (lambda: sdpa_kernel(SDPBackend.MATH)) if math else contextlib.nullcontext

    def step(ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        # as gpt-fast decodes: the cache written in place, attention's backend per step
        with torch.no_grad(), backend():
            return compiled(ids, pos)

    # gpt-fast sets the tuning for its whole process; here only while the step compiles.
    # One compiled module per batch size and context shares the forward's code: room for
    # each (Dynamo otherwise runs it eagerly past its recompile limit, silently), for
    # these compiles alone.
    with torch._inductor.config.patch(coordinate_descent_tuning=True), \
            compat.allow_recompiles(64):
        for _ in range(warmup):
            step(ids, pos)
    return step


__all__ = ["StaticCacheDecoder", "compiled_step"]
