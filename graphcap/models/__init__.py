"""Reference models built from opsdb ops, and their presets."""

from __future__ import annotations

import torch

from graphcap.models.decoder import MLP, Decoder, ModelArgs, shard_args
from graphcap.models.loading import CheckpointError, load_checkpoint
from graphcap.models.shard import shard_model, shard_tensor

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
}


def build_model(name: str, device="cpu", dtype=torch.float32, seed: int = 0,
                logits: str = "all", tp=None) -> Decoder:
    """A randomly initialised reference decoder from a preset name (built directly on
    ``device``; ``"meta"`` gives shapes without memory). ``logits="last"``: logits of
    each request's last token only (prefill producing one token). ``tp`` (a
    :class:`graphcap.tp.TPGroup`): this rank's share of the model split across the
    group (every rank builds the same weights from ``seed``, then keeps its share)."""
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
    if tp is None:
        return model
    return shard_model(model, tp)


__all__ = ["MLP", "PRESETS", "CheckpointError", "Decoder", "ModelArgs", "build_model",
           "load_checkpoint", "shard_args", "shard_model", "shard_tensor"]
