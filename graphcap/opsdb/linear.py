"""Linear layers with their neighbours fused in: the pre-norm decoder's four matmuls.

- ``rms_norm_linear(x, norm_weight, eps, weight, bias)``: ``linear(rms_norm(x))``
  (the q/k/v projection, the LM head);
- ``rms_norm_swiglu(x, norm_weight, eps, weight)``: ``silu_and_mul(linear(rms_norm(x)))``
  with ``weight`` [2I, H], gate rows then up rows (the MLP's gate/up projection);
- ``linear_residual(x, weight, residual)``: ``residual + linear(x)`` (the attention
  output and MLP down projections, closing a residual branch).

Kernels, best first: ``triton``, one kernel per op for few rows: every op at one row
(decode at batch 1) with weights of up to 32 MB in GEMV form
(:mod:`graphcap.opsdb.triton.gemv`), else the tensor-core kernel for ``rms_norm_swiglu``
and ``linear_residual`` (:func:`graphcap.opsdb.triton.linear.fused_rows` says where each
pays on the H200; past one row ``rms_norm_linear`` measured slower than the unfused ops
at every size, so dispatch leaves it to them); ``composite``, the unfused
ops (the ``rms_norm`` and ``silu_and_mul`` kernels around a cuBLAS matmul), for more
rows and larger weights, where cuBLAS wins; ``torch``, the reference.
Intermediates are rounded to the model dtype where the unfused ops store them, but for
one: the GEMV form of a normed projection of K up to 1024 (qwen3-0.6b's at one row)
multiplies the normed x unrounded, nearer float32's result (a 16-bit output differs from
the reference's by an ulp on about half its columns, and one token's at one row from the
same token's at two).
"""

from __future__ import annotations

import torch.nn.functional as F

from graphcap.opsdb import checks, reference
from graphcap.opsdb.activation import SILU_AND_MUL
from graphcap.opsdb.norm import RMS_NORM
from graphcap.opsdb.spec import Kernel, register_op

TRITON = ("triton",)


# -- references: float32 maths, cast back as the unfused ops store their outputs --------
def _linear(x, weight, bias=None):
    out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return out.to(x.dtype)


def rms_norm_linear_reference(x, norm_weight, eps, weight, bias=None):
    return _linear(reference.rms_norm(x, norm_weight, eps), weight, bias)


def rms_norm_swiglu_reference(x, norm_weight, eps, weight):
    return reference.silu_and_mul(_linear(reference.rms_norm(x, norm_weight, eps), weight))


def linear_residual_reference(x, weight, residual):
    return (_linear(x, weight).float() + residual.float()).to(x.dtype)


# -- composite: the unfused opsdb kernels around cuBLAS (CUDA, many rows) ---------------
def _norm_before(x, norm_weight, eps, weight):
    """``RMS_NORM(x)`` ahead of a cuBLAS matmul over ``weight``. Where the op picks its
    Triton kernel, that kernel is given the weight to ask L2 for while it waits for the
    kernel before it (under PDL: :func:`graphcap.opsdb.triton.norm.rms_norm`); cuBLAS,
    which cannot start early, then reads it from L2."""
    args = (x, norm_weight, eps)
    if RMS_NORM.select(x.device, dtype=x.dtype, args=args) != "triton":
        return RMS_NORM(*args)
    from graphcap.opsdb.triton.norm import rms_norm

    return rms_norm(x, norm_weight, eps, prefetch=weight)


def _rms_norm_linear_composite(x, norm_weight, eps, weight, bias=None):
    return F.linear(_norm_before(x, norm_weight, eps, weight), weight, bias)


def _rms_norm_swiglu_composite(x, norm_weight, eps, weight):
    return SILU_AND_MUL(F.linear(_norm_before(x, norm_weight, eps, weight), weight))


def _linear_residual_composite(x, weight, residual):
    return residual + F.linear(x, weight)


def _fits(kind: str):
    """The fused kernel's row limit for an op (``accepts``: why not, or None)."""
    def accepts(x, *args) -> str | None:
        from graphcap.opsdb.triton.linear import fused_rows

        weight = args[0] if kind == "residual" else args[2]
        limit = fused_rows(weight, kind)
        if x.shape[0] > limit or not limit:
            return (f"{x.shape[0]} rows of {str(weight.dtype).removeprefix('torch.')}: the "
                    f"fused kernel takes at most {limit} here (the unfused ops win past it)")
        return None
    return accepts


def _kernels(name: str, composite, kind: str) -> dict[str, Kernel]:
    return {"triton": Kernel(f"graphcap.opsdb.triton.linear:{name}", requires=TRITON,
                             accepts=_fits(kind)),
            "composite": Kernel(composite, requires=TRITON)}


# -- checks ---------------------------------------------------------------------------
def _check_x_weight(op, x, weight):
    checks.tensor(op, "x", x, ndim=2)
    checks.last_dim_contiguous(op, "x", x)
    checks.tensor(op, "weight", weight, ndim=2, dtypes=(x.dtype,), device=x.device)
    checks.last_dim_contiguous(op, "weight", weight)
    checks.same(op, "the input size", x.shape[1], weight.shape[1], "x", "weight")


def _check_norm(op, x, norm_weight, eps):
    checks.tensor(op, "norm_weight", norm_weight, ndim=1, device=x.device)
    checks.last_dim_contiguous(op, "norm_weight", norm_weight)
    checks.same(op, "the hidden size", x.shape[1], norm_weight.shape[0], "x", "norm_weight")
    if not eps > 0:
        raise checks.OpInputError(f"{op}: eps must be > 0, got {eps}")


def check_rms_norm_linear(x, norm_weight, eps, weight, bias=None):
    op = "rms_norm_linear"
    _check_x_weight(op, x, weight)
    _check_norm(op, x, norm_weight, eps)
    if bias is not None:
        checks.tensor(op, "bias", bias, ndim=1, dtypes=(x.dtype,), device=x.device)
        checks.last_dim_contiguous(op, "bias", bias)
        checks.same(op, "the output size", bias.shape[0], weight.shape[0], "bias", "weight")


def check_rms_norm_swiglu(x, norm_weight, eps, weight):
    op = "rms_norm_swiglu"
    _check_x_weight(op, x, weight)
    _check_norm(op, x, norm_weight, eps)
    if weight.shape[0] % 2:
        raise checks.OpInputError(f"{op}: weight has {weight.shape[0]} rows; it needs an "
                                  "even count, [gate | up] halves")


def check_linear_residual(x, weight, residual):
    op = "linear_residual"
    _check_x_weight(op, x, weight)
    checks.tensor(op, "residual", residual, ndim=2, dtypes=(x.dtype,), device=x.device)
    checks.last_dim_contiguous(op, "residual", residual)
    checks.same(op, "the shape", tuple(residual.shape), (x.shape[0], weight.shape[0]),
                "residual", "x @ weight^T")


# -- input strategies: row counts on both sides of the fused kernel's limit ------------
def _inputs(device, dtype, kind: str, max_rows: int = 80):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        m = d(st.one_of(st.integers(0, 20), st.integers(0, max_rows)))
        k = d(st.sampled_from([16, 64, 96, 256, 320]))
        n = d(st.sampled_from([16, 48, 64, 200]))
        rows = 2 * n if kind == "swiglu" else n
        x, w = tensors(d, device, dtype, (m, k), (rows, k))
        w = w / k ** 0.5  # outputs of order one, as in a trained model
        if kind == "residual":
            (res,) = tensors(d, device, dtype, (m, n))
            return x, w, res
        (g,) = tensors(d, device, dtype, (k,), scale=0.5)
        g = g + 1
        if kind == "swiglu":
            return x, g, 1e-6, w
        bias = tensors(d, device, dtype, (n,))[0] if d(st.booleans()) else None
        return x, g, 1e-6, w, bias

    return draw()


def _register(name: str, schema: str, reference, composite, check, *, kind: str, doc: str):
    return register_op(f"graphcap::{name}", schema, reference=reference,
                       kernels=_kernels(name, composite, kind), check=check,
                       inputs=lambda device, dtype: _inputs(device, dtype, kind), doc=doc)


RMS_NORM_LINEAR = _register(
    "rms_norm_linear",
    "(Tensor x, Tensor norm_weight, float eps, Tensor weight, Tensor? bias) -> Tensor",
    rms_norm_linear_reference, _rms_norm_linear_composite, check_rms_norm_linear,
    kind="plain",
    doc="linear(rms_norm(x)): the RMSNorm prologue kernel at one row, or the norm and "
        "cuBLAS apart (faster on the H200 past one row)")

RMS_NORM_SWIGLU = _register(
    "rms_norm_swiglu", "(Tensor x, Tensor norm_weight, float eps, Tensor weight) -> Tensor",
    rms_norm_swiglu_reference, _rms_norm_swiglu_composite, check_rms_norm_swiglu,
    kind="swiglu",
    doc="silu_and_mul(linear(rms_norm(x))): one kernel for the gate/up projection")

LINEAR_RESIDUAL = _register(
    "linear_residual", "(Tensor x, Tensor weight, Tensor residual) -> Tensor",
    linear_residual_reference, _linear_residual_composite, check_linear_residual,
    kind="residual",
    doc="residual + linear(x): the residual add fused into the matmul for few rows")

__all__ = ["LINEAR_RESIDUAL", "RMS_NORM_LINEAR", "RMS_NORM_SWIGLU"]
