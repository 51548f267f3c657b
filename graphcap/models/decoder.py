"""Reference models built from opsdb ops, written as plainly as the papers.

``Decoder`` is a Llama/Qwen-style decoder for prefill: ``forward(input_ids, positions)``
over requests packed along dim 0; attention reads its metadata from the forward context
(the runner prepares it), or, called eagerly with ``seq_lens=[...]``, prepares its own.
``MLP`` is a plain per-token network: a model of tensors along dim 0.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn

from graphcap import compat
from graphcap.core.checks import check_last_tokens, check_prefill, check_ranges
from graphcap.errors import UnsupportedModel
from graphcap.kv import longest_window
from graphcap.models.blocks import (
    AttentionLayer,
    AttentionWeights,
    attention_half,
    moe_half,
    swiglu_half,
)
from graphcap.models.rope import Scaling, rotary_cache
from graphcap.opsdb import cuda as cuda_kernels
from graphcap.opsdb import mxfp4
from graphcap.opsdb.attention.packed import packed
from graphcap.opsdb.collective import ALL_GATHER
from graphcap.opsdb.linear import RMS_NORM_LINEAR


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
    # Attention variants (graphcap.opsdb.attention.variant): a sliding window on the
    # windowed layers (0: none), every ``global_every``-th layer full (0: none is; gpt-oss
    # alternates, 2; Gemma 3 has five local layers to one global, 6), soft-capped scores
    # (Gemma 2), a learned sink logit per query head (gpt-oss).
    window: int = 0
    global_every: int = 0
    softcap: float = 0.0
    sinks: bool = False
    # gpt-oss: a bias on the output projection, biases on the router and the experts, the
    # experts' clamped GLU (glu_alpha > 0; reference.clamped_glu). ``rope_scaling``: the
    # rotary frequencies scaled (graphcap.models.rope: YaRN for gpt-oss, Llama 3.1's).
    o_bias: bool = False
    moe_bias: bool = False
    glu_alpha: float = 0.0
    glu_limit: float = 0.0
    rope_scaling: Scaling | None = None
    # gpt-oss as shipped: the experts' weights in MXFP4 (4-bit values, a power-of-two
    # scale per 32; gate and up rows interleaved), everything else in the model's dtype.
    moe_mxfp4: bool = False

    def window_of(self, layer: int) -> int:
        """The sliding window of layer ``layer`` (0: full attention)."""
        if self.global_every and layer % self.global_every == self.global_every - 1:
            return 0
        return self.window

    @property
    def attention_options(self) -> tuple[str, ...]:
        """The variant options its layers use (a backend must compute them)."""
        used = {"window": any(self.window_of(i) for i in range(self.layers)),
                "softcap": self.softcap > 0, "sinks": self.sinks}
        return tuple(o for o, on in used.items() if on)


def shard_args(a: ModelArgs, size: int) -> ModelArgs:
    """The layer shapes of one rank's share of a model of ``ModelArgs`` ``a`` split
    ``size`` ways; ``UnsupportedModel`` naming the first size ``size`` does not divide
    (``kv_heads`` first: the tightest bound). The feed-forward a model has is split: the
    dense ``intermediate``, or the experts' ``moe_intermediate`` (the other, unused, is
    neither checked nor split)."""
    if a.moe_mxfp4 and size > 1:
        raise UnsupportedModel(
            "tensor parallelism does not split MXFP4 experts yet: run the MXFP4 model on "
            "one GPU, or its bfloat16 twin (moe_mxfp4=False) across ranks")
    # An MoE model's layers have no dense feed-forward: its experts' columns are split.
    ffn = ("moe_intermediate", a.moe_intermediate) if a.experts else \
        ("intermediate", a.intermediate)
    sizes = dict([("kv_heads", a.kv_heads), ("heads", a.heads), ffn,
                  ("vocab_size", a.vocab_size)])
    for field, value in sizes.items():
        if value % size:
            raise UnsupportedModel(
                f"tensor parallelism over {size} ranks does not divide {field} {value}: "
                f"use a TP size that divides {field} (whole heads and columns per rank)")
    return dataclasses.replace(
        a, heads=a.heads // size, kv_heads=a.kv_heads // size,
        intermediate=a.intermediate if a.experts else a.intermediate // size,
        moe_intermediate=a.moe_intermediate // size if a.experts else a.moe_intermediate)


class Attention(nn.Module):
    def __init__(self, a: ModelArgs, layer: int = 0, tp: str | None = None):
        super().__init__()
        self.a, self.layer, self.tp = a, layer, tp  # its layer of a K/V cache; TP group
        self.window = a.window_of(layer)
        self.qkv = nn.Linear(a.hidden, (a.heads + 2 * a.kv_heads) * a.head_dim,
                             bias=a.qkv_bias)
        self.o = nn.Linear(a.heads * a.head_dim, a.hidden, bias=a.o_bias)
        if a.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(a.head_dim))
            self.k_norm = nn.Parameter(torch.ones(a.head_dim))
        self.sinks = nn.Parameter(torch.randn(a.heads)) if a.sinks else None

    def forward(self, h, norm, positions, cos_sin):
        """h + attention(rms_norm(h))."""
        # Split q/k/v, RMSNorm each head of q and k (Qwen3), rotate: one kernel.
        norms = (self.q_norm, self.k_norm) if self.a.qk_norm else (None, None)
        return attention_half(h, positions, AttentionWeights(
            norm, self.qkv.weight, self.o.weight, cos_sin, self.qkv.bias, *norms,
            o_bias=self.o.bias, sinks=self.sinks), self.spec)

    @property
    def spec(self) -> AttentionLayer:
        """What the layer is now (its cache layer and TP group may be set after it is
        built: ``layer = None`` keeps no cache)."""
        a = self.a
        return AttentionLayer(a.heads, a.kv_heads, a.head_dim, 1.0 / math.sqrt(a.head_dim),
                              a.eps, a.eps, self.layer, self.tp, self.window, a.softcap)


class FeedForward(nn.Module):
    def __init__(self, a: ModelArgs, tp: str | None = None):
        super().__init__()
        self.eps, self.tp = a.eps, tp
        self.gate_up = nn.Linear(a.hidden, 2 * a.intermediate, bias=False)
        self.down = nn.Linear(a.intermediate, a.hidden, bias=False)

    def forward(self, h, norm):
        """h + down(silu(gate) * up) of rms_norm(h)."""
        return swiglu_half(h, norm, self.eps, self.gate_up.weight, self.down.weight, self.tp)


class MoE(nn.Module):
    """Top-k softmax routing over ``experts`` gated experts: SwiGLU (Qwen3-MoE), or with
    biases and the clamped GLU (gpt-oss: ``moe_bias``, ``glu_alpha``, ``glu_limit``)."""

    def __init__(self, a: ModelArgs, tp: str | None = None):
        super().__init__()
        self.eps, self.top_k, self.norm_topk, self.tp = a.eps, a.top_k, a.norm_topk, tp
        self.glu = (a.glu_alpha, a.glu_limit)
        self.router = nn.Linear(a.hidden, a.experts, bias=a.moe_bias)
        self.interleaved = a.moe_mxfp4  # as gpt-oss's checkpoints store gate and up
        self.w13_scale = self.w2_scale = None
        if a.moe_mxfp4:
            self.w13, self.w13_scale = _mxfp4_weight(a.experts, 2 * a.moe_intermediate,
                                                     a.hidden)
            self.w2, self.w2_scale = _mxfp4_weight(a.experts, a.hidden, a.moe_intermediate)
        else:
            # Scaled in place: a scaled copy would leave each expert tensor's unscaled
            # twin (gigabytes at gpt-oss sizes) freed among the weights, cached by the
            # allocator in segments the weights keep alive.
            self.w13 = nn.Parameter(torch.randn(a.experts, 2 * a.moe_intermediate,
                                                a.hidden).mul_(a.hidden ** -0.5))
            self.w2 = nn.Parameter(torch.randn(a.experts, a.hidden, a.moe_intermediate)
                                   .mul_(a.moe_intermediate ** -0.5))
        self.b13 = self.b2 = None
        if a.moe_bias:
            self.b13 = nn.Parameter(torch.randn(a.experts, 2 * a.moe_intermediate).mul_(0.1))
            self.b2 = nn.Parameter(torch.randn(a.experts, a.hidden).mul_(0.1))

    def to_operand_order(self) -> str | None:
        """Reorders MXFP4 experts in place into the operand order of graphcap's CUDA
        kernel (:mod:`graphcap.opsdb.mxfp4`; 1.5-2.6x faster on the H200 than the Triton
        kernels that read the published order); returns why not, or None once so."""
        if self.w13_scale is None:
            return "the experts are not MXFP4"
        if mxfp4.is_operand_order(self.w13):
            return None
        why = (("the experts are not on a CUDA device" if self.w13.device.type != "cuda"
                else None)  # first: a meta or CPU tensor's scales are not read
               or mxfp4.why_not(self.w13, self.w13_scale) or mxfp4.why_not(self.w2, self.w2_scale)
               or cuda_kernels.unavailable())
        if why is None and not cuda_kernels.builds("moe_mxfp4"):
            why = "its CUDA kernel did not build"
        if why:
            return why
        for name, gate_up in (("w13", True), ("w2", False)):
            w, s = mxfp4.to_operand_order_(getattr(self, name).data,
                                           getattr(self, name + "_scale").data, gate_up,
                                           self.interleaved and gate_up)
            setattr(self, name, nn.Parameter(w, requires_grad=False))
            setattr(self, name + "_scale", nn.Parameter(s, requires_grad=False))
        return None

    def forward(self, h, norm):
        """h + the routed experts of rms_norm(h)."""
        return moe_half(h, norm, self.eps, self.router.weight, self.top_k, self.norm_topk,
                        self.w13, self.w2, self.tp, self.router.bias, self.b13, self.b2,
                        *self.glu, self.interleaved, self.w13_scale, self.w2_scale)


def experts_to_operand_order(model: nn.Module) -> None:
    """Every MXFP4 expert layer of ``model`` on a GPU in the CUDA kernel's operand order
    (:meth:`MoE.to_operand_order`; layers that cannot keep the published order)."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.to_operand_order()


def in_kernel_order(model: nn.Module) -> nn.Module:
    """``model``, its MXFP4 experts put in the CUDA kernel's order
    (:func:`experts_to_operand_order`)."""
    experts_to_operand_order(model)
    return model


def _mxfp4_weight(experts: int, rows: int, cols: int) -> tuple[nn.Parameter, nn.Parameter]:
    """Random MXFP4 weights [experts, rows, cols // 2] and their scales [experts, rows,
    cols // 32] (uint8, not trained): uniform codes (values of RMS 2.9), scales about
    ``cols ** -0.5 / 2.9``, as the dense experts' initialisation."""
    if cols % 32:
        raise UnsupportedModel(f"MXFP4 experts need sizes that are multiples of 32, got "
                               f"{cols}")
    base = round(127 + math.log2(cols ** -0.5 / 2.9))
    codes = torch.randint(0, 256, (experts, rows, cols // 2), dtype=torch.uint8)
    scales = torch.randint(base - 1, base + 2, (experts, rows, cols // 32), dtype=torch.uint8)
    return (nn.Parameter(codes, requires_grad=False),
            nn.Parameter(scales, requires_grad=False))


class Block(nn.Module):
    """A pre-norm layer: h + attention(norm(h)), then h + mlp(norm(h)). Each norm is fused
    into the matmul after it and each residual add into the matmul before it."""

    def __init__(self, a: ModelArgs, layer: int = 0, tp: str | None = None):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(a.hidden))
        self.mlp_norm = nn.Parameter(torch.ones(a.hidden))
        self.attn = Attention(a, layer, tp)
        self.mlp = MoE(a, tp) if a.experts else FeedForward(a, tp)

    def forward(self, h, positions, cos_sin):
        h = self.attn(h, self.attn_norm, positions, cos_sin)
        return self.mlp(h, self.mlp_norm)


def _plain(block: Block) -> bool:
    """Whether calling ``block`` is :meth:`Block.forward` and nothing else: no hooks, no
    ``forward`` set on it or in a subclass, no ``block.compile()``."""
    return (not compat.runs_hooks(block)
            and getattr(block.forward, "__func__", None) is Block.forward
            and getattr(block, "_compiled_call_impl", None) is None)


class Decoder(nn.Module):
    """Token ids [T] and positions [T] of packed requests -> logits [T, vocab], or with
    ``logits="last"`` (prefill producing one token) logits [requests, vocab] of each
    request's last token. With ``tp`` (a :class:`graphcap.tp.TPGroup`) it is this
    rank's share of the model split across the group (:mod:`graphcap.models.shard`); its
    ``local_args`` are the shapes of its layers, ``args`` those of the whole model."""

    def __init__(self, a: ModelArgs, logits: str = "all", tp=None):
        super().__init__()
        if logits not in ("all", "last"):
            raise ValueError(f"logits={logits!r}: choose 'all' (every token) or 'last' "
                             "(each request's last token)")
        self.args, self.tp = a, tp
        self.local_args = a
        name = None
        if tp is not None:
            self.local_args, name = shard_args(a, tp.size), tp.name
        local = self.local_args
        self.output_rows = "tokens" if logits == "all" else "requests"
        self.embed = nn.Embedding(a.vocab_size, a.hidden)
        self.blocks = nn.ModuleList(Block(local, i, name) for i in range(a.layers))
        self.norm = nn.Parameter(torch.ones(a.hidden))
        self.lm_head = nn.Linear(a.hidden, a.vocab_size // (tp.size if tp else 1),
                                 bias=False)
        if a.tie_embeddings and tp is None:
            self.lm_head.weight = self.embed.weight
        self.register_buffer("cos_sin", rotary_cache(a.head_dim, a.max_position,
                                                     a.rope_theta, a.rope_scaling),
                             persistent=False)

    def reset_rope(self, device) -> None:
        """Recompute the rotary cache (after building on the meta device)."""
        a = self.args
        self.cos_sin = rotary_cache(a.head_dim, a.max_position, a.rope_theta,
                                    a.rope_scaling).to(device)

    def _apply(self, fn, recurse=True):
        """A cast of the model (``.to(torch.bfloat16)``, ``.half()``) leaves the rotary
        cache float32, computed again rather than rounded, as every way of building one
        gives it; a model built on the meta device given memory (``.to_empty()``) has
        its rotary cache computed, not left as the uninitialised memory it got."""
        was_meta = self.cos_sin.is_meta
        super()._apply(fn, recurse)
        if self.cos_sin.dtype != torch.float32 or (was_meta and not self.cos_sin.is_meta):
            self.reset_rope(self.cos_sin.device)
        return self

    graphcap_inputs = "prefill"

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def graphcap_kv(self) -> tuple[int, int, int]:
        """What its paged K/V cache holds per layer (a TP rank: its own key/value heads):
        (layers, kv heads, head dim)."""
        return self.args.layers, self.local_args.kv_heads, self.args.head_dim

    @property
    def max_position(self) -> int:
        return self.args.max_position

    @property
    def graphcap_kv_window(self) -> int:
        """Every layer windowed: the longest window (its cache frees pages behind it), else
        0."""
        return longest_window(self.args.window_of(i) for i in range(self.args.layers))

    @property
    def graphcap_attention_options(self) -> tuple[str, ...]:
        return self.args.attention_options

    graphcap_hidden = True  # forward(..., hidden=True) also returns its hidden states

    def forward(self, input_ids, positions, last_rows=None, seq_lens=None, hidden=False):
        """``last_rows`` [requests] (``logits="last"``): the row of each request's last
        token; the runner passes it, an eager call with ``seq_lens`` derives it.
        ``hidden``: return ``(logits, h)``, ``h`` the last block's output of the same rows
        (the residual stream the final norm takes: what an EAGLE or MTP head reads)."""
        if seq_lens is not None:  # eager use: prepare this batch's attention metadata
            # Checked on the host, as PrefillLM's eager call: positions inside the rotary
            # table (max_position rows), ids inside the embedding table.
            check_prefill(input_ids, positions, seq_lens, input_ids.device)
            check_ranges(input_ids, positions, self.args.vocab_size, self.args.max_position)
            with packed(seq_lens, input_ids.device, dtype=self.norm.dtype,
                        options=self.graphcap_attention_options) as meta:
                if self.output_rows == "requests":
                    check_last_tokens(seq_lens)
                    last_rows = meta.last_token_rows()
                return self.forward(input_ids, positions, last_rows, hidden=hidden)
        # Indexing, not F.embedding: for a few rows of a large table F.embedding's
        # index_select is several times slower than a gather.
        h = self.embed.weight[input_ids]
        for block in self.blocks:
            if not _plain(block):  # hooks, a forward of its own, a compile: its call
                h = block(h, positions, self.cos_sin)
                continue
            # Else half by half, as Block.forward: each half's input is freed as its
            # output is made (a block call holds the block's input through the MLP).
            h = block.attn(h, block.attn_norm, positions, self.cos_sin)
            h = block.mlp(h, block.mlp_norm)
        if self.output_rows == "requests":  # only the last token of each request
            if last_rows is None:
                raise ValueError("a Decoder built with logits='last' needs last_rows (or "
                                 "seq_lens=[...] in an eager call)")
            h = h[last_rows]
        logits = RMS_NORM_LINEAR(h, self.norm, self.args.eps, self.lm_head.weight, None)
        if self.tp is not None:  # each rank's rows of the vocabulary
            logits = ALL_GATHER(logits, -1, self.tp.name)
        return (logits, h) if hidden else logits


class MLP(nn.Module):
    """A per-token MLP: rows never mix, the simplest model of tensors along dim 0."""

    def __init__(self, width: int = 64, depth: int = 3):
        super().__init__()
        layers = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Linear(width, width))

    def forward(self, x):
        return self.net(x)
