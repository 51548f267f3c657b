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
# Every decoder layer's attention and MLP on graphcap's kernels.
SUBSTITUTED = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "phi3")
VOCAB = 128


def hf_model(family: str, dtype=torch.float32, **config):
    """A random tiny model of ``family`` running transformers' own eager attention."""
    torch.manual_seed(0)
    cfg = FAMILIES[family]()
    for key, value in config.items():
        setattr(cfg, key, value)
    return transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", dtype=dtype).eval()
