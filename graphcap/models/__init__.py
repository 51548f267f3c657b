"""Reference models built from opsdb ops, and their presets."""

from __future__ import annotations

from dataclasses import replace

import torch

from graphcap.models.decoder import MLP, Decoder, ModelArgs, in_kernel_order, shard_args
from graphcap.models.loading import CheckpointError, load_checkpoint
from graphcap.models.rope import Yarn
from graphcap.models.shard import refused_together, shard_model, shard_tensor, shard_whole


def _gpt_oss(layers: int, experts: int) -> ModelArgs:
    """gpt-oss: 128-token windows on the even layers, full attention on the odd, a sink
    logit per head, biases on q/k/v, o, the router and the experts, the clamped GLU,
    YaRN over 4096 positions."""
    return ModelArgs(vocab_size=201088, hidden=2880, layers=layers, heads=64, kv_heads=8,
                     head_dim=64, intermediate=2880, eps=1e-5, rope_theta=150000.0,
                     max_position=131072, experts=experts, top_k=4, moe_intermediate=2880,
                     qkv_bias=True, o_bias=True, moe_bias=True, glu_alpha=1.702,
                     glu_limit=7.0, window=128, global_every=2, sinks=True,
                     rope_scaling=Yarn(32.0, 4096, truncate=False))


# Presets as data. The large ones have the shapes of the public models (random weights).
PRESETS = {
    "tiny": ModelArgs(),
    "tiny-moe": ModelArgs(qk_norm=True, experts=8, top_k=2, moe_intermediate=32),
    "qwen3-0.6b": ModelArgs(vocab_size=151936, hidden=1024, layers=28, heads=16,
                            kv_heads=8, head_dim=128, intermediate=3072, eps=1e-6,
                            rope_theta=1e6, max_position=8192, qk_norm=True,
                            tie_embeddings=True),
    "llama3-8b": ModelArgs(vocab_size=128256, hidden=4096, layers=32, heads=32, kv_heads=8,
                           head_dim=128, intermediate=14336, eps=1e-5, rope_theta=5e5,
                           max_position=8192),
    # One GPU: the layer shape of Qwen3-30B-A3B (128 experts, 8 active), 4 layers.
    "qwen3-30b-a3b-4l": ModelArgs(vocab_size=151936, hidden=2048, layers=4, heads=32,
                                  kv_heads=4, head_dim=128, intermediate=6144, eps=1e-6,
                                  rope_theta=1e6, max_position=8192, qk_norm=True,
                                  experts=128, top_k=8, moe_intermediate=768),
    "gpt-oss-20b": _gpt_oss(layers=24, experts=32),
    # One GPU: the layer shape of gpt-oss-120b (128 experts, 4 active), 4 of its 36 layers.
    "gpt-oss-120b-4l": _gpt_oss(layers=4, experts=128),
    # The same, the experts in MXFP4 as gpt-oss ships them (the bf16 ones above: dequantized).
    "gpt-oss-20b-mxfp4": replace(_gpt_oss(layers=24, experts=32), moe_mxfp4=True),
    "gpt-oss-120b-4l-mxfp4": replace(_gpt_oss(layers=4, experts=128), moe_mxfp4=True),
    # The same kinds of layer, small enough for CPU tests.
    "tiny-gpt-oss": ModelArgs(experts=8, top_k=2, moe_intermediate=32, qkv_bias=True,
                              o_bias=True, moe_bias=True, glu_alpha=1.702, glu_limit=7.0,
                              window=8, global_every=2, sinks=True,
                              rope_scaling=Yarn(4.0, 64, truncate=False)),
}
PRESETS["tiny-gpt-oss-mxfp4"] = replace(PRESETS["tiny-gpt-oss"], moe_mxfp4=True)


def build_model(name: str, device="cpu", dtype=torch.float32, seed: int = 0,
                logits: str = "all", tp=None) -> Decoder:
    """A randomly initialised reference decoder from a preset name (built directly on
    ``device``; ``"meta"`` gives shapes without memory). ``logits="last"``: logits of
    each request's last token only (prefill producing one token). ``tp`` (a
    :class:`graphcap.tp.TPGroup`): this rank's share of the model split across the
    group (every rank builds the same weights from ``seed``, then keeps its share; ranks
    that built others, from another seed or dtype, all raise ``RankError``)."""
    with refused_together(tp):  # a rank that refuses: every rank raises
        if name not in PRESETS:
            raise KeyError(f"no model preset {name!r}; choose one of {sorted(PRESETS)}")
        torch.manual_seed(seed)
        # Built in its dtype: a float32 copy converted afterwards needs twice the memory and
        # leaves the freed float32 blocks interleaved with the weights.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = Decoder(PRESETS[name], logits=logits)
        finally:
            torch.set_default_dtype(previous)
        model = model.to(dtype=dtype).eval()
    if tp is not None:  # the share in the kernel's order, as load_checkpoint(tp=) leaves it
        return shard_whole(model, tp, f"build_model({name!r}, seed={seed}, dtype={dtype})",
                           in_kernel_order)
    return in_kernel_order(model)


__all__ = ["MLP", "PRESETS", "CheckpointError", "Decoder", "ModelArgs", "Yarn", "build_model",
           "load_checkpoint", "shard_args", "shard_model", "shard_tensor"]
