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

import sys

import torch
from transformers import AttentionInterface

from graphcap.compat import guards
from graphcap.core.context import attention_if_any, current_kv
from graphcap.errors import UnsupportedModel
from graphcap.opsdb.attention import ATTENTION
from graphcap.opsdb.cached import CACHED_ATTENTION

NAME = "graphcap"
# While graphcap.hf probes the model: (q, k, v, layer_idx, (window, softcap, sinks)) of
# each call, q/k/v as [T, heads, head_dim].
SEEN: list | None = None


# Layer types whose attention a window (or chunk) bounds, and the config field of its size:
# below it they attend as full attention does.
WINDOWED = {"sliding_attention": "sliding_window", "chunked_attention": "attention_chunk_size"}
# The head dims of DeepSeek's MLA, named when keys and values differ in theirs.
HEAD_DIM_FIELDS = ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def window_binds(config, window) -> bool:
    """Whether a causal window of ``window`` tokens (a query attends to itself and the
    ``window - 1`` tokens before it) can change attention at the model's positions: not
    when it is at least ``max_position_embeddings`` (a token at position p attends p + 1
    keys, at most that many), as Mistral, Mixtral and Phi-3 ship (4096 or more on models
    of that many positions or fewer). Such a layer runs full causal attention."""
    limit = getattr(config, "max_position_embeddings", None)
    return window is not None and (not isinstance(limit, int) or window < limit)


def windows_off(config) -> str:
    """The config change that turns a model's attention windows off: ``layer_types`` where
    the config lists each layer's attention (Gemma 2/3, Cohere2, OLMo 3, gpt-oss, Qwen2/3,
    Llama 4, ...: their modules read it, not ``use_sliding_window``), else
    ``sliding_window=None`` (Mistral, Mixtral, Phi-3, Qwen3-MoE). Both are read when the
    model is built."""
    types = getattr(config, "layer_types", None)
    if isinstance(types, (list, tuple)) and any(t in WINDOWED for t in types):
        return f"layer_types=['full_attention'] * {len(types)}"
    return "sliding_window=None"


def window_refusal(config, window: int | None = None) -> str:
    """What to do about a model's attention windows (of ``window`` tokens, else the size
    its config gives): the fields to change, and what that changes."""
    types = list(getattr(config, "layer_types", None) or ())
    if window is None:
        window = next((getattr(config, WINDOWED[t], None) for t in types if t in WINDOWED),
                      None)
    fix = windows_off(config)
    how = (f"load the model with them turned off, AutoModelForCausalLM.from_pretrained("
           f"path, {fix}) (or set config.{fix.replace('=', ' = ', 1)} before from_config)")
    if not fix.startswith("layer_types"):
        return (f"{how}: it then attends over the whole sequence, as now for sequences up "
                f"to the window ({window} tokens), not past it; or run it with "
                "transformers' own attention (no PrefillLM)")
    rope = getattr(config, "rope_parameters", None)
    differ = sorted({t for t in types if t in WINDOWED and isinstance(rope, dict)
                     and rope.get(t) != rope.get("full_attention")})
    here = f": here rope_parameters[{differ[0]!r}] differs from rope_parameters" \
        "['full_attention']" if differ else ""
    return (f"{how}: that makes another model, whose layers attend over the whole sequence "
            f"(past the window ({window} tokens) too), and a layer's type may also set its "
            f"rotary embedding (it does in Gemma 3 and Cohere2{here}), so compare its outputs "
            "with the stock model's before relying on them; or run it with transformers' "
            "own attention (no PrefillLM)")


def position_scaled_queries(model) -> str | None:
    """Why ``model``'s attention is refused for scaling queries by positions it counts
    itself, or None: Llama 4's ``attn_temperature_tuning`` scales the queries of its NoPE
    layers by the token's position taken from an arange along the row, not from
    ``position_ids`` (a request packed after another would read the positions after it,
    a decode step position 0)."""
    layers = sorted({getattr(m, "layer_idx", None) for m in model.modules()
                     if getattr(m, "attn_temperature_tuning", False)
                     and not getattr(m, "use_rope", True)}, key=str)
    if not layers:
        return None
    floor = getattr(model.config, "floor_scale", None)
    return (f"{type(model).__name__}: attn_temperature_tuning scales the queries of its "
            f"layers without rotary ({layers}) by each token's position, which they count "
            "along the row rather than read from position_ids: requests packed together "
            f"would change each other, and decode steps past {floor} tokens (floor_scale) "
            "would take the scale of position 0. Load the model with it off, "
            "AutoModelForCausalLM.from_pretrained(path, attn_temperature_tuning=False) (or "
            "set config.attn_temperature_tuning = False before from_config): another model, "
            f"the same on sequences under {floor} tokens; or run it with transformers' own "
            "attention (no PrefillLM)")


def builds_window_masks(module) -> bool:
    """Whether the code of ``module``'s model can apply a window through the mask it
    builds: a transformers model's modeling file imports
    ``create_sliding_window_causal_mask`` (Llama's does not: a ``sliding_window`` its
    config carries is applied by no mask); code from elsewhere is taken to."""
    name = type(module).__module__
    if not name.startswith("transformers.models."):
        return True
    return hasattr(sys.modules.get(name), "create_sliding_window_causal_mask")


def layer_window(module, config, passed=None) -> int | None:
    """The window transformers' eager attention applies to a layer, which is that of the
    mask its model builds for the layer (the window its attention call passes,
    ``passed``, is what FlashAttention reads instead). None where the layer's modeling
    builds no window mask (:func:`builds_window_masks`): OLMoE's attention passes
    ``config.sliding_window`` and its model builds a plain causal mask, and a window a
    Llama's config carries is applied by no mask. Else the window the call passes; else,
    where ``layer_types`` names the layer's kind, the config's size of that kind if it
    is windowed (the module's own first: Qwen2-MoE sets it on sliding layers; SmolLM3
    passes none where ``use_sliding_window`` is off and its mask still slides over the
    sliding layers), none if not (EXAONE 4 keeps ``sliding_window`` on its
    full-attention layers too); else the module's own, else the config's (PhiMoE: every
    layer's mask, no ``layer_types``). graphcap builds no mask, so its ops take it."""
    if not builds_window_masks(module):
        return None
    if passed is not None:
        return passed
    kinds, layer = getattr(config, "layer_types", None), getattr(module, "layer_idx", None)
    window = getattr(module, "sliding_window", None)
    if kinds and isinstance(layer, int) and 0 <= layer < len(kinds):
        if kinds[layer] not in WINDOWED:
            return None
        return window if window is not None else getattr(config, WINDOWED[kinds[layer]],
                                                         None)
    if window is None and not kinds:
        window = getattr(config, "sliding_window", None)
    return window


def variant_of(module, sliding_window, softcap, sinks) -> tuple[int, float, object]:
    """The (window, softcap, sinks) of graphcap's attention ops for one of transformers'
    attention calls: the layer's window (:func:`layer_window`) only where it can bind,
    soft-capping where given, the module's learned sinks (``s_aux``)."""
    config = getattr(module, "config", None)
    sliding_window = layer_window(module, config, sliding_window)
    window = int(sliding_window) if window_binds(config, sliding_window) else 0
    return window, float(softcap or 0.0), sinks


def attention_options(model) -> tuple[str, ...]:
    """The options of :mod:`graphcap.opsdb.attention.variant` a transformers model's
    attention layers use (a backend must compute them): a window where one can bind,
    soft-capped scores, learned sinks."""
    config, found = model.config, set()
    for module in model.modules():
        if not hasattr(module, "layer_idx") or not hasattr(module, "config"):
            continue
        if window_binds(config, layer_window(module, config)):
            found.add("window")
        if getattr(module, "sinks", None) is not None:
            found.add("sinks")
    if window_binds(config, getattr(config, "sliding_window", None)) and \
            not getattr(config, "layer_types", None) and builds_window_masks(model):
        # Mistral: every layer, per call
        found.add("window")
    if getattr(config, "attn_logit_softcapping", None):
        found.add("softcap")
    return tuple(o for o in ("window", "softcap", "sinks") if o in found)


def unwrapped_call(name: str) -> UnsupportedModel:
    """The error of a model on graphcap attention called as a transformers model (its own
    ``forward`` or ``generate()``) rather than through graphcap."""
    return UnsupportedModel(
        f"{name}: this model runs graphcap attention (PrefillLM or graphcap.accelerate set "
        f"attn_implementation={NAME!r} on it), which takes its packed requests from "
        "graphcap's forward context and keeps no transformers KV cache, so the model cannot "
        "be called on its own. A model graphcap.accelerate gave a generate() generates "
        "through model.generate(...) or a pipeline, and graphcap.restore(model) gives it "
        "back as it was. Otherwise generate with graphcap.generate(PrefillLM(model, "
        "logits='last'), prompts, max_new_tokens); run a prefill through the PrefillLM "
        "(lm(input_ids, positions, seq_lens=[...]) or its runner); or give the model back "
        "its own attention, model.set_attn_implementation('sdpa'), to call it or "
        "generate() as before")


# transformers' warning of padded ids given without an attention mask, which GPT-2's
# forward calls: without a mask it reads the ids on the host, a sync no graph captures.
PADDING_CHECK = "warn_if_padding_and_no_attention_mask"


def _no_padding(input_ids, attention_mask) -> None:
    """Packed requests hold no padding: nothing to warn of (:func:`skip_padding_check`)."""


def skip_padding_check(model, skip: bool = True) -> None:
    """Every transformers model in ``model`` skips its padding warning (``skip``), or runs
    it again as written: graphcap attention never takes an attention mask, and the check
    without one reads ``pad_token_id in input_ids[:, [-1, 0]]`` on the host."""
    for module in model.modules():
        if skip and hasattr(type(module), PADDING_CHECK):
            module.__dict__[PADDING_CHECK] = _no_padding
        elif module.__dict__.get(PADDING_CHECK) is _no_padding:
            del module.__dict__[PADDING_CHECK]


def outside_graphcap() -> bool:
    """Whether the running forward has no graphcap forward context (a direct call)."""
    return not torch.compiler.is_compiling() and attention_if_any() is None and \
        current_kv() is None


def graphcap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor, attention_mask, scaling: float | None = None,
                       dropout: float = 0.0, sliding_window: int | None = None,
                       softcap: float | None = None, **kwargs):
    """transformers' attention-function contract: ``query`` ``[1, H, T, D]``, ``key`` and
    ``value`` ``[1, Hkv, T, D]`` (H a multiple of Hkv) -> ``([1, T, H, D], None)``.

    Attention is causal within each request of the forward context's metadata; tokens of
    different requests never see each other. A sliding window, soft-capped scores and
    attention sinks (``s_aux``) go to graphcap's ops as the layer's variant. Masks,
    dropout, keys and values of different head dims and a call outside graphcap's forward
    context are refused (UnsupportedModel, naming what to do), not ignored."""
    name = type(module).__name__
    if outside_graphcap():
        raise unwrapped_call(name)
    if attention_mask is not None:
        raise UnsupportedModel(
            f"{name}: graphcap attention got an attention mask; request boundaries come "
            "from seq_lens (the forward context), so call the model without attention_mask "
            "(a model that builds a mask of its own, as Doge's dynamic one, cannot run on "
            "graphcap attention: run it with transformers' own, no PrefillLM)")
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
    if key.shape[-1] != value.shape[-1]:
        config = getattr(module, "config", None)
        fields = ", ".join(f"{f}={getattr(config, f)}" for f in HEAD_DIM_FIELDS
                           if getattr(config, f, None) is not None)
        raise UnsupportedModel(
            f"{name} attends with keys of head dim {key.shape[-1]} and values of head dim "
            f"{value.shape[-1]}" + (f" (config: {fields})" if fields else "") + ": "
            "graphcap::attention and its paged K/V cache take one head dim for both, so "
            "graphcap.hf cannot run this model; run it with transformers' own attention "
            "(no PrefillLM)")
    # [1, H, T, D] -> [T, H, D]: the split op's packed layout (contiguous for the kernels;
    # compiled, without a guard on the token count: graphcap.compat.guards.contiguous).
    packed = guards.contiguous if torch.compiler.is_compiling() else torch.Tensor.contiguous
    q, k, v = (packed(t[0].transpose(0, 1)) for t in (query, key, value))
    layer = getattr(module, "layer_idx", None)
    variant = variant_of(module, sliding_window, softcap, kwargs.get("s_aux"))
    if SEEN is not None:
        SEEN.append((q, k, v, layer, variant))
    out = torch.empty_like(q)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if isinstance(layer, int) and not isinstance(layer, bool):
        # The forward's cache, if any, read at run time.
        CACHED_ATTENTION(q, k, v, out, float(scale), layer, *variant)
        return out.unsqueeze(0), None
    # Without a layer index nothing writes the cache (a compiled forward's callers find
    # it unwritten and say so; an eager one is told here).
    if not torch.compiler.is_compiling() and current_kv() is not None:
        raise UnsupportedModel(f"{name} has no int layer_idx: graphcap cannot tell "
                               "which layer of the K/V cache it writes")
    ATTENTION(q, k, v, out, float(scale), *variant)
    return out.unsqueeze(0), None


AttentionInterface.register(NAME, graphcap_attention)
