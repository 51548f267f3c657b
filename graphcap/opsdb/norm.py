"""Normalisation ops: ``rms_norm`` and ``fused_add_rms_norm``."""

from __future__ import annotations

import math

from graphcap.opsdb import checks, reference
from graphcap.opsdb.spec import HALF, Kernel, register_op

TRITON = ("triton",)


def _check_rms(op, x, weight, eps):
    checks.tensor(op, "x", x, ndim=2)
    checks.last_dim_contiguous(op, "x", x)
    checks.tensor(op, "weight", weight, ndim=1, device=x.device)
    checks.last_dim_contiguous(op, "weight", weight)
    checks.same(op, "the hidden size", x.shape[-1], weight.shape[0], "x", "weight")
    if not eps > 0:
        raise checks.OpInputError(f"{op}: eps must be > 0, got {eps}")


def check_rms_norm(x, weight, eps):
    _check_rms("rms_norm", x, weight, eps)


def check_fused_add_rms_norm(x, residual, weight, eps):
    _check_rms("fused_add_rms_norm", x, weight, eps)
    checks.tensor("fused_add_rms_norm", "residual", residual, ndim=2, device=x.device)
    checks.same("fused_add_rms_norm", "the shape", tuple(x.shape), tuple(residual.shape),
                "x", "residual")
    checks.last_dim_contiguous("fused_add_rms_norm", "residual", residual)
    for name, t in (("x", x), ("residual", residual)):  # both written in place
        checks.writable("fused_add_rms_norm", name, t)


def flashinfer_rms_accepts(x, weight, eps):
    """FlashInfer's RMSNorm reads the weight as x's dtype, unchecked: a float32 weight of
    bfloat16 rows would be misread (the reference and Triton take any float weight)."""
    if weight.dtype != x.dtype:
        return (f"FlashInfer's RMSNorm reads the weight as x's dtype {x.dtype}, not "
                f"{weight.dtype}")
    return _flashinfer_vectors("RMSNorm", x, ("x", x), ("weight", weight))


def flashinfer_fused_add_accepts(x, residual, weight, eps):
    """FlashInfer's fused add reads the residual and the weight as x's dtype, unchecked."""
    for name, t in (("residual", residual), ("weight", weight)):
        if t.dtype != x.dtype:
            return (f"FlashInfer's fused add RMSNorm reads the {name} as x's dtype "
                    f"{x.dtype}, not {t.dtype}")
    return _flashinfer_vectors("fused add RMSNorm", x, ("x", x), ("residual", residual),
                               ("weight", weight))


def _flashinfer_vectors(kernel: str, x, *tensors) -> str | None:
    """FlashInfer's norms load every row in vectors of gcd(16 bytes, H) elements from
    its pointer and row stride (no thread at all for H 0)."""
    hidden = x.shape[-1]
    if hidden == 0:
        return f"FlashInfer's {kernel} takes rows of at least one element"
    vec = math.gcd(16 // x.element_size(), hidden)
    for name, t in tensors:
        if not checks.vector_rows(t, vec):
            return (f"FlashInfer's {kernel} loads the rows of {name} in {vec}-element "
                    f"vectors: it needs them {vec * x.element_size()}-byte aligned, not "
                    f"at row stride {t.stride(0)} from address {t.data_ptr():#x}")
    return None


def rms_norm_inputs(device, dtype, max_tokens: int = 64):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        h = d(st.sampled_from([8, 16, 64, 96, 128, 200]))
        x, w = tensors(d, device, dtype, (t, h), (h,))
        return x, w, d(st.sampled_from([1e-6, 1e-5]))

    return draw()


def fused_add_rms_norm_inputs(device, dtype, max_tokens: int = 64):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        h = d(st.sampled_from([8, 16, 64, 96, 128, 200]))
        x, r, w = tensors(d, device, dtype, (t, h), (t, h), (h,))
        return x, r, w, 1e-6

    return draw()


RMS_NORM = register_op(
    "graphcap::rms_norm", "(Tensor x, Tensor weight, float eps) -> Tensor",
    reference=reference.rms_norm,
    kernels={
        "triton": Kernel("graphcap.opsdb.triton.norm:rms_norm", requires=TRITON),
        "flashinfer": Kernel("graphcap.opsdb.flashinfer:rms_norm", requires=("flashinfer",),
                             dtypes=HALF, accepts=flashinfer_rms_accepts),
    },
    check=check_rms_norm, inputs=rms_norm_inputs,
    doc="x / sqrt(mean(x^2) + eps) * weight over the last dim",
)

FUSED_ADD_RMS_NORM = register_op(
    "graphcap::fused_add_rms_norm",
    "(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()",
    reference=reference.fused_add_rms_norm,
    kernels={
        "triton": Kernel("graphcap.opsdb.triton.norm:fused_add_rms_norm", requires=TRITON),
        "flashinfer": Kernel("graphcap.opsdb.flashinfer:fused_add_rms_norm",
                             requires=("flashinfer",), dtypes=HALF,
                             accepts=flashinfer_fused_add_accepts),
    },
    check=check_fused_add_rms_norm, inputs=fused_add_rms_norm_inputs,
    doc="in place: residual <- x + residual; x <- rms_norm(residual)",
)
