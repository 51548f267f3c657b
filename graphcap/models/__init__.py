"""Reference models built from opsdb ops, and their presets."""

from __future__ import annotations

import torch

from graphcap.models.tiny import MLP, Decoder, ModelArgs

PRESETS = {
    "tiny": ModelArgs(),
}


def build_model(name: str, device="cpu", dtype=torch.float32, seed: int = 0) -> Decoder:
    """A randomly initialised reference decoder from a preset name."""
    if name not in PRESETS:
        raise KeyError(f"no model preset {name!r}; choose one of {sorted(PRESETS)}")
    torch.manual_seed(seed)
    return Decoder(PRESETS[name]).to(device=device, dtype=dtype).eval()


__all__ = ["MLP", "PRESETS", "Decoder", "ModelArgs", "build_model"]
