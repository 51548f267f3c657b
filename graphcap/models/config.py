"""A Hugging Face ``config.json`` as the :class:`~graphcap.models.decoder.ModelArgs` of a
reference decoder, read as transformers reads it: each family's defaults for keys it
leaves out, rotary scaling (``rope_parameters``, or ``rope_scaling`` of configs written
before transformers 5), windows, biases; an option the decoders do not build is refused
(:class:`CheckpointError`), never ignored.
"""

from __future__ import annotations

from graphcap.errors import GraphcapError
from graphcap.models.decoder import ModelArgs
from graphcap.models.rope import Linear, Llama3, Scaling, Yarn, mscale

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")


class CheckpointError(GraphcapError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file and key."""


# Defaults of the keys read below where a family's transformers config differs from
# graphcap's (a config.json written by hand may leave them out).
DEFAULTS = {"llama": {"max_position_embeddings": 2048},
            "qwen2": {"max_window_layers": 28, "sliding_window": 4096,
                      "max_position_embeddings": 32768},
            "qwen3": {"max_window_layers": 28, "sliding_window": 4096,
                      "max_position_embeddings": 32768, "head_dim": 128},
            "qwen3_moe": {"norm_topk_prob": False, "max_position_embeddings": 32768,
                          "num_experts_per_tok": 8, "moe_intermediate_size": 768},
            "gpt_oss": {"sliding_window": 128, "rms_norm_eps": 1e-5,
                        "attention_bias": True, "max_position_embeddings": 131072,
                        "head_dim": 64, "num_key_value_heads": 8, "num_local_experts": 128,
                        "num_experts_per_tok": 4, "intermediate_size": 2880}}
# Keys a family's transformers config reads under another name (its attribute_map).
ALIASES = {"gpt_oss": {"num_experts": "num_local_experts"}}
THETA = {"gpt_oss": 150000.0}  # a family's rotary base where the config names none
# The rotary a family's config gives where config.json names none (gpt-oss's YaRN).
ROPE_DEFAULTS = {"gpt_oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False}}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope(config: dict) -> dict:
    """The rotary parameters a config names: ``rope_scaling`` as configs written before
    transformers 5 say, else ``rope_parameters`` (transformers takes the first where a
    config names both), else its family's; ``rope_theta`` and
    ``original_max_position_embeddings`` taken where transformers takes them."""
    given = config.get("rope_scaling") or config.get("rope_parameters")
    rope = dict(given or ROPE_DEFAULTS.get(config.get("model_type"), {}))
    if not given and "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    rope.setdefault("rope_theta", config.get(
        "rope_theta", THETA.get(config.get("model_type"), 10000.0)))
    if "original_max_position_embeddings" in config:  # Phi-3 keeps it outside
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return rope


def _rope_scaling(config: dict, source: str) -> Scaling | None:
    """The rotary scaling a config names (:func:`_rope`), as transformers computes it."""
    rope = _rope(config)
    nested = sorted(k for k, v in rope.items() if isinstance(v, dict))
    if nested:  # transformers 5's per-layer-type form: read flat, it would name nothing
        raise CheckpointError(f"{source}: rotary parameters of each layer type ({nested}) "
                              "are not supported: one rope_parameters for every layer")
    kind = rope.get("rope_type", rope.get("type")) or "default"
    # The dict's own, else the top-level one; null is none (transformers sets no null)
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0:
        raise CheckpointError(f"{source}: partial_rotary_factor (rotary over part of a "
                              "head) is not supported")
    if kind == "default":
        return None
    if kind == "linear":
        return Linear(rope["factor"])
    if kind == "llama3":
        return Llama3(rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                      rope["original_max_position_embeddings"])
    if kind != "yarn":
        raise CheckpointError(f"{source}: rope_type {kind!r} is not supported; supported: "
                              f"{', '.join(ROPE_TYPES)}")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or config["max_position_embeddings"] / original
    attention = rope.get("attention_factor")
    if attention is None and rope.get("mscale") and rope.get("mscale_all_dim"):
        attention = mscale(factor, rope["mscale"]) / mscale(factor, rope["mscale_all_dim"])
    return Yarn(factor, original, rope.get("beta_fast") or 32.0,
                rope.get("beta_slow") or 1.0, rope.get("truncate", True), attention)


def _gpt_oss_args(config: dict, source: str) -> dict:
    """The fields gpt-oss adds: alternating windows (``layer_types``), sinks, biases and
    the clamped GLU."""
    expected = ["sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(config["num_hidden_layers"])]
    kinds = config.get("layer_types") or expected
    if list(kinds) != expected:
        raise CheckpointError(f"{source}: layer_types {kinds} are not gpt-oss's alternation "
                              "(sliding_attention on even layers, full_attention on odd)")
    alpha, limit = config.get("swiglu_alpha", 1.702), config.get("swiglu_limit", 7.0)
    # transformers clamps at any limit (0 too) and gates by sigmoid(alpha * gate) at any
    # alpha; moe_experts reads limit 0 as no clamp and alpha 0 as SwiGLU
    if not (isinstance(alpha, int | float) and isinstance(limit, int | float)
            and alpha > 0 and limit > 0):
        raise CheckpointError(f"{source}: swiglu_alpha {alpha!r} and swiglu_limit {limit!r}: "
                              "gpt-oss's clamped GLU is supported with both > 0")
    return dict(experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                moe_intermediate=config["intermediate_size"], moe_bias=True,
                glu_alpha=alpha, glu_limit=limit,
                window=config.get("sliding_window") or 0, global_every=2, sinks=True,
                norm_topk=True)  # its router: a softmax over the top k, whatever the config


def _window(config: dict, family: str, source: str) -> int:
    """The Qwen families: a sliding window on every layer, or none; a window
    on some layers only is refused. Without ``layer_types`` (configs written before
    transformers 5), Qwen2's layers from ``max_window_layers`` on are windowed. With
    ``use_sliding_window`` off transformers nulls ``sliding_window`` (no layer has one),
    and Qwen3-MoE reads no ``layer_types``."""
    windowed = config.get("sliding_window") if config.get("use_sliding_window") else None
    if family == "qwen3_moe" and windowed:
        raise CheckpointError(f"{source}: use_sliding_window is not supported for qwen3_moe")
    kinds = config.get("layer_types") if family != "qwen3_moe" else None
    if kinds is None and windowed:
        first = config.get("max_window_layers", 0)
        kinds = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    kinds = set(kinds or ())
    if kinds <= {"full_attention"}:
        return 0
    if kinds == {"sliding_attention"}:
        return windowed or 0  # null: no window, as transformers has it
    raise CheckpointError(f"{source}: sliding windows on some layers only (layer_types "
                          f"{sorted(kinds)}, max_window_layers) are not supported: every "
                          "layer windowed or none")


def _given(config: dict, key: str, default):
    """``config[key]``, or ``default`` where it is missing or null (as transformers reads
    a null of these keys)."""
    value = config.get(key)
    return default if value is None else value


def _experts(config: dict, source: str) -> int:
    if "num_experts" not in config and "num_local_experts" not in config:
        return 128  # transformers' default
    experts = config.get("num_experts") or config.get("num_local_experts")
    if not experts:
        raise CheckpointError(f"{source}: a qwen3_moe config names no num_experts")
    return experts


# Keys of sizes: each a positive integer where given (a missing required one is named by
# the KeyError below); null, where transformers reads it as a default, takes that.
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
NULL_READ = ("num_key_value_heads", "head_dim", "max_position_embeddings")
# The sizes a family's model is built of besides (transformers reads no null of them; a
# qwen3_moe's null num_experts is named by _experts), and no key a family does not read.
FAMILY_SIZES = {"qwen3_moe": ("num_experts_per_tok", "moe_intermediate_size"),
                "gpt_oss": ("intermediate_size", "num_local_experts", "num_experts_per_tok")}
DENSE_SIZES = ("intermediate_size",)


def _check_sizes(config: dict, family: str, source: str) -> None:
    """Refuse sizes no model is built of, naming the key, before any is used: a size that
    is not a positive integer, query heads that do not share the key/value heads evenly,
    more experts a token than the layer has."""
    nullable = (*NULL_READ, "num_experts") if family == "qwen3_moe" else NULL_READ
    for key in (*SIZES, *nullable, *FAMILY_SIZES.get(family, DENSE_SIZES)):
        value = config.get(key)
        if key in config and (value is not None or key not in nullable) and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise CheckpointError(f"{source}: {key} {value!r} is not a positive integer")
    heads = config.get("num_attention_heads")
    kv_heads = _given(config, "num_key_value_heads", heads)
    if heads is not None and heads % kv_heads:
        raise CheckpointError(f"{source}: num_attention_heads {heads} is not a multiple of "
                              f"num_key_value_heads {kv_heads}: each key/value head serves "
                              "a group of query heads of one size")


def _refuse_unsupported(config: dict, family: str, source: str) -> None:
    if family == "qwen3_moe" and (config.get("mlp_only_layers") or
                                  config.get("decoder_sparse_step", 1) != 1):
        raise CheckpointError(f"{source}: dense layers among MoE layers (mlp_only_layers, "
                              "decoder_sparse_step) are not supported")
    act = config.get("hidden_act", "silu")
    # transformers: "swish" is SiLU too; gpt-oss's experts have their own clamped GLU
    if family != "gpt_oss" and act not in ("silu", "swish"):
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (SiLU only)")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias (biases on the MLP's projections) is not "
                              "supported")
    quantized = config.get("quantization_config")
    method = quantized.get("quant_method") if isinstance(quantized, dict) else quantized
    # transformers quantizes (or reads quantized) what such a config names: not this model
    if quantized and not (family == "gpt_oss" and method == "mxfp4"):
        raise CheckpointError(f"{source}: quantization_config (quant_method {method!r}) is "
                              "not supported: only gpt-oss's MXFP4 experts are read; load an "
                              "unquantized checkpoint")


def args_from_config(config: dict, source: str = "config.json") -> ModelArgs:
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{source}: model_type {family!r} is not supported; "
                              f"supported: {', '.join(FAMILIES)}")
    _refuse_unsupported(config, family, source)
    aliased = {ours: config[theirs] for theirs, ours in ALIASES.get(family, {}).items()
               if theirs in config and ours not in config}
    config = {**DEFAULTS.get(family, {}), **config, **aliased}
    _check_sizes(config, family, source)
    try:
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # Qwen2: biases on q, k and v always, none on o; the others: attention_bias on all.
        attention_bias = bool(config.get("attention_bias", False))
        fields = dict(
            vocab_size=config["vocab_size"], hidden=hidden,
            layers=config["num_hidden_layers"], heads=heads,
            kv_heads=_given(config, "num_key_value_heads", heads),
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=_given(config, "intermediate_size", 0),
            eps=_given(config, "rms_norm_eps", 1e-6),
            rope_theta=_rope(config)["rope_theta"],
            max_position=_given(config, "max_position_embeddings", 4096),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            experts=_experts(config, source) if family == "qwen3_moe" else 0,
            top_k=config.get("num_experts_per_tok", 0) if family == "qwen3_moe" else 0,
            moe_intermediate=config.get("moe_intermediate_size", 0),
            norm_topk=bool(config.get("norm_topk_prob", True)),
            rope_scaling=_rope_scaling(config, source),
        )
        scaling = fields["rope_scaling"]
        if isinstance(scaling, Yarn):  # YaRN serves factor times its original context
            fields["max_position"] = max(fields["max_position"], int(
                scaling.factor * scaling.original_max_position))
        if family == "gpt_oss":
            fields.update(_gpt_oss_args(config, source))
        else:  # transformers' Llama reads no window field
            fields["window"] = 0 if family == "llama" else _window(config, family, source)
        if fields["top_k"] > fields["experts"]:
            raise CheckpointError(f"{source}: num_experts_per_tok {fields['top_k']} is more "
                                  f"than the {fields['experts']} experts of a layer")
        return ModelArgs(**fields)
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing key {exc.args[0]!r}") from exc
