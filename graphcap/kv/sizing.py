"""What a paged K/V cache is stored as: the dtypes and devices its keys and values may
have (:func:`check_storage`)."""

from __future__ import annotations

import torch

# What graphcap's cache ops (kv_write, decode_attention, cached_attention) take.
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_storage(dtype, device) -> tuple[torch.dtype, torch.device]:
    """``dtype`` and ``device`` of a cache's keys and values, checked: a dtype graphcap's
    cache ops take, a device that holds values (the meta device holds none); a
    ``ValueError`` naming the argument and what to give otherwise."""
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16 (what "
                         f"graphcap's cache ops write and read), not {dtype!r}: build the "
                         "cache, or the model it serves, in one of them")
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError("device='meta': a cache on the meta device holds no keys or values "
                         "(nothing would be written or read); build it on the model's real "
                         "device, a model on meta once its weights are loaded")
    return dtype, device
