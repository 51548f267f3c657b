"""A model's rotary embedding as graphcap's kernels read it (:func:`rotary_cache`), and
rotary embeddings made capturable and the same for every request of a packed batch.

LongRoPE (``rope_type`` ``"longrope"``: Phi-3-mini-128k, Phi-3.5-mini) takes its short
factors while a batch's largest position stays below ``original_max_position_embeddings``
and its long ones, for the whole batch, past it: a request's rotary would depend on what
is packed beside it, and the choice reads the device on the host. Served below that
limit (:func:`served_positions`, a model's ``max_position`` there), every request's
rotary is the short factors whatever the batch, as transformers gives one request alone.
While wrapped, :func:`patch` gives such a module the forward its ``dynamic_rope_update``
decorates (no choice per call) over its short frequencies; :func:`unpatch` takes it away.

transformers' PhiMoE rotary embedding (``PhimoeRotaryEmbedding``) calls its
``rope_init_fn(config)`` in every forward: the inverse frequencies are computed again on
the host and copied to the model's device, a copy CUDA graph capture refuses. While the
model is wrapped, :func:`patch` gives such a module an ``rope_init_fn`` that returns the
stock function's own result, computed once and kept on the device of the module's
``inv_freq`` buffer; the stock forward runs unchanged around it, so cos and sin are the
same bits. Its other rope types pick their scale from the largest position of the whole
packed batch, on the host: refused. :func:`unpatch` puts the stock function back.
"""

from __future__ import annotations

import torch
from torch import nn

from graphcap.errors import UnsupportedModel

# Rotary embeddings that recompute their frequencies from the config in every forward.
HOST_FREQUENCIES = ("PhimoeRotaryEmbedding",)
# Rotary scalings recomputed from the largest position of the whole (packed) batch;
# LongRoPE is served below the position where it would switch.
DYNAMIC_ROPE = ("dynamic", "longrope")
SHORT_LONG = "longrope"


def refusal(config, kind: str, model: nn.Module | None = None) -> str | None:
    """Why a model of ``config`` (``kind``, its class name) cannot be served for the rope
    type its config names, or None: none where ``model``'s rotary embeddings run a static
    type whatever the config names (HunYuan's label NTK-alpha scaling "dynamic" and, with
    the checkpoints' fixed ``alpha``, run "ntk_alpha": transformers' ``dynamic_rope_update``
    reads the module's ``rope_type``)."""
    rope = getattr(config, "rope_parameters", None) or {}
    per_layer_type = [v for v in rope.values() if isinstance(v, dict)]
    dynamic = {p.get("rope_type") for p in per_layer_type or [rope]} & set(DYNAMIC_ROPE)
    if not dynamic or (not per_layer_type and served_positions(config, None) is not None):
        return None
    runs = [t for m in (model.modules() if model is not None else ())
            if "Rotary" in type(m).__name__
            for t in _types(getattr(m, "rope_type", None))]
    if runs and not any("dynamic" in t or t in DYNAMIC_ROPE for t in runs):
        return None
    return (f"{kind} uses rope_type {sorted(dynamic)[0]!r}, which rescales the rotary "
            "frequencies from the largest position in the batch: packed requests would "
            "change each other (and the check reads the device on the host); use a static "
            "rope type (default, linear, llama3, yarn)")


def _types(rope_type) -> list[str]:
    """A rotary module's ``rope_type``: one, or one per layer type (a dict)."""
    kinds = rope_type.values() if isinstance(rope_type, dict) else [rope_type]
    return [t for t in kinds if isinstance(t, str)]


def served_positions(config, top: int | None) -> int | None:
    """The positions a model of ``config`` with ``top`` of them is served at: for
    LongRoPE, none from ``original_max_position_embeddings`` on (its short factors'
    span), else ``top``."""
    rope = getattr(config, "rope_parameters", None) or {}
    if rope.get("rope_type") != SHORT_LONG:
        return top
    short = rope.get("original_max_position_embeddings") or getattr(
        config, "original_max_position_embeddings", None)
    if not isinstance(short, int) or isinstance(short, bool) or short <= 0:
        return top
    return short if top is None else min(top, short)


class ShortFactors:
    """A LongRoPE module's forward while wrapped: the undecorated forward of its class,
    over the short frequencies :meth:`reset` writes into its ``inv_freq``."""

    def __init__(self, module: nn.Module, undecorated):
        self.module, self.undecorated = module, undecorated
        self.reset()

    def reset(self) -> None:
        """The short frequencies in the module's ``inv_freq``, in place (graphs read it):
        a long batch run before wrapping left the long ones there."""
        held = self.module.inv_freq
        short = getattr(self.module, "original_inv_freq", None)  # the bits it was built with
        if not isinstance(short, torch.Tensor) or short is held or short.shape != held.shape:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            short, _ = ROPE_INIT_FUNCTIONS[SHORT_LONG](self.module.config, held.device)
        if short.shape != held.shape:
            raise UnsupportedModel(
                f"{type(self.module).__name__}: its LongRoPE frequencies have shape "
                f"{tuple(held.shape)}, its config's short factors {tuple(short.shape)}")
        if not torch.equal(held, short := short.to(held.device, held.dtype)):
            with torch.inference_mode(), torch.no_grad():
                held.copy_(short)

    def __call__(self, x, position_ids, *args, **kwargs):
        return self.undecorated(self.module, x, position_ids, *args, **kwargs)

    # Pickled (torch.save of a wrapped model) by its module alone: the undecorated forward
    # is no name pickle finds, and is its class's again when loaded.
    def __getstate__(self) -> dict:
        return {"module": self.module}

    def __setstate__(self, state: dict) -> None:
        self.module = state["module"]
        self.undecorated = undecorated(type(self.module))


def undecorated(cls: type) -> object | None:
    """``cls.forward`` without transformers' ``dynamic_rope_update`` (the wrapper whose
    code lives in ``modeling_rope_utils``) and what decorates it (``torch.no_grad`` in
    some versions), or None where no such wrapper is found."""
    fn = cls.forward
    while (inner := getattr(fn, "__wrapped__", None)) is not None:
        code = getattr(fn, "__code__", None)
        if code is not None and code.co_filename.endswith("modeling_rope_utils.py"):
            return inner
        fn = inner
    return None


def _short_long(module: nn.Module) -> bool:
    if getattr(module, "rope_type", None) != SHORT_LONG:
        return False
    if not isinstance(getattr(module, "inv_freq", None), torch.Tensor) or \
            undecorated(type(module)) is None:
        raise UnsupportedModel(
            f"{type(module).__name__} uses LongRoPE without the inv_freq buffer and "
            "decorated forward of transformers' rotary embeddings: graphcap cannot keep "
            "its short factors for every request")
    return True


class Frequencies:
    """A rotary module's ``rope_init_fn`` while wrapped: the stock function's result for
    the module's config, one float32 copy per device the module's buffers were on."""

    def __init__(self, module: nn.Module, stock):
        self.module, self.stock = module, stock
        self.refresh()

    def refresh(self) -> None:
        """The stock function's result for the config as it is now, written into the
        tensors held (graphs captured before read them) where it has their shape."""
        inv_freq, self.scaling = self.stock(self.module.config)
        held = getattr(self, "held", {})
        if not held or any(t.shape != inv_freq.shape for t in held.values()):
            self.held = {inv_freq.device: inv_freq}
            return
        with torch.inference_mode():  # the copies may be inference tensors
            for t in held.values():
                if not torch.equal(t, now := inv_freq.to(t.device)):
                    t.copy_(now)

    def __call__(self, config, *args, **kwargs):
        if args or kwargs or config is not self.module.config:
            return self.stock(config, *args, **kwargs)
        device = self.module.inv_freq.device
        if device not in self.held:  # moved since: ensure() copies it before a capture
            self.held[device] = next(iter(self.held.values())).to(device)
        return self.held[device], self.scaling


def _recomputes(module: nn.Module) -> bool:
    if type(module).__name__ not in HOST_FREQUENCIES:
        return False
    if (kind := getattr(module, "rope_type", None)) != "default":
        raise UnsupportedModel(
            f"{type(module).__name__} with rope_type {kind!r} scales its rotary by the "
            "largest position of the whole batch, read on the host: packed requests would "
            "change each other's logits, and a capture cannot read it; use rope_type "
            "'default'")
    return (isinstance(getattr(module, "inv_freq", None), torch.Tensor)
            and callable(module.__dict__.get("rope_init_fn")))


def patch(model: nn.Module) -> None:
    """Every rotary module of ``model`` that recomputes its frequencies per forward reads
    them from the device instead, every LongRoPE one keeps its short factors (both
    idempotent); one that scales them by the batch's largest position is refused."""
    for module in model.modules():
        if _recomputes(module) and not isinstance(module.rope_init_fn, Frequencies):
            module.rope_init_fn = Frequencies(module, module.rope_init_fn)
        if _short_long(module) and not isinstance(module.__dict__.get("forward"),
                                                  ShortFactors):
            module.forward = ShortFactors(module, undecorated(type(module)))


def ensure(model: nn.Module) -> None:
    """Before a capture (host work): a rotary module put in since wrapping patched, every
    patched one's frequencies computed again from its config, on its current device."""
    patch(model)
    for module in model.modules():
        if isinstance(fn := module.__dict__.get("rope_init_fn"), Frequencies):
            fn.refresh()
            fn(module.config)
        if isinstance(forward := module.__dict__.get("forward"), ShortFactors):
            forward.reset()


def unpatch(model: nn.Module) -> None:
    """Every patched module back on its stock ``rope_init_fn`` and forward."""
    for module in model.modules():
        if isinstance(fn := module.__dict__.get("rope_init_fn"), Frequencies):
            module.rope_init_fn = fn.stock
        if isinstance(module.__dict__.get("forward"), ShortFactors):
            del module.forward


ROTARY_SPAN = 65536  # positions of the rotary table computed at once


def rotary_cache(model) -> torch.Tensor | None:
    """The neox cos/sin cache [max_position, rotary dims] of the model's own rotary
    embedding (float32; any static rope type, attention scaling included), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    top = served_positions(model.config, getattr(model.config, "max_position_embeddings",
                                                 None))
    if rotary is None or not isinstance(top, int) or not hasattr(rotary, "inv_freq"):
        return None
    device, table = rotary.inv_freq.device, None
    # In spans of positions: cos and sin of a million at once would take 2 GB beside the
    # table's 0.5 (head dim 128); a static rope type gives each position the same values
    # in any call.
    with torch.inference_mode(False), torch.no_grad():  # a normal tensor, in any mode
        x = torch.zeros(1, dtype=torch.float32, device=device)
        for start in range(0, top, ROTARY_SPAN):
            try:
                cos, sin = rotary(x, torch.arange(start, min(top, start + ROTARY_SPAN),
                                                  device=device)[None])
                cos, sin = cos.reshape(cos.shape[-2], -1), sin.reshape(sin.shape[-2], -1)
            except (TypeError, ValueError, RuntimeError):  # another signature (mrope, ...)
                return None
            half = cos.shape[-1] // 2
            if cos.shape[-1] % 2 or not torch.equal(cos[:, :half], cos[:, half:]):
                return None  # not the neox layout (cos repeated over the two halves)
            if table is None:
                table = torch.empty(top, 2 * half, dtype=torch.float32, device=device)
            table[start:start + cos.shape[0], :half] = cos[:, :half]
            table[start:start + cos.shape[0], half:] = sin[:, :half]
    return table
