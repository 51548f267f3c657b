"""Pieces several of the project's Triton kernels share."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a @ b in float32. float32 inputs use IEEE products, not TF32. The interpreter
    mis-multiplies bfloat16 (it sees the raw bits), so there both sides go to float32."""
    if INTERPRET:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def interpreting() -> bool:
    """True under Triton's interpreter (``TRITON_INTERPRET=1``, the CPU test runs)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_NUM_SMS: dict[int, int] = {}


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (1 off CUDA), cached per device."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _NUM_SMS:
        _NUM_SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _NUM_SMS[index]


@triton.jit
def cast(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """float32 ``x`` to ``dtype``, rounding to nearest even as the GPU does. Triton 3.6's
    interpreter truncates float32 to bfloat16 (half the values come out one unit low),
    so there the rounding is done on the bits first; the truncation is then exact."""
    if INTERPRET and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
