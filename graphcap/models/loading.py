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

from graphcap.models.config import FAMILIES, CheckpointError, args_from_config
from graphcap.models.decoder import Decoder, ModelArgs, in_kernel_order
from graphcap.models.shard import refused_together, shard_whole
from graphcap.opsdb.reference import mxfp4_dequantize

__all__ = ["FAMILIES", "CheckpointError", "args_from_config", "load_checkpoint"]


def _tensors(folder: Path) -> dict[str, tuple[str, object]]:
    """Every tensor name -> (file, safe_open handle) of the checkpoint, as transformers
    reads the folder: ``model.safetensors``, else the shards
    ``model.safetensors.index.json`` lists (an index or a ``*.safetensors`` beside the
    one file, left by an earlier ``save_pretrained``, is no part of it)."""
    from safetensors import SafetensorError, safe_open

    index = folder / "model.safetensors.index.json"
    single = (folder / "model.safetensors").exists()
    where = _json(index).get("weight_map") if index.exists() and not single else None
    if where is not None and not (isinstance(where, dict) and all(
            isinstance(v, str) for v in where.values())):
        raise CheckpointError(f"{index}: its weight_map is not a table of tensor names to "
                              "shard files")
    if index.exists() and not single and where is None:
        raise CheckpointError(f"{index}: no weight_map (the table of tensor names to "
                              "shard files)")
    files = sorted(set(where.values())) if where is not None else ["model.safetensors"]
    if where is None and not (folder / files[0]).exists():
        others = sorted(p.name for p in folder.glob("*.safetensors"))
        pickled = sorted(p.name for p in folder.glob("pytorch_model*.bin"))
        raise CheckpointError(f"{folder}: no model.safetensors (nor an index of shards)"
                              + (f"; it holds {others}: name the model's file "
                                 "model.safetensors" if others else "")
                              + (f"; {pickled} (PyTorch pickles) are not read: convert them "
                                 "to safetensors" if pickled and not others else ""))
    table = {}
    for name in files:
        path = folder / name
        if not path.exists():
            raise CheckpointError(f"{index}: lists {name}, which is missing")
        try:
            handle = safe_open(str(path), framework="pt")
        except (SafetensorError, OSError) as exc:  # truncated, or not safetensors at all
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc}): a "
                                  "partial download, or a Git LFS pointer?") from exc
        for key in handle.keys():  # with an index, each key from the file it names
            if where is None or where.get(key) == name:
                table[key] = (name, handle)
    if where is not None and (lost := sorted(set(where) - set(table))):
        raise CheckpointError(f"{index}: {lost[0]!r} is not in {where[lost[0]]}, which it "
                              f"names as its file ({len(lost)} such keys)")
    return table


def _json(path: Path) -> dict:
    """The JSON object in ``path``; ``CheckpointError`` naming the file where it is not
    one (a truncated download, another kind of file)."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{path}: not readable as JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(value).__name__}, not an object")
    return value


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


def _joined(folder, ours: str, keys: list[str], get, a: ModelArgs,
            tail: tuple[int, ...]) -> torch.Tensor:
    """The tensors of ``keys`` joined along dim 0, each checked first (its rows, and the
    trailing shape ``tail`` of what they make): ``CheckpointError`` naming the key."""
    parts = [get(k) for k in keys]
    for key, t in zip(keys, parts, strict=True):
        rows = _rows(a, key)
        if tuple(t.shape[1:]) != tail or rows is not None and t.shape[0] != rows:
            want = (rows if rows is not None else "?", *tail)
            raise CheckpointError(f"{folder}: {key} has shape {tuple(t.shape)}, expected "
                                  f"{want} (a part of {ours})")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _stacked(folder, experts: list[list[str]], get, a: ModelArgs,
             want: tuple[int, int]) -> torch.Tensor:
    """Each expert's tensors joined (:func:`_joined`), the experts stacked: each joined
    of shape ``want``, else ``CheckpointError`` naming its keys."""
    parts = [_joined(folder, "an expert's projection", keys, get, a, want[1:])
             for keys in experts]
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


def _expert_shapes(a: ModelArgs) -> dict[str, tuple[int, ...]]:
    """gpt-oss's expert tensors as its checkpoints store them: each projection [E, in,
    out], or in MXFP4 its blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""
    e, h, i = a.experts, a.hidden, a.moe_intermediate
    shapes = {"gate_up_proj_bias": (e, 2 * i), "down_proj_bias": (e, h)}
    for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
        shapes[name] = (e, cols, rows)
        shapes[name + "_blocks"] = (e, rows, cols // 32, 16)
        shapes[name + "_scales"] = (e, rows, cols // 32)
    return shapes


def _gpt_oss_experts(get, table, hf: str, ours: str, dtype,
                     shapes: dict) -> dict[str, torch.Tensor]:
    """gpt-oss's experts as ``moe_experts`` takes them: its interleaved gate/up columns
    (gate at even, up at odd) as gate rows then up rows, each projection [E, out, in];
    each tensor of the checkpoint checked against ``shapes`` (:func:`_expert_shapes`)."""
    def read(name: str) -> torch.Tensor:
        return get(hf + name, shapes[name])

    def weight(name: str) -> torch.Tensor:  # [E, out, in]
        if hf + name in table:  # stored [E, in, out]
            return read(name).transpose(1, 2)
        if hf + name + "_blocks" not in table:
            get(hf + name)  # names the tensor that is missing
        return mxfp4(read(name + "_blocks"), read(name + "_scales"), dtype)

    gate_up, bias = weight("gate_up_proj"), read("gate_up_proj_bias")
    return {ours + "w13": torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), 1).contiguous(),
            ours + "b13": torch.cat((bias[:, 0::2], bias[:, 1::2]), 1).contiguous(),
            ours + "w2": weight("down_proj").contiguous()}


def _gpt_oss_mxfp4_experts(get, table, hf: str, ours: str,
                           shapes: dict) -> dict[str, torch.Tensor]:
    """gpt-oss's experts kept as published: each projection's MXFP4 blocks [E, out, G,
    16] as ``moe_experts`` takes them ([E, out, G * 16] bytes), their scales, and the
    biases, gate and up still interleaved (the model says so)."""
    def read(name: str) -> torch.Tensor:
        return get(hf + name, shapes[name])

    out = {ours + "b13": read("gate_up_proj_bias"), ours + "b2": read("down_proj_bias")}
    for name, weight in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        if hf + name + "_blocks" not in table:
            raise CheckpointError(
                f"{hf}{name} is stored unquantized, not as MXFP4 *_blocks and *_scales: "
                "load this checkpoint with experts='dequantized'")
        out[ours + weight] = read(name + "_blocks").flatten(-2).contiguous()
        out[ours + weight + "_scale"] = read(name + "_scales").contiguous()
    return out


def _device(device) -> torch.device:
    """``device`` checked before a checkpoint is read: a name torch cannot parse raises as
    torch does, a device this build or machine lacks ``ValueError`` (not after every
    tensor is read, when the model moves there)."""
    device = torch.device(device)
    try:
        if (device.type == "cuda" and device.index is not None and torch.cuda.is_available()
                and device.index >= torch.cuda.device_count()):
            raise RuntimeError(f"this machine has {torch.cuda.device_count()} CUDA devices")
        torch.empty(0).to(device)  # as the model moves there
    except (RuntimeError, AssertionError) as exc:  # torch asserts on a backend it lacks
        raise ValueError(f"device={str(device)!r}: {exc}") from exc
    return device


def load_checkpoint(folder: str | Path, device="cpu", dtype=torch.float32,
                    tp=None, experts: str = "dequantized") -> Decoder:
    """A reference decoder with the weights of a Hugging Face checkpoint folder; with
    ``tp`` (a :class:`graphcap.tp.TPGroup`) this rank's share of it (read on the host,
    split there, and only the share moved to ``device``). ``experts="mxfp4"``: a gpt-oss
    checkpoint's MXFP4 experts stay MXFP4 (``moe_experts`` reads them so: a quarter of
    the memory); the default dequantizes them to ``dtype``. A rank of ``tp`` that cannot
    read its checkpoint says so to the others, so every rank raises."""
    with refused_together(tp):
        model = _whole(folder, device, dtype, experts)

    def placed(model: Decoder) -> Decoder:  # a share: before the ranks' agreement
        return in_kernel_order(model.to(device=device))

    return placed(model) if tp is None else shard_whole(model, tp, "shard_model", placed)


def _whole(folder, device, dtype, experts) -> Decoder:
    """The whole model of :func:`load_checkpoint`, on the host."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: give a torch floating-point dtype, e.g. "
                        "torch.bfloat16")
    _device(device)  # a bad device fails here, not after the whole checkpoint is read
    folder = Path(folder)
    config_path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory (a checkpoint is a folder of "
                              "config.json and *.safetensors)" if folder.exists() else
                              f"{folder}: no such directory")
    if not config_path.exists():
        raise CheckpointError(f"{folder}: no config.json")
    if experts not in ("dequantized", "mxfp4"):
        raise CheckpointError(f"experts={experts!r}: choose 'dequantized' (the model's dtype) "
                              "or 'mxfp4' (gpt-oss's experts as published)")
    args = args_from_config(_json(config_path), str(config_path))
    if experts == "mxfp4":
        if not args.moe_bias:
            raise CheckpointError(f"{folder}: experts='mxfp4' keeps gpt-oss's MXFP4 experts; "
                                  "this checkpoint is not gpt-oss")
        args = dataclasses.replace(args, moe_mxfp4=True)
    table = _tensors(folder)

    used = set()

    def get(key: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if key not in table:
            raise CheckpointError(f"{folder}: tensor {key!r} is missing from the checkpoint")
        used.add(key)
        tensor = table[key][1].get_tensor(key)
        if shape is not None and tuple(tensor.shape) != shape:
            raise CheckpointError(f"{folder}/{table[key][0]}: {key} has shape "
                                  f"{tuple(tensor.shape)}, expected {shape}")
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
    expected = dict(model.named_parameters())
    state = {ours: _joined(folder, ours, keys, get, args, tuple(expected[ours].shape[1:]))
             for ours, keys in names.items()}
    shapes = _expert_shapes(args)
    for i in range(args.layers):
        if args.moe_mxfp4:
            state.update(_gpt_oss_mxfp4_experts(get, table, f"model.layers.{i}.mlp.experts.",
                                                f"blocks.{i}.mlp.", shapes))
        elif args.moe_bias:
            state.update(_gpt_oss_experts(get, table, f"model.layers.{i}.mlp.experts.",
                                          f"blocks.{i}.mlp.", dtype, shapes))
        elif args.experts:
            e = f"model.layers.{i}.mlp.experts."
            state[f"blocks.{i}.mlp.w13"] = _stacked(folder, [
                [f"{e}{j}.{p}_proj.weight" for p in ("gate", "up")]
                for j in range(args.experts)], get, args,
                (2 * args.moe_intermediate, args.hidden))
            state[f"blocks.{i}.mlp.w2"] = _stacked(folder, [
                [f"{e}{j}.down_proj.weight"] for j in range(args.experts)], get, args,
                (args.hidden, args.moe_intermediate))
    if args.tie_embeddings and "lm_head.weight" in table and not torch.equal(
            get("lm_head.weight"), get("model.embed_tokens.weight")):
        raise CheckpointError(f"{folder}: config.json ties the LM head to the embedding "
                              "(tie_word_embeddings), but the checkpoint's lm_head.weight "
                              "differs from model.embed_tokens.weight: set "
                              "tie_word_embeddings to false to load it as the LM head")
    extra = sorted(k for k in set(table) - used if not k.endswith(DERIVED)
                   and not (args.tie_embeddings and k == "lm_head.weight"))
    if extra:  # another model's (more layers, other projections): refused, not dropped
        raise CheckpointError(f"{folder}/{table[extra[0]][0]}: tensor {extra[0]!r} has no "
                              f"place in the model config.json describes ({len(extra)} "
                              "such tensors)")
    for name, tensor in state.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            sources = names.get(name, [name])
            raise CheckpointError(f"{folder}: {', '.join(sources)} has shape "
                                  f"{tuple(tensor.shape)}, expected {want} for {name}")
    model = model.to_empty(device="cpu")  # its rotary cache computed (Decoder._apply)
    model.load_state_dict(state, strict=False, assign=True)
    if args.tie_embeddings:
        model.lm_head.weight = model.embed.weight
    return model.to(dtype=dtype).eval()
