"""The ``"graphcap"`` attention implementation of transformers: HF's attention call routed
into graphcap's split op ``graphcap::attention``.

A transformers model whose attention modules call ``ALL_ATTENTION_FUNCTIONS`` (every
current decoder) picks this function once its config says
``attn_implementation="graphcap"``. It receives HF's ``[1, heads, T, head_dim]`` query,
key and value (the requests packed along T) and reads the request boundaries from the
forward context, which graphcap's runner (or ``PrefillLM(..., seq_lens=...)``) prepares
outside any graph. It reads no tensor on the host, so it captures.

No mask function is registered under ``"graphcap"`` on purpose: transformers then skips
mask creation for it (``create_causal_mask`` returns ``None``) and never builds a dense
``[T, T]`` mask nor inspects ``position_ids`` for packed sequences (a host sync).
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface

from graphcap.core.context import current_kv
from graphcap.errors import UnsupportedModel
from graphcap.opsdb.attention import ATTENTION
from graphcap.opsdb.cached import CACHED_ATTENTION

NAME = "graphcap"
# While graphcap.hf probes a layer: the q, k, v each call received, [T, heads, head_dim].
SEEN: list | None = None


def graphcap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask, scaling: float | None = None,
                       dropout: float = 0.0, sliding_window: int | None = None,
                       softcap: float | None = None, **kwargs):
    """transformers' attention-function contract: ``query`` ``[1, H, T, D]``, ``key`` and
    ``value`` ``[1, Hkv, T, D]`` (H a multiple of Hkv) -> ``([1, T, H, D], None)``.

    Attention is causal within each request of the forward context's metadata; tokens of
    different requests never see each other. Masks, sliding windows, soft-capping,
    attention sinks and dropout are refused, not ignored."""
    name = type(module).__name__
    if attention_mask is not None:
        raise UnsupportedModel(
            f"{name}: graphcap attention got an attention mask; request boundaries come "
            "from seq_lens (the forward context), so call the model without attention_mask")
    found = [f"{what} ({value})" for what, value in (
        ("a sliding window", sliding_window), ("soft-capping", softcap),
        ("attention sinks", "s_aux" if kwargs.get("s_aux") is not None else None))
        if value is not None]
    if found:
        raise UnsupportedModel(
            f"{name} attends with {' and '.join(found)}, which graphcap::attention does not "
            "support (full causal attention only); turn it off in the config if the model "
            "allows it, or use another model")
    if dropout:
        raise UnsupportedModel(f"{name}: attention dropout {dropout} in training mode; "
                               "graphcap runs inference only, call model.eval()")
    if not getattr(module, "is_causal", True):
        raise UnsupportedModel(f"{name}: bidirectional attention (is_causal=False) is not "
                               "supported; graphcap::attention is causal")
    if query.shape[0] != 1:
        raise UnsupportedModel(
            f"{name}: graphcap attention takes one packed row (batch size 1), got "
            f"{query.shape[0]}; pack the requests along the token dim and give seq_lens")
    # [1, H, T, D] -> [T, H, D]: the split op's packed layout (contiguous for the kernels).
    q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    if SEEN is not None:
        SEEN.append((q, k, v))
    out = torch.empty_like(q)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    layer = getattr(module, "layer_idx", None)
    if isinstance(layer, int) and not isinstance(layer, bool):  # the forward's cache, if
        CACHED_ATTENTION(q, k, v, out, float(scale), layer)  # any, read at run time
        return out.unsqueeze(0), None
    # Without a layer index nothing writes the cache (a compiled forward's callers find
    # it unwritten and say so; an eager one is told here).
    if not torch.compiler.is_compiling() and current_kv() is not None:
        raise UnsupportedModel(f"{name} has no int layer_idx: graphcap cannot tell "
                               "which layer of the K/V cache it writes")
    ATTENTION(q, k, v, out, float(scale))
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, graphcap_attention)
