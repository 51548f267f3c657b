"""Random tiny stock transformers causal LMs of every family graphcap.hf is tested on."""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TOKENS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)  # inside the tiny vocab

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**COMMON),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON),  # q/k/v biases
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=16),  # q/k norms
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
    "mixtral": lambda: transformers.MixtralConfig(**COMMON, num_local_experts=4,
                                                  num_experts_per_tok=2),
    "phi3": lambda: transformers.Phi3Config(**COMMON, sliding_window=None, **TOKENS),
    "gemma": lambda: transformers.GemmaConfig(**COMMON, head_dim=16),
    "granite": lambda: transformers.GraniteConfig(
        **COMMON, embedding_multiplier=2.0, residual_multiplier=0.5,
        attention_multiplier=0.3, logits_scaling=4.0),
    "olmo2": lambda: transformers.Olmo2Config(**COMMON, **TOKENS),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4,
                                            n_positions=256, bos_token_id=1,
                                            eos_token_id=2),
}
# Other families, as transformers builds them: refused (windows, soft-capping, sinks, keys
# and values of two head dims) or run once a config field is changed
# (tests/hf/test_hf_refusals.py); not in FAMILIES, whose every test they would fail.
MLA = dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
           moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2,
           first_k_dense_replace=1, n_group=1, topk_group=1)
OTHER_FAMILIES = {
    "gemma2": lambda: transformers.Gemma2Config(**COMMON, head_dim=16, sliding_window=8,
                                                **TOKENS),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**COMMON, head_dim=16,
                                                         sliding_window=8, **TOKENS),
    "cohere2": lambda: transformers.Cohere2Config(**COMMON, sliding_window=8, **TOKENS),
    "olmo3": lambda: transformers.Olmo3Config(**COMMON, sliding_window=8, **TOKENS),
    # Every layer keeps sliding_window, the full-attention one too (its call passes None).
    "exaone4": lambda: transformers.Exaone4Config(
        **COMMON, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        **TOKENS),
    "gpt_oss": lambda: transformers.GptOssConfig(**COMMON, head_dim=16, sliding_window=8,
                                                 num_local_experts=4, num_experts_per_tok=2,
                                                 **TOKENS),
    # Windows their attention calls do not pass (the mask transformers builds applies
    # them): Qwen2-MoE's first layer, every layer of PhiMoE.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, **TOKENS),
    "phimoe": lambda: transformers.PhimoeConfig(**COMMON, sliding_window=8,
                                                num_local_experts=4, num_experts_per_tok=2,
                                                bos_token_id=1, eos_token_id=None,
                                                pad_token_id=0),  # it draws 2 early
    # OLMoE's attention passes config.sliding_window (none of its config's fields) and its
    # model builds a plain causal mask; SmolLM3 with use_sliding_window off passes no
    # window and its mask still slides over the layers layer_types names sliding.
    "olmoe": lambda: transformers.OlmoeConfig(**COMMON, num_experts=4, num_experts_per_tok=2,
                                              **TOKENS),
    "smollm3": lambda: transformers.SmolLM3Config(
        **COMMON, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        **TOKENS),
    # MLA: keys (and queries) of head dim qk_nope + qk_rope = 16 for every query head.
    # The checkpoints' layout: values of another head dim (v_head_dim).
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, **MLA, v_head_dim=8, **TOKENS),
    "deepseek_v3_one_head_dim": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_key_value_heads": 4}, **MLA, v_head_dim=16, **TOKENS),
    "phi": lambda: transformers.PhiConfig(**COMMON, **TOKENS),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        **{k: v for k, v in COMMON.items() if k != "num_key_value_heads"}, **TOKENS),
    "falcon": lambda: transformers.FalconConfig(vocab_size=128, hidden_size=64,
                                                num_hidden_layers=2, num_attention_heads=4,
                                                **TOKENS),
    # Llama 4 with its chunks off: its NoPE layer's queries are scaled by positions past
    # floor_scale tokens (4 here), counted along the row: refused.
    "llama4": lambda: transformers.Llama4TextConfig(
        **COMMON, head_dim=16, intermediate_size_mlp=96, num_local_experts=2,
        num_experts_per_tok=1, no_rope_layers=[1, 0], layer_types=["full_attention"] * 2,
        floor_scale=4, attn_scale=1.0, **TOKENS),
    # Its decoder numbers the tokens of its row itself (position_ids unread): refused.
    "bart": lambda: transformers.BartConfig(vocab_size=128, d_model=64, decoder_layers=2,
                                            decoder_attention_heads=4, decoder_ffn_dim=96,
                                            max_position_embeddings=256, **TOKENS),
    # Differential attention: two calls of the attention function per layer.
    "diffllama": lambda: transformers.DiffLlamaConfig(**COMMON, **TOKENS),
    # WhisperForCausalLM (the decoder alone): its forward takes no logits_to_keep.
    "whisper": lambda: transformers.WhisperConfig(
        vocab_size=128, d_model=64, decoder_layers=2, decoder_attention_heads=4,
        decoder_ffn_dim=96, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=96,
        max_target_positions=256, decoder_start_token_id=1, suppress_tokens=None,
        begin_suppress_tokens=None, **TOKENS),
    "bloom": lambda: transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=2,
                                              n_head=4, **TOKENS),
}
# Every decoder layer's attention and MLP on graphcap's kernels.
SUBSTITUTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3")
VOCAB = 128


def hf_model(family: str, dtype=torch.float32, **config):
    """A random tiny model of ``family`` running transformers' own eager attention."""
    torch.manual_seed(0)
    cfg = {**FAMILIES, **OTHER_FAMILIES}[family]()
    for key, value in config.items():
        setattr(cfg, key, value)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=dtype).eval()
