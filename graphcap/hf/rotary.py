"""A model's rotary embedding as graphcap's kernels read it (:func:`rotary_cache`), and
rotary embeddings whose forward copies host tensors to the device, made capturable.

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
    them from the device instead (idempotent); one that scales them by the batch's
    largest position is refused."""
    for module in model.modules():
        if _recomputes(module) and not isinstance(module.rope_init_fn, Frequencies):
            module.rope_init_fn = Frequencies(module, module.rope_init_fn)


def ensure(model: nn.Module) -> None:
    """Before a capture (host work): a rotary module put in since wrapping patched, every
    patched one's frequencies computed again from its config, on its current device."""
    patch(model)
    for module in model.modules():
        if isinstance(fn := module.__dict__.get("rope_init_fn"), Frequencies):
            fn.refresh()
            fn(module.config)


def unpatch(model: nn.Module) -> None:
    """Every patched module back on its stock ``rope_init_fn``."""
    for module in model.modules():
        if isinstance(fn := module.__dict__.get("rope_init_fn"), Frequencies):
            module.rope_init_fn = fn.stock


ROTARY_SPAN = 65536  # positions of the rotary table computed at once


def rotary_cache(model) -> torch.Tensor | None:
    """The neox cos/sin cache [max_position, rotary dims] of the model's own rotary
    embedding (float32; any static rope type, attention scaling included), or None."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    rotary = getattr(decoder, "rotary_emb", None)
    top = getattr(model.config, "max_position_embeddings", None)
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
