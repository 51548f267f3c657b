"""Rotary position embedding (neox style, cos/sin cache), in place on query and key."""

from __future__ import annotations

import torch

from graphcap.opsdb import checks, reference
from graphcap.opsdb.spec import HALF, Kernel, register_op

OP = "rotary_embedding"


def check_rotary(positions, query, key, cos_sin_cache, head_size):
    checks.tensor(OP, "positions", positions, ndim=1, dtypes=(torch.int32, torch.int64))
    device = positions.device
    checks.tensor(OP, "query", query, ndim=2, device=device)
    checks.tensor(OP, "key", key, ndim=2, device=device)
    checks.tensor(OP, "cos_sin_cache", cos_sin_cache, ndim=2, device=device)
    checks.same(OP, "the token count", query.shape[0], positions.shape[0], "query",
                "positions")
    checks.same(OP, "the token count", key.shape[0], positions.shape[0], "key", "positions")
    checks.last_dim_contiguous(OP, "cos_sin_cache", cos_sin_cache)
    for name, t in (("query", query), ("key", key)):
        checks.last_dim_contiguous(OP, name, t)
        checks.writable(OP, name, t)
        if head_size <= 0 or t.shape[1] % head_size:
            raise checks.OpInputError(
                f"{OP}: {name} width {t.shape[1]} is not a multiple of head_size {head_size}")
    checks.rows_for(OP, cos_sin_cache, positions,
                    "cos_sin_cache has no rows: no position to rotate by")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_size:
        raise checks.OpInputError(
            f"{OP}: cos_sin_cache width {rot} must be even and at most head_size {head_size}")


def flashinfer_accepts(positions, query, key, cos_sin_cache, head_size):
    """FlashInfer's rope moves 16-byte vectors through each half of the rotary dims and
    has fast variants for head sizes 64 to 512 only; other shapes read misaligned
    addresses (seen on the H200 at head size 16 with 8 rotary dims), which poisons the
    CUDA context, so they must never reach it."""
    rot = cos_sin_cache.shape[-1]
    if head_size not in (64, 128, 256, 512) or rot % 32:
        return (f"FlashInfer's rope takes head sizes 64/128/256/512 with rotary dims a "
                f"multiple of 32, not head size {head_size} with {rot} rotary dims")
    # It reads key as query's dtype, unchecked, and refuses strided positions and tables.
    if key.dtype != query.dtype:
        return (f"FlashInfer's rope reads key as query's dtype {query.dtype}, not "
                f"{key.dtype}")
    if not (positions.is_contiguous() and cos_sin_cache.is_contiguous()):
        return "FlashInfer's rope takes contiguous positions and cos_sin_cache only"
    # Each row in 16-byte vectors from the pointer and the row stride.
    for name, t in (("query", query), ("key", key)):
        if not checks.vector_rows(t, 16 // t.element_size()):
            return (f"FlashInfer's rope loads the rows of {name} in 16-byte vectors: it "
                    f"needs them 16-byte aligned, not at row stride {t.stride(0)} from "
                    f"address {t.data_ptr():#x}")
    return None


def rotary_inputs(device, dtype, max_tokens: int = 24):  # a program a token
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import positions_and_rope_cache, rope_heads, tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        head, rot, hk, hq = rope_heads(d)
        q, k = tensors(d, device, dtype, (t, hq * head), (t, hk * head))
        positions, cache = positions_and_rope_cache(d, device, t, rot)
        return positions, q, k, cache, head

    return draw()


ROTARY_EMBEDDING = register_op(
    f"graphcap::{OP}",
    "(Tensor positions, Tensor(a!) query, Tensor(b!) key, Tensor cos_sin_cache, "
    "int head_size) -> ()",
    reference=reference.rotary_embedding,
    kernels={
        "triton": Kernel("graphcap.opsdb.triton.rotary:rotary_embedding",
                         requires=("triton",)),
        "flashinfer": Kernel("graphcap.opsdb.flashinfer:rotary_embedding",
                             requires=("flashinfer",), dtypes=HALF,
                             accepts=flashinfer_accepts),
    },
    check=check_rotary, inputs=rotary_inputs,
    doc="neox rotary embedding with a cos/sin cache, in place on query and key",
)
