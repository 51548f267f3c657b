"""What of a stock transformers decoder graphcap's kernels can run: recognised from the
modules themselves (their parameters and attributes), never from a list of class names.

Each ``recognise_*`` returns the kernels for a part of the model, or the reason it stays
on its stock code. Recognition is structural; :mod:`graphcap.hf.probe` then checks each
recognised part against the stock module on a probe input before it is used.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn

from graphcap.hf.changes import call_time_config, module_values
from graphcap.hf.fuse import Fused, check_fusable
from graphcap.models.blocks import (
    AttentionLayer,
    AttentionWeights,
    attention_half,
    attention_inputs,
    moe_half,
    swiglu_half,
)

# Children a half may have besides the ones it is made of: no-ops at inference.
_INERT = (nn.Dropout, nn.Identity)


def _is_linear(m) -> bool:
    return type(m) is nn.Linear  # a subclass (quantised, LoRA) may compute otherwise


def _is_silu(m) -> bool:
    return isinstance(m, nn.SiLU) or type(m).__name__ == "SiLUActivation"


def _extra(module: nn.Module, known: set[str]) -> list[str]:
    """The children and direct parameters of ``module`` beyond ``known`` and inert ones."""
    names = [n for n, c in module.named_children() if n not in known
             and not isinstance(c, _INERT)]
    return names + [n for n in module._parameters if n not in known]


def rms_norm_of(module, size: int) -> tuple[float, None] | tuple[None, str]:
    """(eps, None) when ``module`` looks like an RMSNorm over ``size`` features."""
    kind = type(module).__name__
    if module is None or not isinstance(module, nn.Module):
        return None, "missing"
    weight = module._parameters.get("weight")
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if "RMSNorm" not in kind or weight is None or weight.dim() != 1:
        return None, f"{kind} is not an RMSNorm with a weight"
    if weight.shape[0] != size:
        return None, f"{kind} normalises {weight.shape[0]} features, not {size}"
    if not isinstance(eps, float) or _extra(module, {"weight"}):
        return None, f"{kind} has more than a weight and a float eps"
    return eps, None


# The pre-norm decoder layer: h + self_attn(input_layernorm(h)), h + mlp(...(h)).
PRE_NORM = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")


def stock_attention(layer, h, kwargs):
    """The attention half on the layer's own modules: h [T, hidden] -> h + self_attn(...)."""
    return h + layer.self_attn(hidden_states=layer.input_layernorm(h[None]), **kwargs)[0][0]


def stock_mlp(layer, h):
    """The MLP half on the layer's own modules: h + mlp(post_attention_layernorm(h))."""
    out = layer.mlp(layer.post_attention_layernorm(h[None]))
    if isinstance(out, tuple):  # gpt-oss's: (hidden states, router scores)
        out = out[0]
    return h + out[0]


# The modules each half's kernels stand in for (with their submodules): none is called.
HALVES = {"attention": ("input_layernorm", "self_attn"),
          "mlp": ("post_attention_layernorm", "mlp")}
# transformers' output-capturing hooks, put on modules for good by the first call asking
# for hidden states, attentions or router logits: inert in graphcap's calls.
_INERT_HOOKS = "transformers.utils.output_capturing"


def hooks(module: nn.Module) -> tuple:
    """The ids of ``module``'s forward pre-hooks and hooks, transformers' inert ones left out."""
    return tuple(k for d in (module._forward_pre_hooks, module._forward_hooks)
                 for k, h in d.items() if getattr(h, "__module__", None) != _INERT_HOOKS)


def skipped_calls(layer, half: str) -> str | None:
    """Why ``half`` of ``layer`` keeps its stock modules: one its kernels stand in for runs
    more than its class's forward when called (a forward hook or pre-hook, a forward set
    on the instance), which the kernels, reading its weights only, would skip."""
    for root in HALVES[half]:
        for name, m in getattr(layer, root).named_modules(prefix=root):
            if hooks(m):
                return f"{name} has forward hooks, which graphcap's kernels would not run"
            if "forward" in m.__dict__:
                return f"{name}'s forward is set on the instance, which graphcap's " \
                       "kernels would not run"
    return None


def pre_norm_layer(layer) -> str | None:
    """Why ``layer`` is not made of the pre-norm layer's four modules only (or None)."""
    missing = [n for n in PRE_NORM if not isinstance(getattr(layer, n, None), nn.Module)]
    if missing:
        return f"{type(layer).__name__} has no {', '.join(missing)}"
    if extra := _extra(layer, set(PRE_NORM)):
        return f"{type(layer).__name__} has {', '.join(extra)} beyond " + ", ".join(PRE_NORM)
    return None


# -- the attention half: h + o(attention(rope(qk_norm(qkv(rms_norm(h)))))) -------------
@dataclass
class AttentionKernels:
    layer: nn.Module
    qkv: Fused | None  # None: the model's own fused qkv_proj
    bias: Fused | None
    eps: float
    qk_eps: float | None
    cos_sin: torch.Tensor
    heads: int
    kv_heads: int
    head_dim: int
    scale: float
    # (window, softcap, sinks) as the stock attention passes them (the probe sets it).
    variant: tuple = (0, 0.0, None)
    name = "attention"
    ops = "rms_norm_linear, qkv_cached_attention (qkv_norm_rope, attention), linear_residual"

    def fused(self) -> list[Fused]:
        return [f for f in (self.qkv, self.bias) if f is not None]

    def _weights(self) -> AttentionWeights:
        attn = self.layer.self_attn
        if self.qkv is None:
            qkv, bias = attn.qkv_proj.weight, attn.qkv_proj.bias
        else:
            qkv, bias = self.qkv.tensor, None if self.bias is None else self.bias.tensor
        norms = (attn.q_norm.weight, attn.k_norm.weight) if self.qk_eps is not None \
            else (None, None)
        return AttentionWeights(self.layer.input_layernorm.weight, qkv, attn.o_proj.weight,
                                self.cos_sin, bias, *norms, attn.o_proj.bias,
                                sinks=self.variant[2])

    @functools.cached_property
    def _spec(self) -> AttentionLayer:  # read first by the probe, after it set the variant
        window, softcap, _ = self.variant
        return AttentionLayer(self.heads, self.kv_heads, self.head_dim, self.scale, self.eps,
                              self.qk_eps or self.eps,
                              getattr(self.layer.self_attn, "layer_idx", None),
                              window=window, softcap=softcap)

    def inputs(self, h, positions):
        """q, k, v as graphcap computes them (what the probe compares)."""
        return attention_inputs(h, positions, self._weights(), self._spec)

    def __call__(self, h, positions):
        return attention_half(h, positions, self._weights(), self._spec)


def recognise_attention(layer, hidden: int, cos_sin: torch.Tensor | None):
    attn = getattr(layer, "self_attn", None)
    if attn is None:
        return None, "no self_attn"
    if cos_sin is None:
        return None, "the model has no rotary_emb graphcap can read (neox cos/sin)"
    eps, why = rms_norm_of(getattr(layer, "input_layernorm", None), hidden)
    if why:
        return None, f"input_layernorm: {why}"
    head_dim, scale = getattr(attn, "head_dim", None), getattr(attn, "scaling", None)
    if not isinstance(head_dim, int) or not isinstance(scale, float):
        return None, f"{type(attn).__name__} has no int head_dim and float scaling"
    fused = hasattr(attn, "qkv_proj")
    projections = ["qkv_proj"] if fused else ["q_proj", "k_proj", "v_proj"]
    known = {*projections, "o_proj", "q_norm", "k_norm"}
    if extra := _extra(attn, known):
        return None, f"{type(attn).__name__} has {', '.join(extra)} beyond q/k/v/o and qk norms"
    modules = [getattr(attn, n, None) for n in (*projections, "o_proj")]
    if not all(_is_linear(m) for m in modules):
        return None, "its projections are not all nn.Linear"
    if cos_sin.shape[1] > head_dim:
        return None, f"rotary dims {cos_sin.shape[1]} exceed head_dim {head_dim}"
    rows = [m.weight.shape[0] for m in modules[:-1]]
    if fused:
        heads = attn.o_proj.weight.shape[1] // head_dim
        kv_heads = (rows[0] // head_dim - heads) // 2
    else:
        heads, kv_heads = rows[0] // head_dim, rows[1] // head_dim
    if heads < 1 or kv_heads < 1 or heads % kv_heads or \
            sum(rows) != (heads + 2 * kv_heads) * head_dim:
        return None, f"projections of {rows} rows do not split into heads of {head_dim}"
    qk_eps = None
    if hasattr(attn, "q_norm") or hasattr(attn, "k_norm"):
        qk_eps, why = rms_norm_of(getattr(attn, "q_norm", None), head_dim)
        k_eps, k_why = rms_norm_of(getattr(attn, "k_norm", None), head_dim)
        if why or k_why or k_eps != qk_eps:
            return None, f"q_norm/k_norm: {why or k_why or 'different eps'} (per-head " \
                         "RMSNorms of one eps only)"
    qkv = bias = None
    if not fused:
        slots = [(m, "weight") for m in modules[:-1]]
        if why := check_fusable(slots):
            return None, f"q/k/v: {why}"
        has_bias = [m.bias is not None for m in modules[:-1]]
        if any(has_bias) and not all(has_bias):
            return None, "some of q/k/v have a bias and some do not"
        qkv = Fused(slots)
        bias = Fused([(m, "bias") for m in modules[:-1]]) if all(has_bias) else None
    return AttentionKernels(layer, qkv, bias, eps, qk_eps, cos_sin, heads, kv_heads,
                            head_dim, scale), None


# -- the MLP half: h + down(silu(gate) * up)(rms_norm(h)), or routed experts ------------
@dataclass
class SwigluKernels:
    layer: nn.Module
    gate_up: Fused | None  # None: the model's own fused gate_up_proj
    eps: float
    name = "mlp"
    ops = "rms_norm_swiglu, linear_residual"

    def fused(self) -> list[Fused]:
        return [] if self.gate_up is None else [self.gate_up]

    def __call__(self, h):
        mlp = self.layer.mlp
        gate_up = mlp.gate_up_proj.weight if self.gate_up is None else self.gate_up.tensor
        return swiglu_half(h, self.layer.post_attention_layernorm.weight, self.eps, gate_up,
                           mlp.down_proj.weight)


@dataclass
class MoeKernels:
    """Routed experts: Qwen3-MoE's and Mixtral's (``router`` "gate", SiLU experts [E, 2I,
    H] and [E, H, I]), or gpt-oss's (``router`` "router" with a bias, experts [E, H, 2I]
    with gate and up interleaved and [E, I, H], biases, the clamped GLU of ``glu``),
    read where they lie at every call."""

    layer: nn.Module
    eps: float
    top_k: int
    renormalize: bool
    router: str = "gate"
    glu: tuple[float, float] | None = None  # gpt-oss's (alpha, limit)
    name = "moe"
    ops = "rms_norm, moe_topk_softmax, moe_experts"

    def fused(self) -> list[Fused]:
        return []

    def weights(self) -> dict:
        """The arguments of :func:`moe_half` after ``top_k`` and ``renormalize``."""
        mlp = self.layer.mlp
        router, experts = getattr(mlp, self.router), mlp.experts
        if self.glu is None:
            return {"w13": experts.gate_up_proj, "w2": experts.down_proj}
        return {"w13": experts.gate_up_proj.transpose(1, 2),
                "w2": experts.down_proj.transpose(1, 2), "router_bias": router.bias,
                "b13": experts.gate_up_proj_bias, "b2": experts.down_proj_bias,
                "alpha": self.glu[0], "limit": self.glu[1], "interleaved": True}

    def __call__(self, h):
        return moe_half(h, self.layer.post_attention_layernorm.weight, self.eps,
                        getattr(self.layer.mlp, self.router).weight, self.top_k,
                        self.renormalize, **self.weights())


def recognise_mlp(layer, hidden: int):
    mlp = getattr(layer, "mlp", None)
    if mlp is None:
        return None, "no mlp"
    eps, why = rms_norm_of(getattr(layer, "post_attention_layernorm", None), hidden)
    if why:
        return None, f"post_attention_layernorm: {why}"
    if hasattr(mlp, "experts"):
        if hasattr(mlp, "router"):
            return _recognise_gpt_oss_moe(layer, mlp, hidden, eps)
        return _recognise_moe(layer, mlp, hidden, eps)
    act = next((n for n in ("act_fn", "activation_fn") if hasattr(mlp, n)), "act_fn")
    if not _is_silu(getattr(mlp, act, None)):
        return None, f"{type(mlp).__name__}.{act} is not SiLU"
    fused = hasattr(mlp, "gate_up_proj")
    names = ["gate_up_proj"] if fused else ["gate_proj", "up_proj"]
    if extra := _extra(mlp, {*names, "down_proj", act}):
        return None, f"{type(mlp).__name__} has {', '.join(extra)} beyond gate/up/down"
    modules = [getattr(mlp, n) for n in (*names, "down_proj")]
    if not all(_is_linear(m) and m.bias is None for m in modules):
        return None, "its projections are not all nn.Linear without a bias"
    inner = modules[-1].weight.shape[1]
    if sum(m.weight.shape[0] for m in modules[:-1]) != 2 * inner:
        return None, "gate and up do not match down's input size"
    gate_up = None
    if not fused:
        slots = [(m, "weight") for m in modules[:-1]]
        if why := check_fusable(slots):
            return None, f"gate/up: {why}"
        gate_up = Fused(slots)
    return SwigluKernels(layer, gate_up, eps), None


def _recognise_moe(layer, mlp, hidden: int, eps: float):
    kind = type(mlp).__name__
    router, experts = getattr(mlp, "gate", None), mlp.experts
    if extra := _extra(mlp, {"gate", "experts"}) + [n for n, _ in
                                                    mlp.named_buffers(recurse=False)]:
        return None, f"{kind} has {', '.join(extra)} beyond a router and experts (e.g. a " \
                     "shared expert, MiniMax-M2's correction bias)"
    weight = getattr(router, "weight", None)
    top_k = getattr(router, "top_k", getattr(mlp, "top_k", None))
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or \
            getattr(router, "bias", None) is not None or not isinstance(top_k, int):
        return None, f"{kind}.gate is not a top-k router with a [experts, hidden] weight"
    # A router's other state (Ernie 4.5's moe_statics.e_score_correction_bias, a
    # DeepSeek-style correction bias buffer) steers its choice, which moe_topk_softmax
    # does not read; the half-precision probe lets up to half the tokens route otherwise.
    if state := _extra(router, {"weight"}) + [n for n, _ in router.named_buffers()]:
        return None, f"{kind}.gate holds {', '.join(state)} beyond its weight (routing " \
                     "state graphcap's top-k softmax does not read)"
    w13 = experts._parameters.get("gate_up_proj")
    w2 = experts._parameters.get("down_proj")
    count = weight.shape[0]
    if w13 is None or w2 is None or w13.dim() != 3 or w2.dim() != 3 or \
            w13.shape[0] != count or w13.shape[2] != hidden or \
            tuple(w2.shape) != (count, hidden, w13.shape[1] // 2):
        return None, f"{type(experts).__name__} holds no [E, 2I, H] gate_up_proj and [E, H, " \
                     "I] down_proj"
    if not _is_silu(getattr(experts, "act_fn", None)) or \
            _extra(experts, {"gate_up_proj", "down_proj", "act_fn"}):
        return None, f"{type(experts).__name__} is not SiLU experts without biases"
    renormalize = getattr(router, "norm_topk_prob", getattr(mlp, "norm_topk_prob", True))
    return MoeKernels(layer, eps, top_k, bool(renormalize)), None


def _recognise_gpt_oss_moe(layer, mlp, hidden: int, eps: float):
    """gpt-oss's MLP: a biased top-k router whose top logits are softmaxed (the
    renormalised top-k of the softmax), experts [E, H, 2I] with gate and up columns
    interleaved and [E, I, H], with biases, under the clamped GLU (``alpha``,
    ``limit``)."""
    kind = type(mlp).__name__
    router, experts = mlp.router, mlp.experts
    if extra := _extra(mlp, {"router", "experts"}):
        return None, f"{kind} has {', '.join(extra)} beyond a router and experts"
    weight, bias = getattr(router, "weight", None), getattr(router, "bias", None)
    top_k = getattr(router, "top_k", None)
    if not isinstance(weight, nn.Parameter) or weight.dim() != 2 or \
            weight.shape[1] != hidden or not isinstance(bias, nn.Parameter) or \
            tuple(bias.shape) != (weight.shape[0],) or not isinstance(top_k, int):
        return None, f"{kind}.router is not a top-k router with a [experts, hidden] " \
                     "weight and a bias"
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    params = [experts._parameters.get(n) for n in names]
    count = weight.shape[0]
    if any(p is None for p in params) or _extra(experts, set(names)):
        return None, f"{type(experts).__name__} holds other than {', '.join(names)}"
    w13, b13, w2, b2 = params
    inter = w13.shape[-1] // 2 if w13.dim() == 3 else 0
    if tuple(w13.shape) != (count, hidden, 2 * inter) or \
            tuple(b13.shape) != (count, 2 * inter) or \
            tuple(w2.shape) != (count, inter, hidden) or tuple(b2.shape) != (count, hidden):
        return None, f"{type(experts).__name__}'s weights are not [E, H, 2I], [E, 2I], " \
                     "[E, I, H], [E, H]"
    alpha, limit = getattr(experts, "alpha", None), getattr(experts, "limit", None)
    if not isinstance(alpha, int | float) or not isinstance(limit, int | float) or \
            not alpha > 0 or not limit > 0:  # its limit clamps at 0 too; moe_experts' not
        return None, f"{type(experts).__name__} has no clamped GLU's alpha > 0 and limit > 0"
    return MoeKernels(layer, eps, top_k, True, router="router",
                      glu=(float(alpha), float(limit))), None


def structure(model: nn.Module) -> tuple:
    """What recognition read, by identity: every module, its Python values and what calling
    it runs (class, a forward set on the instance, hooks: :func:`skipped_calls`), and the
    rotary embedding's frequencies (the cos/sin cache is built from them; written in
    place too, by their version counter); by value, the model's dtype (probed in it), the
    rotary embedding's ``attention_scaling`` (its stock forward multiplies cos and sin by
    it on every call) and the config fields the stock modules read per call
    (``changes.CALL_TIME_CONFIG``)."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    scaling = getattr(rotary, "attention_scaling", None)
    calls = [(id(m), type(m), m.__dict__.get("forward"), module_values(m), hooks(m)
              if m._forward_pre_hooks or m._forward_hooks else ()) for m in model.modules()]
    dtype = model.get_output_embeddings().weight.dtype
    return (*calls, id(inv_freq), _version(inv_freq), dtype,
            (id(scaling), _version(scaling)) if isinstance(scaling, torch.Tensor)
            else repr(scaling), call_time_config(model))


def _version(t) -> int | None:
    """``t``'s version counter (None: no tensor, or an inference tensor, which has none)."""
    if not isinstance(t, torch.Tensor) or t.is_inference():
        return None
    return t._version
