"""torch.library glue and torch-version shims (graphcap runs on torch 2.11 and 2.13+).

Features are probed, not inferred from version strings, so a backport or a nightly
works the same.
"""

from __future__ import annotations

import torch

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])

HAS_CUDAGRAPH_UNSAFE_TAG = hasattr(torch.Tag, "cudagraph_unsafe")
HAS_TRITON_OP = hasattr(torch.library, "triton_op")


def cuda_available() -> bool:
    """True when a CUDA device is usable (not merely compiled in)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0
