"""Each recognised part checked against the stock module on a probe input, when wrapping;
and what a model's attention layers hand the attention function (:func:`kv_layers`).

A part runs graphcap's kernels only if, on random hidden states (and positions spread
over the model's range), it gives what the stock module gives: within 1e-5 relative
(Frobenius) in float32, 2e-2 in half precision, where only rounding differs. Recognition
(:mod:`graphcap.hf.patterns`) reads structure; the probe is what proves the maths.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F

from graphcap.errors import UnsupportedModel
from graphcap.hf import attention as hf_attention
from graphcap.hf import patterns
from graphcap.hf.rotary import served_positions
from graphcap.opsdb.attention.packed import packed
from graphcap.opsdb.moe import MOE_EXPERTS, MOE_TOPK_SOFTMAX
from graphcap.opsdb.norm import RMS_NORM

TOKENS = 16
KV_TOKENS = 8  # of the forward that finds each layer's K/V shape
# How far (relative) a request's logits may move when another is packed before it: only
# rounding moves them in a model that numbers its tokens by position_ids (a model that
# numbers the packed row itself, as BART's decoder does, moves them by ~1).
PACKED = 5e-2
BRANCH = 1e-2  # the residual stream's scale under a half's branch, in a probe


def call_options(model) -> dict:
    """Keyword arguments of graphcap's every call of ``model``: no transformers KV cache,
    and no router logits where its config asks for them (a MoE checkpoint trained with
    the auxiliary loss): transformers collects them from the routers, which the MoE
    kernels never call, to compute that loss (over none: an IndexError)."""
    if getattr(model.config, "output_router_logits", None):
        return {"use_cache": False, "output_router_logits": False}
    return {"use_cache": False}


def tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype in (torch.float32, torch.float64) else 2e-2


def error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative Frobenius error of ``got`` against ``want`` (inf on another shape/dtype)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf")
    want32 = want.float()
    return float((got.float() - want32).norm() / want32.norm().clamp_min(1e-30))


def mismatch(got, want, what: str, tol: float | None = None) -> str | None:
    """Why ``got`` is not ``want`` within the dtype's tolerance, or None."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        return f"{what}: the stock module returned {type(want).__name__}"
    err, tol = error(got, want), tolerance(want.dtype) if tol is None else tol
    if err <= tol:
        return None
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{what}: graphcap's kernels give {got.dtype} {tuple(got.shape)}, the stock " \
               f"module {want.dtype} {tuple(want.shape)}"
    return f"{what}: the probe differs from the stock module by {err:.2g} (tolerance {tol:g})"


def branch(got, want, h, what: str) -> str | None:
    """A half's output ``h + branch`` compared by its branch (in float32): the residual
    would hide a wrong branch."""
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor) or \
            got.shape != want.shape or got.dtype != want.dtype:
        return mismatch(got, want, what)
    return mismatch(got.float() - h.float(), want.float() - h.float(), what,
                    tol=tolerance(want.dtype))


def attention(layer, kernels, h, pos, kwargs) -> str | None:
    """The attention half: q, k and v against those the stock attention hands the
    attention function (after its own projections, norms and rotary), then the branch."""
    hf_attention.SEEN = []
    try:
        want = patterns.stock_attention(layer, h, kwargs)
        seen = hf_attention.SEEN
    finally:
        hf_attention.SEEN = None
    if len(seen) != 1:
        return f"the stock attention called the attention function {len(seen)} times, not once"
    kernels.variant = seen[0][4]  # the window, soft-capping and sinks the stock one passes
    for name, got, ref in zip("qkv", kernels.inputs(h, pos), seen[0][:3], strict=True):
        if why := mismatch(got, ref, f"the attention half's {name}"):
            return why
    return branch(kernels(h, pos), want, h, "the attention half")


def hidden(size: int, like: torch.Tensor, seed: int, tokens: int = TOKENS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, size, generator=gen).to(device=like.device, dtype=like.dtype)


def span(config) -> int:
    """The positions a probe may use, ``[0, span)``: ``config.max_position_embeddings``
    (the rotary cache's length, and where calls' positions are checked to lie; LongRoPE's
    short span), else ``TOKENS``."""
    top = served_positions(config, getattr(config, "max_position_embeddings", None))
    return top if isinstance(top, int) and not isinstance(top, bool) and top > 0 else TOKENS


def spread(top: int, tokens: int, device) -> torch.Tensor:
    """``tokens`` ascending positions below ``top`` from 0: ``0..tokens-1``, or where ``top``
    is smaller, each of ``0..top-1`` in turn (a probe of ``tokens`` tokens on a model of
    fewer positions, every one of them read)."""
    return (torch.arange(tokens) * min(top, tokens) // tokens).to(device)


def positions(max_position: int, device, seed: int, tokens: int = TOKENS) -> torch.Tensor:
    """Ascending positions over the model's whole range: the rotary cache is read far out
    (below ``max_position``: a model of fewer positions than ``tokens`` has each repeated)."""
    if max_position < tokens:
        return spread(max_position, tokens, device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(max_position, generator=gen)[:tokens].sort().values.to(device)


def norm(module, eps: float) -> str | None:
    """An RMSNorm module against ``graphcap::rms_norm``."""
    weight = module.weight
    x = hidden(weight.shape[0], weight, seed=1)
    return mismatch(RMS_NORM(x, weight, eps), module(x), type(module).__name__)


def moe(layer, kernels, h: torch.Tensor) -> str | None:
    """Routed experts: the router and the experts apart (on the stock router's choice), then
    the whole half token by token where both routings chose the same experts (a near-tie
    of router logits may choose otherwise in half precision; at least half must agree)."""
    mlp = layer.mlp
    router = getattr(mlp, kernels.router)
    x = layer.post_attention_layernorm(h[None])[0]
    routed = router(x)
    if not isinstance(routed, tuple) or len(routed) != 3:
        return f"{type(router).__name__} does not return (logits, weights, indices)"
    _, want_w, want_ids = routed
    weights = kernels.weights()
    got_w, got_ids = MOE_TOPK_SOFTMAX(F.linear(x, router.weight, weights.get("router_bias")),
                                      kernels.top_k, kernels.renormalize)
    order, got_order = want_ids.argsort(dim=-1), got_ids.argsort(dim=-1)
    same = (want_ids.gather(1, order) == got_ids.long().gather(1, got_order)).all(dim=-1)
    if not same.all() and x.dtype in (torch.float32, torch.float64):
        return "the router chose other experts than the stock router"
    if why := mismatch(got_w.gather(1, got_order)[same].to(want_w.dtype),
                       want_w.gather(1, order)[same], "the router's weights"):
        return why
    experts = MOE_EXPERTS(x, weights["w13"], weights["w2"], want_w.float(), want_ids,
                          weights.get("b13"), weights.get("b2"), weights.get("alpha", 0.0),
                          weights.get("limit", 0.0), weights.get("interleaved", False))
    if why := mismatch(experts, mlp.experts(x, want_ids, want_w), "the experts"):
        return why
    stock = patterns.stock_mlp(layer, h)
    ours = kernels(h)
    ours_ids = MOE_TOPK_SOFTMAX(F.linear(RMS_NORM(h, layer.post_attention_layernorm.weight,
                                                  kernels.eps), router.weight,
                                         weights.get("router_bias")),
                                kernels.top_k, kernels.renormalize)[1]
    agree = (ours_ids.long().sort(dim=-1).values == want_ids.sort(dim=-1).values).all(-1)
    if agree.sum() * 2 < agree.numel():
        return "the MoE half routed most probe tokens otherwise than the stock module"
    return mismatch(ours[agree], stock[agree], "the MoE half")


def kv_layers(model, dtype: torch.dtype, options: tuple[str, ...]
              ) -> tuple[dict[int, tuple[int, int]], dict[int, int], dict[int, int]]:
    """Each attention layer's keys and values, ``layer_idx -> (heads, head dim)``, its
    window (0: none that binds), and the layers that call the attention function more
    than once a forward with how often (DiffLlama's: once per half of its values), as the
    attention function receives them on a short forward (what a K/V cache of the model
    holds, whatever its config's fields say), on a backend computing ``options`` (the
    model's, as its calls pick one). What the attention function refuses on any layer is
    refused here, naming the model."""
    device = next(model.parameters()).device
    pos = spread(span(model.config), KV_TOKENS, device)
    ids = pos % model.get_output_embeddings().weight.shape[0]
    hf_attention.SEEN = []
    try:
        with torch.inference_mode(), packed([KV_TOKENS], device, dtype=dtype,
                                            options=options):
            alone = _logits(model, ids, pos)
        seen, hf_attention.SEEN = hf_attention.SEEN, []  # the layers as written again
        why = packing(model, ids, pos, alone, dtype, options)
    except UnsupportedModel as exc:
        raise UnsupportedModel(f"{type(model).__name__}: {exc}") from exc
    finally:
        hf_attention.SEEN = None
    if why:
        raise UnsupportedModel(why)
    layers = [(layer, k, variant[0]) for _, k, _, layer, variant in seen
              if isinstance(layer, int) and not isinstance(layer, bool)]
    calls = Counter(layer for layer, _, _ in layers)
    return ({layer: tuple(k.shape[1:]) for layer, k, _ in layers},
            {layer: window for layer, _, window in layers},
            {layer: n for layer, n in sorted(calls.items()) if n > 1})


def repeated_calls(model, repeats: dict[int, int]) -> str | None:
    """Why graphcap's paged K/V cache cannot serve ``model``, whose layers ``repeats``
    call the attention function more than once a forward, or None: each call writes the
    layer's keys and values, the last over the others."""
    if not repeats:
        return None
    layer, calls = next(iter(repeats.items()))
    return (f"{type(model).__name__}: its attention layer {layer} calls the attention "
            f"function {calls} times a forward (DiffLlama's differential attention: once "
            "per half of its values), each with keys and values of its own, and graphcap's "
            "paged K/V cache holds one set per layer, so decode steps would read the last "
            "call's; prefill logits (PrefillLM) are exact, but generate with transformers "
            "(its own attention: hf_model.set_attn_implementation('sdpa'), then "
            "hf_model.generate())")


def _logits(model, ids, pos) -> torch.Tensor:
    return model(input_ids=ids[None], position_ids=pos[None], **call_options(model)).logits[0]


def packing(model, ids, pos, alone, dtype, options) -> str | None:
    """Why ``model`` cannot run packed requests, or None: the logits of ``ids`` (at
    ``pos``), ``alone``, must stay as they are with another request packed before them.
    A model whose forward numbers the tokens of its row itself, not by ``position_ids``
    (BART's, mBART's, Marian's, Pegasus', PLBart's, Blenderbot's decoders), gives a
    request after another the positions that follow it."""
    first = (ids * 7 + 3) % alone.shape[-1]
    with torch.inference_mode(), packed([len(ids), len(ids)], ids.device, dtype=dtype,
                                        options=options):
        after = _logits(model, torch.cat([first, ids]), torch.cat([pos, pos]))[len(ids):]
    err = error(after.float(), alone.float())
    if err <= PACKED:
        return None
    return (f"{type(model).__name__}: a request's logits change when another request is "
            f"packed before it (by {err:.2g}, relative): the model does not read its "
            "positions from position_ids (its forward numbers the tokens of the packed "
            "row itself, as BART's decoder does) or mixes tokens of different requests "
            "outside attention, and graphcap.hf runs requests packed in one row and decode "
            "steps at their own positions; run it with transformers' own attention (no "
            "PrefillLM)")
