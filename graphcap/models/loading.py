"""Hugging Face checkpoints into graphcap's reference decoders.

A checkpoint is a folder with ``config.json`` and ``*.safetensors`` (one file, or shards
listed by ``model.safetensors.index.json``), with Hugging Face parameter names. Supported
families: Llama, Qwen2, Qwen3, Qwen3-MoE, gpt-oss (its experts in bf16/float32 or as
published, MXFP4 ``*_blocks``/``*_scales``, dequantized on load), with the rotary
scalings and options docs/models.md lists; a config option the decoders do not build is
refused. Every expected tensor must be present with the expected shape; anything else is
an error naming the file and key.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from graphcap.errors import GraphcapError
from graphcap.models.decoder import Decoder, ModelArgs, experts_to_operand_order
from graphcap.models.rope import Linear, Llama3, Scaling, Yarn, mscale
from graphcap.models.shard import shard_model
from graphcap.opsdb.reference import mxfp4_dequantize

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "gpt_oss")


class CheckpointError(GraphcapError, ValueError):
    """A checkpoint that cannot be loaded; the message names the file and key."""


# Defaults of the keys read below where a family's transformers config differs from
# graphcap's (a config.json written by hand may leave them out).
DEFAULTS = {"qwen2": {"max_window_layers": 28, "sliding_window": 4096},
            "qwen3": {"max_window_layers": 28, "sliding_window": 4096},
            "qwen3_moe": {"norm_topk_prob": False},
            "gpt_oss": {"sliding_window": 128, "rms_norm_eps": 1e-5,
                        "attention_bias": True}}
# The rotary a family's config gives where config.json names none (gpt-oss's YaRN).
ROPE_DEFAULTS = {"gpt_oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                             "beta_slow": 1.0, "truncate": False}}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope(config: dict) -> dict:
    """The rotary parameters a config names: ``rope_parameters``, or ``rope_scaling`` as
    configs written before transformers 5 say, else its family's; ``rope_theta`` and
    ``original_max_position_embeddings`` taken where transformers takes them."""
    given = config.get("rope_parameters") or config.get("rope_scaling")
    rope = dict(given or ROPE_DEFAULTS.get(config.get("model_type"), {}))
    if not given and "rope_theta" in config:
        rope["rope_theta"] = config["rope_theta"]
    rope.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if "original_max_position_embeddings" in config:  # Phi-3 keeps it outside
        rope["original_max_position_embeddings"] = config["original_max_position_embeddings"]
    rope.setdefault("original_max_position_embeddings", config.get("max_position_embeddings"))
    return rope


def _rope_scaling(config: dict, source: str) -> Scaling | None:
    """The rotary scaling a config names (:func:`_rope`), as transformers computes it."""
    rope = _rope(config)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    if rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) != 1.0:
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
    return dict(experts=config["num_local_experts"], top_k=config["num_experts_per_tok"],
                moe_intermediate=config["intermediate_size"], moe_bias=True,
                glu_alpha=config.get("swiglu_alpha", 1.702),
                glu_limit=config.get("swiglu_limit", 7.0),
                window=config.get("sliding_window") or 0, global_every=2, sinks=True)


def _window(config: dict, family: str, source: str) -> int:
    """Llama and the Qwen families: a sliding window on every layer, or none; a window
    on some layers only is refused. Without ``layer_types`` (configs written before
    transformers 5), Qwen2's layers from ``max_window_layers`` on are windowed."""
    windowed = config.get("use_sliding_window") and config.get("sliding_window")
    if family == "qwen3_moe" and windowed:
        raise CheckpointError(f"{source}: use_sliding_window is not supported for qwen3_moe")
    kinds = config.get("layer_types")
    if kinds is None and windowed:
        first = config.get("max_window_layers", 0)
        kinds = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(config["num_hidden_layers"])]
    kinds = set(kinds or ())
    if kinds <= {"full_attention"}:
        return 0
    if kinds == {"sliding_attention"}:
        return config["sliding_window"]
    raise CheckpointError(f"{source}: sliding windows on some layers only (layer_types "
                          f"{sorted(kinds)}, max_window_layers) are not supported: every "
                          "layer windowed or none")


def _refuse_unsupported(config: dict, family: str, source: str) -> None:
    if family == "qwen3_moe" and (config.get("mlp_only_layers") or
                                  config.get("decoder_sparse_step", 1) != 1):
        raise CheckpointError(f"{source}: dense layers among MoE layers (mlp_only_layers, "
                              "decoder_sparse_step) are not supported")
    act = config.get("hidden_act", "silu")
    if family != "gpt_oss" and act != "silu":  # gpt-oss's experts: their own clamped GLU
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported (SiLU only)")
    if config.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias (biases on the MLP's projections) is not "
                              "supported")


def args_from_config(config: dict, source: str = "config.json") -> ModelArgs:
    family = config.get("model_type")
    if family not in FAMILIES:
        raise CheckpointError(f"{source}: model_type {family!r} is not supported; "
                              f"supported: {', '.join(FAMILIES)}")
    _refuse_unsupported(config, family, source)
    config = {**DEFAULTS.get(family, {}), **config}
    try:
        heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        # Qwen2: biases on q, k and v always, none on o; the others: attention_bias on all.
        attention_bias = bool(config.get("attention_bias", False))
        fields = dict(
            vocab_size=config["vocab_size"], hidden=hidden,
            layers=config["num_hidden_layers"], heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or hidden // heads,
            intermediate=config.get("intermediate_size", 0),
            eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=_rope(config)["rope_theta"],
            max_position=config.get("max_position_embeddings", 4096),
            qk_norm=family in ("qwen3", "qwen3_moe"),
            qkv_bias=family == "qwen2" or attention_bias,
            o_bias=family != "qwen2" and attention_bias,
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            experts=(config.get("num_experts") or config.get("num_local_experts", 0))
            if family == "qwen3_moe" else 0,
            top_k=config.get("num_experts_per_tok", 0) if family == "qwen3_moe" else 0,
            moe_intermediate=config.get("moe_intermediate_size", 0),
            norm_topk=bool(config.get("norm_topk_prob", True)),
            rope_scaling=_rope_scaling(config, source),
        )
        if family == "gpt_oss":
            fields.update(_gpt_oss_args(config, source))
        else:
            fields["window"] = _window(config, family, source)
        return ModelArgs(**fields)
    except KeyError as exc:
        raise CheckpointError(f"{source}: missing key {exc.args[0]!r}") from exc


def _tensors(folder: Path) -> dict[str, tuple[str, object]]:
    """Every tensor name -> (file, safe_open handle) of the checkpoint."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    where = json.loads(index.read_text())["weight_map"] if index.exists() else None
    files = sorted(set(where.values())) if where is not None else \
        sorted(p.name for p in folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors files")
    table = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{index}: lists {name}, which is missing")
        handle = safe_open(str(path), framework="pt")
        for key in handle.keys():  # with an index, each key from the file it names
            if where is None or where.get(key) == name:
                table[key] = (name, handle)
    if where is not None and (lost := sorted(set(where) - set(table))):
        raise CheckpointError(f"{index}: {lost[0]!r} is not in {where[lost[0]]}, which it "
                              f"names as its file ({len(lost)} such keys)")
    return table


# Tensors a checkpoint may hold that the model derives itself: rotary frequencies.
DERIVED = ("rotary_emb.inv_freq",)


def _hf_names(a: ModelArgs, i: int) -> dict[str, list[str]]:
    """Our parameter name -> the HF tensors it is made of (concatenated along dim 0)."""
    p, ours = f"model.layers.{i}.", f"blocks.{i}."
    att = p + "self_attn."
    names = {
        ours + "attn_norm": [p + "input_layernorm.weight"],
        ours + "mlp_norm": [p + "post_attention_layernorm.weight"],
        ours + "attn.qkv.weight": [att + f"{x}_proj.weight" for x in "qkv"],
        ours + "attn.o.weight": [att + "o_proj.weight"],
    }
    if a.qkv_bias:
        names[ours + "attn.qkv.bias"] = [att + f"{x}_proj.bias" for x in "qkv"]
    if a.o_bias:
        names[ours + "attn.o.bias"] = [att + "o_proj.bias"]
    if a.sinks:
        names[ours + "attn.sinks"] = [att + "sinks"]
    if a.qk_norm:
        names[ours + "attn.q_norm"] = [att + "q_norm.weight"]
        names[ours + "attn.k_norm"] = [att + "k_norm.weight"]
    if a.moe_bias:  # gpt-oss
        names[ours + "mlp.router.weight"] = [p + "mlp.router.weight"]
        names[ours + "mlp.router.bias"] = [p + "mlp.router.bias"]
        names[ours + "mlp.b2"] = [p + "mlp.experts.down_proj_bias"]
    elif a.experts:
        names[ours + "mlp.router.weight"] = [p + "mlp.gate.weight"]
    else:
        names[ours + "mlp.gate_up.weight"] = [p + "mlp.gate_proj.weight",
                                              p + "mlp.up_proj.weight"]
        names[ours + "mlp.down.weight"] = [p + "mlp.down_proj.weight"]
    return names


def _rows(a: ModelArgs, key: str) -> int | None:
    """The rows a Hugging Face tensor that graphcap joins with others must have."""
    if key.endswith(("q_proj.weight", "q_proj.bias")):
        return a.heads * a.head_dim
    if key.endswith(("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias")):
        return a.kv_heads * a.head_dim
    if ".experts." in key and key.endswith(("gate_proj.weight", "up_proj.weight",
                                            "down_proj.weight")):
        return a.moe_intermediate if "down" not in key else a.hidden
    if key.endswith(("gate_proj.weight", "up_proj.weight")):
        return a.intermediate
    return None


def _joined(folder, ours: str, keys: list[str], get, a: ModelArgs) -> torch.Tensor:
    """The tensors of ``keys`` joined along dim 0, each checked first (its rows, and the
    same trailing shape as the first): ``CheckpointError`` naming the key."""
    parts = [get(k) for k in keys]
    for key, t in zip(keys, parts, strict=True):
        rows = _rows(a, key)
        if t.shape[1:] != parts[0].shape[1:] or rows is not None and t.shape[0] != rows:
            want = (rows if rows is not None else "?", *parts[0].shape[1:])
            raise CheckpointError(f"{folder}: {key} has shape {tuple(t.shape)}, expected "
                                  f"{want} (a part of {ours})")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _stacked(folder, experts: list[list[str]], get, a: ModelArgs,
             want: tuple[int, int]) -> torch.Tensor:
    """Each expert's tensors joined (:func:`_joined`), the experts stacked: each joined
    of shape ``want``, else ``CheckpointError`` naming its keys."""
    parts = [_joined(folder, "an expert's projection", keys, get, a) for keys in experts]
    for keys, t in zip(experts, parts, strict=True):
        if tuple(t.shape) != want:
            raise CheckpointError(f"{folder}: {', '.join(keys)} joined have shape "
                                  f"{tuple(t.shape)}, expected {want}")
    return torch.stack(parts)


def mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """MXFP4 to ``dtype``: ``blocks`` [..., G, 16] uint8 (two 4-bit values a byte, the low
    nibble first) and ``scales`` [..., G] uint8 (a power of two, biased by 127), one scale
    per block of 32 values -> [..., G * 32]."""
    return mxfp4_dequantize(blocks.to(torch.uint8).flatten(-2), scales).to(dtype)


def _gpt_oss_experts(get, table, hf: str, ours: str, dtype) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as ``moe_experts`` takes them: its interleaved gate/up columns
    (gate at even, up at odd) as gate rows then up rows, each projection [E, out, in]."""
    def weight(name: str) -> torch.Tensor:  # [E, out, in]
        if hf + name in table:  # stored [E, in, out]
            return get(hf + name).transpose(1, 2)
        if hf + name + "_blocks" not in table:
            get(hf + name)  # names the tensor that is missing
        blocks, scales = get(hf + name + "_blocks"), get(hf + name + "_scales")
        if blocks.dim() != 4 or blocks.shape[-1] != 16 or blocks.shape[:-1] != scales.shape:
            raise CheckpointError(
                f"{hf}{name}_blocks has shape {tuple(blocks.shape)} and {hf}{name}_scales "
                f"{tuple(scales.shape)}: MXFP4 blocks are [experts, rows, groups, 16] bytes, "
                "their scales [experts, rows, groups]")
        return mxfp4(blocks, scales, dtype)

    gate_up, bias = weight("gate_up_proj"), get(hf + "gate_up_proj_bias")
    return {ours + "w13": torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), 1).contiguous(),
            ours + "b13": torch.cat((bias[:, 0::2], bias[:, 1::2]), 1).contiguous(),
            ours + "w2": weight("down_proj").contiguous()}


def _gpt_oss_mxfp4_experts(get, table, hf: str, ours: str) -> dict[str, torch.Tensor]:
    """gpt-oss's experts kept as published: each projection's MXFP4 blocks [E, out, G,
    16] as ``moe_experts`` takes them ([E, out, G * 16] bytes), their scales, and the
    biases, gate and up still interleaved (the model says so)."""
    out = {ours + "b13": get(hf + "gate_up_proj_bias"), ours + "b2": get(hf + "down_proj_bias")}
    for name, weight in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        if hf + name + "_blocks" not in table:
            raise CheckpointError(
                f"{hf}{name} is stored unquantized, not as MXFP4 *_blocks and *_scales: "
                "load this checkpoint with experts='dequantized'")
        out[ours + weight] = get(hf + name + "_blocks").flatten(-2).contiguous()
        out[ours + weight + "_scale"] = get(hf + name + "_scales").contiguous()
    return out


def load_checkpoint(folder: str | Path, device="cpu", dtype=torch.float32,
                    tp=None, experts: str = "dequantized") -> Decoder:
    """A reference decoder with the weights of a Hugging Face checkpoint folder; with
    ``tp`` (a :class:`graphcap.tp.TPGroup`) this rank's share of it (read on the host,
    split there, and only the share moved to ``device``). ``experts="mxfp4"``: a gpt-oss
    checkpoint's MXFP4 experts stay MXFP4 (``moe_experts`` reads them so: a quarter of
    the memory); the default dequantizes them to ``dtype``."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    if experts not in ("dequantized", "mxfp4"):
        raise CheckpointError(f"experts={experts!r}: choose 'dequantized' (the model's dtype) "
                              "or 'mxfp4' (gpt-oss's experts as published)")
    args = args_from_config(json.loads(config_path.read_text()), str(config_path))
    if experts == "mxfp4":
        if not args.moe_bias:
            raise CheckpointError(f"{folder}: experts='mxfp4' keeps gpt-oss's MXFP4 experts; "
                                  "this checkpoint is not gpt-oss")
        args = dataclasses.replace(args, moe_mxfp4=True)
    table = _tensors(folder)

    used = set()

    def get(key: str) -> torch.Tensor:
        if key not in table:
            raise CheckpointError(f"{folder}: tensor {key!r} is missing from the checkpoint")
        used.add(key)
        tensor = table[key][1].get_tensor(key)
        if not tensor.is_floating_point() and not key.endswith(("_blocks", "_scales")):
            raise CheckpointError(f"{folder}/{table[key][0]}: tensor {key!r} is "
                                  f"{tensor.dtype}; a weight is floating point")
        return tensor

    with torch.device("meta"):
        model = Decoder(args)
    names = {"embed.weight": ["model.embed_tokens.weight"], "norm": ["model.norm.weight"]}
    if not args.tie_embeddings:
        names["lm_head.weight"] = ["lm_head.weight"]
    for i in range(args.layers):
        names.update(_hf_names(args, i))
    state = {ours: _joined(folder, ours, keys, get, args) for ours, keys in names.items()}
    for i in range(args.layers):
        if args.moe_mxfp4:
            state.update(_gpt_oss_mxfp4_experts(get, table, f"model.layers.{i}.mlp.experts.",
                                                f"blocks.{i}.mlp."))
        elif args.moe_bias:
            state.update(_gpt_oss_experts(get, table, f"model.layers.{i}.mlp.experts.",
                                          f"blocks.{i}.mlp.", dtype))
        elif args.experts:
            e = f"model.layers.{i}.mlp.experts."
            state[f"blocks.{i}.mlp.w13"] = _stacked(folder, [
                [f"{e}{j}.{p}_proj.weight" for p in ("gate", "up")]
                for j in range(args.experts)], get, args,
                (2 * args.moe_intermediate, args.hidden))
            state[f"blocks.{i}.mlp.w2"] = _stacked(folder, [
                [f"{e}{j}.down_proj.weight"] for j in range(args.experts)], get, args,
                (args.hidden, args.moe_intermediate))
    extra = sorted(k for k in set(table) - used if not k.endswith(DERIVED)
                   and not (args.tie_embeddings and k == "lm_head.weight"))
    if extra:  # another model's (more layers, other projections): refused, not dropped
        raise CheckpointError(f"{folder}/{table[extra[0]][0]}: tensor {extra[0]!r} has no "
                              f"place in the model config.json describes ({len(extra)} "
                              "such tensors)")
    expected = dict(model.named_parameters())
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            sources = names.get(name, [name])
            raise CheckpointError(f"{folder}: {', '.join(sources)} has shape "
                                  f"{tuple(tensor.shape)}, expected {want} for {name}")
    model = model.to_empty(device="cpu")
    model.load_state_dict(state, strict=False, assign=True)
    model.reset_rope("cpu")
    if args.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    model = model.to(dtype=dtype).eval()
    if tp is not None:
        model = shard_model(model, tp)
    model = model.to(device=device)
    model.reset_rope(device)
    experts_to_operand_order(model)
    return model
