"""What the ranks of a :class:`~graphcap.tp.TPGroup` compare: each rank's key, less what
differs from rank to rank however alike the calls are, in a tensor of ``KEY_BYTES`` bytes
(a long key cut, and a digest of it kept, so that long keys still differ)."""

from __future__ import annotations

import hashlib
import re

import torch

KEY_BYTES = 256  # what agree() compares: a key's UTF-8 bytes, long ones hashed
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # an object's repr: its address
# "cuda:1": each rank's own GPU (a refusal, a change since capture naming a tensor's)
_DEVICE_INDEX = re.compile(r"\b(cuda|xpu|hpu|mps|npu|privateuseone):\d+\b")


def rank_neutral(key: str) -> str:
    """``key`` less what differs from rank to rank however alike the ranks' calls are."""
    return _DEVICE_INDEX.sub(r"\1", _ADDRESS.sub("", key))


def digest(text: str) -> str:
    """16 hex digits of ``text``'s SHA-256: a key for what is too long to show."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def encode(key: str) -> torch.Tensor:
    """``key`` as ``KEY_BYTES`` bytes (zero-padded; a longer key cut, with its digest)."""
    raw = key.encode()
    if len(raw) > KEY_BYTES:
        tail = digest(key).encode()
        raw = raw[:KEY_BYTES - len(tail) - 3] + b"..." + tail
    out = torch.zeros(KEY_BYTES, dtype=torch.uint8)
    if raw:  # torch.frombuffer refuses an empty buffer
        out[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def decode(encoded: torch.Tensor) -> str:
    """The key :func:`encode` made ``encoded`` of."""
    return bytes(encoded.tolist()).rstrip(b"\0").decode(errors="replace")
