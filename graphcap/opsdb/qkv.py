"""From the fused QKV projection to attention's inputs in one op: split q, k, v; RMSNorm
each head of q and k (Qwen3's qk-norm; skipped when the weights are None); neox rotary on
q and k; contiguous outputs. The same maths as ``rms_norm`` + ``rotary_embedding`` + two
copies, in one kernel."""

from __future__ import annotations

import torch

from graphcap.opsdb import checks, reference
from graphcap.opsdb.spec import Kernel, register_op

OP = "qkv_norm_rope"


def norm_rope_reference(q, k, positions, q_weight, k_weight, cos_sin_cache, eps: float):
    """q [T, H, D] and k [T, Hk, D] (any strides) RMS-normed per head where the weights
    are given, then rotated at ``positions``: new contiguous tensors."""
    (T, H, D), Hk = q.shape, k.shape[1]
    q, k = q.reshape(T * H, D), k.reshape(T * Hk, D)
    if q_weight is not None:
        q, k = reference.rms_norm(q, q_weight, eps), reference.rms_norm(k, k_weight, eps)
    # Fresh storage: the op never writes (or returns a view of) its input.
    q, k = (t.clone(memory_format=torch.contiguous_format).view(T, n * D)
            for t, n in ((q, H), (k, Hk)))
    reference.rotary_embedding(positions, q, k, cos_sin_cache, D)
    return q.view(T, H, D), k.view(T, Hk, D)


def qkv_reference(qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads: int,
                  num_kv_heads: int, head_size: int, eps: float):
    """qkv [T, (H + 2 Hk) * D] -> q [T, H, D], k [T, Hk, D], v [T, Hk, D], new tensors."""
    q, k, v = heads_of(qkv, num_heads, num_kv_heads, head_size)
    q, k = norm_rope_reference(q, k, positions, q_weight, k_weight, cos_sin_cache, eps)
    return q, k, v.clone(memory_format=torch.contiguous_format)


def heads_of(qkv, num_heads: int, num_kv_heads: int, head_size: int):
    """Views q [T, H, D], k and v [T, Hk, D] of a fused projection's rows ``qkv``."""
    T, D = qkv.shape[0], head_size
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    return q.view(T, num_heads, D), k.view(T, num_kv_heads, D), v.view(T, num_kv_heads, D)


def check_qkv(qkv, positions, q_weight, k_weight, cos_sin_cache, num_heads, num_kv_heads,
              head_size, eps):
    checks.tensor(OP, "qkv", qkv, ndim=2)
    checks.last_dim_contiguous(OP, "qkv", qkv)
    if min(num_heads, num_kv_heads, head_size) < 1:
        raise checks.OpInputError(f"{OP}: heads, kv heads and head_size must be >= 1, got "
                                  f"{num_heads}, {num_kv_heads}, {head_size}")
    width = (num_heads + 2 * num_kv_heads) * head_size
    checks.same(OP, "the width", qkv.shape[1], width, "qkv",
                f"(heads + 2 kv heads) * head_size = {width}")
    check_rope(OP, qkv, positions, q_weight, k_weight, cos_sin_cache, head_size, eps)


def check_rope(op: str, q, positions, q_weight, k_weight, cos_sin_cache,
               head_size: int | None = None, eps: float = 1e-6) -> None:
    """The rotary's inputs of ``op`` (its qk-norm weights too) for the rows of ``q``:
    ``positions`` a row each, the weights both or neither, ``[head_size]`` (``q``'s last
    dim by default), with an ``eps > 0`` (as ``rms_norm`` takes it), a cos/sin cache of an
    even width up to ``head_size``."""
    head_size = q.shape[-1] if head_size is None else head_size
    device = q.device
    checks.tensor(op, "positions", positions, ndim=1, dtypes=(torch.int32, torch.int64),
                  device=device)
    checks.tensor(op, "cos_sin_cache", cos_sin_cache, ndim=2, device=device)
    checks.same(op, "the row count", positions.shape[0], q.shape[0], "positions", "q")
    if (q_weight is None) != (k_weight is None):
        raise checks.OpInputError(f"{op}: give both q_weight and k_weight (qk-norm) or "
                                  "neither")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None:
            checks.tensor(op, name, w, ndim=1, device=device)
            checks.last_dim_contiguous(op, name, w)  # the kernels read it as contiguous
            checks.same(op, "the size", w.shape[0], head_size, name, "head_size")
    if q_weight is not None:
        checks.same(op, "the dtype", k_weight.dtype, q_weight.dtype, "k_weight", "q_weight")
        if not eps > 0:  # a head of zeros would come out NaN (0 * rsqrt(0))
            raise checks.OpInputError(f"{op}: eps must be > 0 with qk-norm weights, got {eps}")
    checks.rows_for(op, cos_sin_cache, positions,
                    "cos_sin_cache has no rows: no position to rotate by")
    rot = cos_sin_cache.shape[1]
    if rot % 2 or rot > head_size or cos_sin_cache.stride(1) != 1:
        raise checks.OpInputError(
            f"{op}: cos_sin_cache width {rot} must be even, at most head_size {head_size}, "
            "with a contiguous last dim")


def qkv_inputs(device, dtype, max_tokens: int = 16):
    # Up to 16 tokens: a program a token and head at every drawn layout (heads x tokens
    # <= SINGLE); tests/kernels/test_triton_qkv.py takes the wider grids.
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import positions_and_rope_cache, rope_heads, tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        head, rot, hk, hq = rope_heads(d)
        pad = d(st.sampled_from([0, 8]))  # rows wider than qkv: a strided view
        (wide,) = tensors(d, device, dtype, (t, (hq + 2 * hk) * head + pad))
        qkv = wide[:, : (hq + 2 * hk) * head]
        norm = d(st.booleans())
        qw, kw = tensors(d, device, dtype, (head,), (head,), scale=0.5) if norm else (None,
                                                                                       None)
        positions, cache = positions_and_rope_cache(d, device, t, rot)
        return qkv, positions, qw, kw, cache, hq, hk, head, 1e-6

    return draw()


QKV_NORM_ROPE = register_op(
    f"graphcap::{OP}",
    "(Tensor qkv, Tensor positions, Tensor? q_weight, Tensor? k_weight, "
    "Tensor cos_sin_cache, int num_heads, int num_kv_heads, int head_size, float eps) "
    "-> (Tensor, Tensor, Tensor)",
    reference=qkv_reference,
    kernels={"triton": Kernel("graphcap.opsdb.triton.qkv:qkv_norm_rope",
                              requires=("triton",))},
    check=check_qkv, inputs=qkv_inputs,
    doc="split a fused QKV projection, RMSNorm q/k per head (optional), neox rotary, "
        "contiguous q, k, v: one kernel instead of six",
)
