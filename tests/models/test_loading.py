"""Hugging Face checkpoints (safetensors, sharded or not) into the reference decoders:
logits match transformers' own model; bad checkpoints fail naming the file and key."""

from __future__ import annotations

import json
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from graphcap.models.loading import CheckpointError, args_from_config, load_checkpoint
from graphcap.models.rope import Yarn

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True),
    # A window shorter than the 17-token prompt; YaRN over 64 positions, untruncated.
    "gpt_oss": lambda: transformers.GptOssConfig(
        **COMMON, head_dim=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=8,
        rope_parameters=dict(rope_type="yarn", rope_theta=1000.0, factor=4.0,
                             original_max_position_embeddings=64, beta_fast=32.0,
                             beta_slow=1.0, truncate=False)),
}


def saved(tmp_path, family, config=None, **save_kwargs):
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(config or CONFIGS[family](),
                                                       attn_implementation="eager").eval()
    with torch.no_grad():  # nonzero biases and sinks, where transformers starts them at 0;
        for name, p in hf.named_parameters():  # norms of their own, peaked attention and
            if name.endswith(("bias", "sinks")):  # routing: a swapped norm or a dropped
                p.normal_(0, 0.5)  # scaling moves the logits
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "router.weight",
                                "mlp.gate.weight")):
                p.mul_(4.0)
    hf.save_pretrained(tmp_path, **save_kwargs)
    return hf


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_logits_match_transformers_with_identical_weights(tmp_path, family):
    assert_loads_as_transformers(tmp_path, saved(tmp_path, family))


def assert_loads_as_transformers(folder, hf):
    """The checkpoint in ``folder`` loads to the logits ``hf`` gives, 17 tokens."""
    ids = torch.randint(0, 128, (1, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits[0]
        got = load_checkpoint(folder)(ids[0], torch.arange(17), seq_lens=[17])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


QWEN3 = dict(COMMON, head_dim=16)
# Rotary scalings over short original contexts (they bind within the 17-token prompt),
# biases on every attention projection, windows on every layer.
VARIANTS = {
    "llama3 rope": lambda: transformers.LlamaConfig(**COMMON, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32)),
    "linear rope": lambda: transformers.Qwen3Config(**QWEN3, rope_parameters=dict(
        rope_type="linear", rope_theta=10000.0, factor=4.0)),
    "yarn, its attention factor": lambda: transformers.Qwen2Config(
        **COMMON, rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                       original_max_position_embeddings=16,
                                       attention_factor=0.8)),
    "yarn, mscale": lambda: transformers.Qwen3Config(**QWEN3, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=8.0, original_max_position_embeddings=16,
        mscale=1.0, mscale_all_dim=0.5)),
    "llama attention_bias": lambda: transformers.LlamaConfig(**COMMON, attention_bias=True),
    "qwen3 attention_bias": lambda: transformers.Qwen3Config(**QWEN3, attention_bias=True),
    "qwen2 windows": lambda: transformers.Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=0),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_load_as_transformers_builds_them(tmp_path, variant):
    config = VARIANTS[variant]()
    assert_loads_as_transformers(tmp_path, saved(tmp_path, config.model_type, config))


def test_a_config_written_before_transformers_5_names_its_rope_scaling(tmp_path):
    # Llama 3.1 as published: rope_theta and rope_scaling, no rope_parameters.
    hf = saved(tmp_path, "llama", VARIANTS["llama3 rope"]())
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    scaling = config.pop("rope_parameters")
    config["rope_theta"] = scaling.pop("rope_theta")
    config["rope_scaling"] = scaling
    path.write_text(json.dumps(config))
    assert_loads_as_transformers(tmp_path, hf)


def test_a_config_naming_rope_scaling_and_rope_parameters_reads_rope_scaling():
    config = dict(model_type="llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, rope_theta=10000.0,
                  rope_parameters={"rope_type": "linear", "factor": 2.0},
                  rope_scaling={"rope_type": "linear", "factor": 8.0})
    want = transformers.AutoConfig.for_model(**config).rope_parameters["factor"]
    assert args_from_config(config).rope_scaling.factor == want == 8.0


@pytest.mark.parametrize("change, needle", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
     "rope_type 'dynamic' is not supported; supported: default, linear, llama3, yarn"),
    ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor"),
    ({"layer_types": ["full_attention"] * 2, "rope_parameters": {"full_attention": {
        "rope_type": "linear", "rope_theta": 1e6, "factor": 4.0}}},
     "rotary parameters of each layer type (['full_attention'])"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "max_window_layers": 1}, "sliding windows on some layers only"),
    ({"model_type": "qwen3", "layer_types": ["sliding_attention", "full_attention"],
      "sliding_window": 8}, "sliding windows on some layers only"),
    # transformers would quantize the weights (or read them quantized): another model
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "quantization_config (quant_method 'fp8') is not supported"),
    ({"model_type": "qwen3", "quantization_config": {"quant_method": "bitsandbytes"}},
     "quantization_config (quant_method 'bitsandbytes')"),
    # transformers clamps gpt-oss's GLU at a limit of 0 too, and gates by sigmoid(0 * gate)
    # at alpha 0: moe_experts would read them as no clamp and SwiGLU
    ({"model_type": "gpt_oss", "num_attention_heads": 8, "swiglu_limit": 0.0},
     "swiglu_limit 0.0"),
    ({"model_type": "gpt_oss", "num_attention_heads": 8, "swiglu_alpha": 0.0},
     "swiglu_alpha 0.0"),
    ({"model_type": "gpt_oss", "num_attention_heads": 8, "swiglu_limit": -1.0},
     "both > 0")])
def test_config_fields_that_change_the_model_are_refused_not_ignored(change, needle):
    config = dict(model_type="llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        args_from_config({**config, **change})


@pytest.mark.parametrize("change, needle", [
    ({"num_key_value_heads": 3},
     "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ({"num_key_value_heads": 0}, "num_key_value_heads 0 is not a positive integer"),
    ({"num_attention_heads": "4"}, "num_attention_heads '4' is not a positive integer"),
    ({"hidden_size": 64.0}, "hidden_size 64.0 is not a positive integer"),
    ({"vocab_size": None}, "vocab_size None is not a positive integer"),
    ({"num_hidden_layers": True}, "num_hidden_layers True is not a positive integer"),
    ({"head_dim": -16}, "head_dim -16 is not a positive integer"),
    ({"max_position_embeddings": 0}, "max_position_embeddings 0"),
    ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 8},
     "num_experts_per_tok 8 is more than the 4 experts"),
    # null where transformers reads no default: its model is built of None
    ({"model_type": "qwen3_moe", "num_experts_per_tok": None},
     "num_experts_per_tok None is not a positive integer"),
    ({"model_type": "gpt_oss", "num_attention_heads": 8, "num_local_experts": None},
     "num_local_experts None is not a positive integer"),
    ({"intermediate_size": None}, "intermediate_size None is not a positive integer")])
def test_a_config_whose_sizes_build_no_model_is_refused_naming_the_key(change, needle):
    config = dict(model_type="llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        args_from_config({**config, **change})


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_sizes_a_dense_familys_config_does_not_read_are_not_refused(family):
    # transformers' dense configs keep unknown keys and build nothing of them
    config = dict(model_type=family, vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=96, num_experts=0,
                  num_experts_per_tok=0, moe_intermediate_size=None, num_local_experts=0)
    args = args_from_config(config)
    assert (args.experts, args.top_k, args.intermediate) == (0, 0, 96)
    transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))


def test_a_family_default_a_config_leaves_out_is_the_familys_not_graphcaps():
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                intermediate_size=64, num_local_experts=8)
    assert not args_from_config({**base, "model_type": "qwen3_moe"}).norm_topk
    moe = {k: v for k, v in base.items() if k not in (
        "num_experts_per_tok", "moe_intermediate_size", "num_experts", "num_local_experts")}
    moe = args_from_config({**moe, "model_type": "qwen3_moe"})
    assert (moe.top_k, moe.moe_intermediate, moe.experts) == (8, 768, 128)
    # Fields a family's transformers code never reads: gpt-oss's router renormalises its
    # top k always; Llama has no windows.
    assert args_from_config({**base, "model_type": "gpt_oss", "norm_topk_prob": False}
                            ).norm_topk
    for window in ({"use_sliding_window": True, "sliding_window": 5},
                   {"layer_types": ["sliding_attention"] * 2, "sliding_window": 5}):
        assert args_from_config({**base, "model_type": "llama", **window}).window == 0
    assert args_from_config({**base, "model_type": "llama", "hidden_act": "swish"})
    oss = args_from_config({**base, "model_type": "gpt_oss"})
    assert (oss.window, oss.eps, oss.o_bias, oss.rope_theta) == (128, 1e-5, True, 150000.0)
    assert oss.rope_scaling == Yarn(32.0, 4096, 32.0, 1.0, truncate=False)
    assert (oss.max_position, oss.head_dim, oss.kv_heads) == (131072, 64, 8)
    yarn_only = args_from_config({**base, "model_type": "gpt_oss", "rope_parameters": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}})
    assert yarn_only.rope_theta == 150000.0  # the family's base, as transformers takes it
    # Qwen2/3 windows from layer max_window_layers (28) on: none of 24 layers, some of 32.
    windowed = {**base, "model_type": "qwen2", "use_sliding_window": True}
    assert args_from_config({**windowed, "num_hidden_layers": 24}).window == 0
    with pytest.raises(CheckpointError, match="sliding windows on some layers only"):
        args_from_config({**windowed, "num_hidden_layers": 32})
    # YaRN's original context: the config's max_position_embeddings where it names none.
    yarn = args_from_config({**base, "model_type": "qwen3", "max_position_embeddings": 256,
                             "rope_parameters": {"rope_type": "yarn", "factor": 4.0}})
    assert yarn.rope_scaling.original_max_position == 256
    # ... and the context it serves: factor times that (Qwen's long-context YaRN keeps
    # max_position_embeddings at the original, as vLLM reads it)
    assert yarn.max_position == 1024
    named = args_from_config({**base, "model_type": "qwen3", "max_position_embeddings": 256,
                              "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 128}})
    assert named.max_position == 512 and oss.max_position == 131072


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path):
    hf = saved(tmp_path, "qwen3", max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ours = load_checkpoint(tmp_path)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids[0], torch.arange(5), seq_lens=[5]),
                                   hf(ids).logits[0], atol=1e-5, rtol=1e-5)


def test_a_folder_of_one_file_and_an_index_loads_as_transformers_reads_it(tmp_path):
    # save_pretrained leaves the other layout's index (or file) behind: transformers reads
    # model.safetensors where there is one, whatever index lies beside it.
    first = saved(tmp_path, "qwen3")
    torch.manual_seed(1)
    second = transformers.AutoModelForCausalLM.from_config(CONFIGS["qwen3"]()).eval()
    second.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors").exists()
    assert (tmp_path / "model.safetensors.index.json").exists()
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(reference.lm_head.weight, first.lm_head.weight)
    assert_loads_as_transformers(tmp_path, reference)
    (tmp_path / "model.safetensors").unlink()  # the shards, as transformers then reads
    assert_loads_as_transformers(tmp_path, second)


def _rewrite(tmp_path, edit):
    path = next(tmp_path.glob("*.safetensors"))
    tensors = safetensors_torch.load_file(str(path))
    edit(tensors)
    safetensors_torch.save_file(tensors, str(path))


def test_another_safetensors_file_beside_an_unsharded_checkpoint_is_no_part_of_it(tmp_path):
    # An older copy of the weights (an EMA, a conversion) beside model.safetensors: as
    # transformers reads the folder, only model.safetensors is the model.
    hf = saved(tmp_path, "llama")
    tensors = safetensors_torch.load_file(str(tmp_path / "model.safetensors"))
    safetensors_torch.save_file({k: v + 0.1 for k, v in tensors.items()},
                                str(tmp_path / "model_ema.safetensors"))
    assert_loads_as_transformers(tmp_path, hf)
    (tmp_path / "model.safetensors").rename(tmp_path / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"no model.safetensors \(nor an index of "
                                              r"shards\); it holds \['model_ema"):
        load_checkpoint(tmp_path)


def test_a_tied_config_with_an_lm_head_of_its_own_is_refused_not_dropped(tmp_path):
    config = CONFIGS["qwen3"]()
    config.tie_word_embeddings = True
    saved(tmp_path, "qwen3", config)
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight": torch.randn(128, 64)}))
    with pytest.raises(CheckpointError, match="lm_head.weight differs from "
                                              "model.embed_tokens.weight"):
        load_checkpoint(tmp_path)
    _rewrite(tmp_path, lambda t: t.update({"lm_head.weight":
                                           t["model.embed_tokens.weight"].clone()}))
    load_checkpoint(tmp_path)  # the same values: tied


def test_null_config_values_take_what_transformers_takes():
    config = dict(model_type="qwen2", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=None, rms_norm_eps=None,
                  layer_types=["sliding_attention"] * 2, sliding_window=None)
    args = args_from_config(config)
    assert (args.kv_heads, args.eps, args.window) == (4, 1e-6, 0)
    with pytest.raises(CheckpointError, match="names no num_experts"):
        args_from_config({**config, "model_type": "qwen3_moe", "layer_types": None,
                          "num_experts": None})


def test_a_window_use_sliding_window_leaves_off_is_no_window(tmp_path):
    # transformers nulls sliding_window where use_sliding_window is off, and Qwen3-MoE
    # reads no layer_types: its layers attend to every token before them, as ours do
    saved(tmp_path, "qwen3_moe")
    path = tmp_path / "config.json"
    off = dict(use_sliding_window=False, sliding_window=8,
               layer_types=["sliding_attention"] * 2)
    path.write_text(json.dumps({**json.loads(path.read_text()), **off}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", use_cache=False).eval()  # (its cache
    assert_loads_as_transformers(tmp_path, hf)  # builds a window layer of no size)
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    for family in ("qwen2", "qwen3"):
        assert args_from_config({**base, **off, "model_type": family}).window == 0


def test_a_missing_tensor_is_named(tmp_path):
    saved(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match="model.layers.1.self_attn.k_proj.weight"):
        load_checkpoint(tmp_path)


def test_a_misshapen_tensor_is_named_with_both_shapes(tmp_path):
    saved(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.update({"model.norm.weight": torch.ones(63)}))
    with pytest.raises(CheckpointError, match=r"model.norm.weight has shape \(63,\), "
                                              r"expected \(64,\)"):
        load_checkpoint(tmp_path)


def test_a_tensor_the_config_has_no_place_for_is_refused_not_dropped(tmp_path):
    saved(tmp_path, "llama")  # a third layer's tensors beside the config's two
    _rewrite(tmp_path, lambda t: t.update({"model.layers.2.input_layernorm.weight":
                                           torch.ones(64)}))
    with pytest.raises(CheckpointError, match=r"'model.layers.2.input_layernorm.weight' "
                                              r"has no place in the model config.json"):
        load_checkpoint(tmp_path)


def test_each_part_of_a_joined_projection_is_checked_by_name(tmp_path):
    # q [48, 64] and k [48, 64]: 96 rows together, as q (64) and k (32) should have.
    saved(tmp_path, "llama")
    key = "model.layers.0.self_attn."
    _rewrite(tmp_path, lambda t: t.update({key + "q_proj.weight": torch.ones(48, 64),
                                           key + "k_proj.weight": torch.ones(48, 64)}))
    with pytest.raises(CheckpointError, match=r"q_proj.weight has shape \(48, 64\), "
                                              r"expected \(64, 64\)"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("key, shape", [("self_attn.q_proj.weight", (64, 63)),
                                        ("self_attn.q_proj.weight", (64, 64, 1)),
                                        ("mlp.gate_proj.weight", (96,))])
def test_the_first_part_of_a_joined_projection_misshapen_is_named_not_the_next(
        tmp_path, key, shape):
    # Each part is checked against the model's shape, not against the first part: the
    # well-shaped k_proj or up_proj after it is not the one blamed.
    saved(tmp_path, "llama")
    key = "model.layers.1." + key
    _rewrite(tmp_path, lambda t: t.update({key: torch.ones(shape)}))
    with pytest.raises(CheckpointError, match=re.escape(f"{key} has shape {shape}")):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("part, shape", [("gate_proj", (32, 63)), ("down_proj", (64, 31))])
def test_an_experts_misshapen_projection_is_named(tmp_path, part, shape):
    saved(tmp_path, "qwen3_moe")
    e = "model.layers.1.mlp.experts.3."
    parts = {e + part + ".weight": torch.ones(shape)}
    if part == "gate_proj":
        parts[e + "up_proj.weight"] = torch.ones(shape)  # the pair agrees, the model not
    _rewrite(tmp_path, lambda t: t.update(parts))
    with pytest.raises(CheckpointError, match=re.escape(f"{e}{part}.weight")):
        load_checkpoint(tmp_path)


def test_a_weight_stored_as_integers_is_refused(tmp_path):
    saved(tmp_path, "llama")
    _rewrite(tmp_path, lambda t: t.update(
        {"model.norm.weight": torch.ones(64, dtype=torch.int64)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' is torch.int64"):
        load_checkpoint(tmp_path)


def test_a_sharded_checkpoint_reads_each_tensor_from_the_file_its_index_names(tmp_path):
    # A listed shard that also holds model.norm.weight, which the index puts elsewhere
    # (an older copy of it, here 7s): the index decides.
    saved(tmp_path, "qwen3", max_shard_size="40KB")
    path = tmp_path / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    moved = "model.embed_tokens.weight"
    tensor = safetensors_torch.load_file(str(tmp_path / index["weight_map"][moved]))[moved]
    safetensors_torch.save_file({moved: tensor, "model.norm.weight": torch.full((64,), 7.0)},
                                str(tmp_path / "zzz-moved.safetensors"))
    index["weight_map"][moved] = "zzz-moved.safetensors"
    path.write_text(json.dumps(index))
    ours = load_checkpoint(tmp_path)
    assert not (ours.norm == 7).any() and torch.equal(ours.embed.weight, tensor)


def test_an_unsupported_family_names_its_model_type(tmp_path):
    saved(tmp_path, "llama")
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="config.json: model_type 'mamba'"):
        load_checkpoint(tmp_path)


def test_a_folder_without_config_says_so(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_gpt_oss_experts_published_in_mxfp4_load_as_transformers_dequantizes_them(tmp_path):
    """gpt-oss's checkpoints store each expert projection as MXFP4 ``*_blocks`` and
    ``*_scales``: loaded, the model gives the logits of transformers' model holding what
    transformers' own dequantization makes of them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = saved(tmp_path, "gpt_oss")
    gen = torch.Generator().manual_seed(2)

    def quantize(tensors):
        for i in range(2):
            for name in ("gate_up_proj", "down_proj"):
                key = f"model.layers.{i}.mlp.experts.{name}"
                rows, cols = tensors.pop(key).transpose(1, 2).shape[1:]  # [E, out, in]
                blocks = torch.randint(0, 256, (8, rows, cols // 32, 16), generator=gen,
                                       dtype=torch.uint8)
                scales = torch.randint(122, 128, (8, rows, cols // 32), generator=gen,
                                       dtype=torch.uint8)
                tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
                with torch.no_grad():
                    hf.get_parameter(key).copy_(
                        convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))

    _rewrite(tmp_path, quantize)
    ours = load_checkpoint(tmp_path)
    ids = torch.randint(0, 128, (1, 17), generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids[0], torch.arange(17), seq_lens=[17]),
                                   hf(ids).logits[0], atol=1e-4, rtol=1e-4)
    kept = load_checkpoint(tmp_path, experts="mxfp4")  # a quarter of the bytes, bf16 rows
    assert kept.blocks[0].mlp.w13.dtype == torch.uint8
    with torch.no_grad():
        torch.testing.assert_close(kept(ids[0], torch.arange(17), seq_lens=[17]),
                                   hf(ids).logits[0], atol=3e-2, rtol=3e-2)
    _rewrite(tmp_path, lambda t: t.pop("model.layers.1.mlp.experts.down_proj_scales"))
    with pytest.raises(CheckpointError, match="down_proj_scales"):
        load_checkpoint(tmp_path)
    with pytest.raises(CheckpointError, match="experts='fp8'.*choose 'dequantized'"):
        load_checkpoint(tmp_path, experts="fp8")


def test_keeping_mxfp4_experts_needs_a_gpt_oss_checkpoint_that_stores_them(tmp_path):
    saved(tmp_path / "oss", "gpt_oss")  # experts stored unquantized
    with pytest.raises(CheckpointError, match="gate_up_proj is stored unquantized.*"
                                              "experts='dequantized'"):
        load_checkpoint(tmp_path / "oss", experts="mxfp4")
    saved(tmp_path / "llama", "llama")
    with pytest.raises(CheckpointError, match="this checkpoint is not gpt-oss"):
        load_checkpoint(tmp_path / "llama", experts="mxfp4")


@settings(max_examples=80, deadline=None)
@given(factor=st.sampled_from([2.0, 4.0, 8.0, 16.0, 32.0, 40.0]),
       original=st.sampled_from([256, 2048, 4096, 8192, 32768]),
       theta=st.sampled_from([1e4, 2.5e4, 150000.0, 5e5, 1e6]),
       head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]), truncate=st.booleans(),
       beta_fast=st.sampled_from([16.0, 32.0]), beta_slow=st.sampled_from([1.0, 2.0]))
def test_yarn_frequencies_are_transformers_bits(factor, original, theta, head_dim,
                                                truncate, beta_fast, beta_slow):
    # A last-bit difference in a frequency is a phase error that grows with the position
    # (6e-5 at 32k positions): the same frequencies, bit for bit.
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = dict(rope_type="yarn", rope_theta=theta, factor=factor, truncate=truncate,
                original_max_position_embeddings=original, beta_fast=beta_fast,
                beta_slow=beta_slow)
    config = dict(model_type="llama", vocab_size=8, hidden_size=2 * head_dim,
                  num_attention_heads=2, head_dim=head_dim, num_hidden_layers=1,
                  intermediate_size=8, max_position_embeddings=4 * original,
                  rope_parameters=rope)
    want, scale = ROPE_INIT_FUNCTIONS["yarn"](transformers.AutoConfig.for_model(**config),
                                              "cpu")
    args = args_from_config(config)
    assert torch.equal(args.rope_scaling.inv_freq(head_dim, args.rope_theta), want)
    assert args.rope_scaling.attention_factor == scale


def test_config_values_transformers_reads_as_unset_are_unset():
    config = dict(model_type="llama", vocab_size=128, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, partial_rotary_factor=None)
    transformers.AutoConfig.for_model(**config)  # transformers: rotary over the whole head
    assert args_from_config(config).rope_scaling is None
    # gpt-oss: num_experts is its config's name for num_local_experts; the keys a config
    # leaves out take GptOssConfig's defaults
    oss = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=8)
    want = transformers.GptOssConfig()
    args = args_from_config(oss)
    assert (args.experts, args.top_k, args.moe_intermediate) == (
        want.num_local_experts, want.num_experts_per_tok, want.intermediate_size)
    assert args_from_config({**oss, "num_experts": 8}).experts == 8
    # gpt-oss as published: its MXFP4 experts are the one quantization read
    assert args_from_config({**oss, "quantization_config": {"quant_method": "mxfp4"}})


def _shard_of(folder):
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    return folder / sorted(set(index["weight_map"].values()))[1]


@pytest.mark.parametrize("damage, needle", [
    (lambda d: (d / "config.json").write_text('{"model_type": "lla'),
     r"config.json: not readable as JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"),
     r"config.json: holds a JSON list, not an object"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"metadata": {}}'),
     r"model.safetensors.index.json: no weight_map"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": {"a": 1}}'),
     r"model.safetensors.index.json: its weight_map is not a table"),
    (lambda d: (d / "model.safetensors.index.json").write_text('{"weight_map": '),
     r"model.safetensors.index.json: not readable as JSON"),
    # a download cut short, a clone without Git LFS: the shard is named
    (lambda d: _shard_of(d).write_bytes(_shard_of(d).read_bytes()[:1000]),
     r"model-00002-of-\d+.safetensors: not a readable safetensors file"),
    (lambda d: _shard_of(d).write_text("version https://git-lfs.github.com/spec/v1\n"),
     r"model-00002-of-\d+.safetensors: not a readable safetensors file")])
def test_a_damaged_file_is_refused_naming_it(tmp_path, damage, needle):
    saved(tmp_path, "qwen3", max_shard_size="40KB")
    assert _shard_of(tmp_path).name.startswith("model-00002-of-")
    damage(tmp_path)
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(tmp_path)


def test_a_path_that_is_no_checkpoint_folder_says_what_it_is(tmp_path):
    saved(tmp_path, "llama")
    with pytest.raises(CheckpointError, match="config.json: not a directory"):
        load_checkpoint(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no such directory"):
        load_checkpoint(tmp_path / "absent")
    for dtype in ("bfloat16", torch.int8):  # refused before the checkpoint is read
        with pytest.raises(TypeError, match=f"dtype={dtype!r}: give a torch floating"):
            load_checkpoint(tmp_path, dtype=dtype)
    (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"\['pytorch_model.bin'\] \(PyTorch pickles\) "
                                              "are not read"):
        load_checkpoint(tmp_path)


def test_gpt_oss_clamped_glu_of_its_config_loads_as_transformers_computes_it(tmp_path):
    """swiglu_alpha and swiglu_limit other than gpt-oss's reach the experts."""
    config = CONFIGS["gpt_oss"]()
    config.swiglu_alpha, config.swiglu_limit = 1.0, 0.5
    assert_loads_as_transformers(tmp_path, saved(tmp_path, "gpt_oss", config))


@pytest.mark.parametrize("key, shape", [
    ("gate_up_proj", (8, 66, 64)), ("gate_up_proj", (8, 64, 66)), ("down_proj", (8, 64, 64)),
    ("gate_up_proj_bias", (8, 66)), ("gate_up_proj_blocks", (8, 64, 2, 16)),
    ("gate_up_proj_scales", (8, 192, 3)), ("down_proj_blocks", (8, 64, 2, 15))])
def test_a_gpt_oss_experts_misshapen_tensor_is_named_with_both_shapes(tmp_path, key, shape):
    # Named as the checkpoint stores it ([E, in, out], MXFP4 [E, out, in / 32, 16]), not
    # as blocks.0.mlp.w13 in the shape it has once transposed and de-interleaved.
    saved(tmp_path, "gpt_oss")
    e = "model.layers.0.mlp.experts."
    want = {"gate_up_proj": (8, 64, 192), "down_proj": (8, 96, 64),
            "gate_up_proj_bias": (8, 192), "gate_up_proj_blocks": (8, 192, 2, 16),
            "gate_up_proj_scales": (8, 192, 2), "down_proj_blocks": (8, 64, 3, 16)}[key]

    def edit(t):
        if key.endswith(("_blocks", "_scales")):  # the projection as published, in MXFP4
            name = key.rsplit("_", 1)[0]
            _, cols, rows = t.pop(e + name).shape  # [E, in, out]
            t[e + name + "_blocks"] = torch.zeros(8, rows, cols // 32, 16, dtype=torch.uint8)
            t[e + name + "_scales"] = torch.full((8, rows, cols // 32), 127,
                                                 dtype=torch.uint8)
        t[e + key] = torch.zeros(shape, dtype=t[e + key].dtype)

    _rewrite(tmp_path, edit)
    needle = re.escape(f"{e}{key} has shape {shape}, expected {want}")
    with pytest.raises(CheckpointError, match=needle):
        load_checkpoint(tmp_path)
    if key.startswith("gate_up_proj_"):  # kept MXFP4: read before down_proj is
        with pytest.raises(CheckpointError, match=needle):
            load_checkpoint(tmp_path, experts="mxfp4")


@pytest.mark.parametrize("device", ["cuda:99", "mps"])
def test_a_device_the_machine_lacks_fails_before_the_checkpoint_is_read(tmp_path, monkeypatch,
                                                                       device):
    # Not after reading every tensor (minutes and the host's memory for a large model).
    import graphcap.models.loading as loading

    saved(tmp_path, "llama")
    monkeypatch.setattr(loading, "_tensors", lambda folder: pytest.fail("checkpoint read"))
    with pytest.raises(ValueError, match=f"device={device!r}: "):
        load_checkpoint(tmp_path, device=device)
