"""Activation ops: ``silu_and_mul`` (the SwiGLU gate of Llama/Qwen MLPs)."""

from __future__ import annotations

from graphcap.opsdb import checks, reference
from graphcap.opsdb.spec import HALF, Kernel, register_op


def check_silu_and_mul(x):
    checks.tensor("silu_and_mul", "x", x, ndim=2)
    checks.last_dim_contiguous("silu_and_mul", "x", x)
    if x.shape[-1] % 2:
        raise checks.OpInputError(
            f"silu_and_mul: the last dim of x ({x.shape[-1]}) must be even: "
            "[gate | up] halves")


def flashinfer_accepts(x):
    """FlashInfer's silu_and_mul is handed x's pointer and I only: it reads row t at
    ``t * 2I`` (a strided x would be read from other rows, without a word), in 16-byte
    vectors from the row's start and from I on (elsewhere misaligned addresses, which
    poison the CUDA context; under 8 elements, a launch of no thread)."""
    rows, width = x.shape
    vec = 16 // x.element_size()
    if rows > 1 and x.stride(0) != width:
        return (f"FlashInfer's silu_and_mul reads packed rows (a row stride of {width}), "
                f"not a row stride of {x.stride(0)}")
    if width == 0 or width // 2 % vec:
        return (f"FlashInfer's silu_and_mul takes I a multiple of {vec} (16 bytes), not "
                f"{width // 2}")
    if x.data_ptr() % 16:
        return "FlashInfer's silu_and_mul takes x at a 16-byte-aligned address"
    return None


def silu_and_mul_inputs(device, dtype, max_tokens: int = 64):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        t = d(st.integers(0, max_tokens))
        i = d(st.sampled_from([4, 16, 48, 64, 100]))
        return tensors(d, device, dtype, (t, 2 * i))

    return draw()


SILU_AND_MUL = register_op(
    "graphcap::silu_and_mul", "(Tensor x) -> Tensor",
    reference=reference.silu_and_mul,
    kernels={
        "triton": Kernel("graphcap.opsdb.triton.activation:silu_and_mul",
                         requires=("triton",)),
        "flashinfer": Kernel("graphcap.opsdb.flashinfer:silu_and_mul",
                             requires=("flashinfer",), dtypes=HALF,
                             accepts=flashinfer_accepts),
    },
    check=check_silu_and_mul, inputs=silu_and_mul_inputs,
    doc="x [T, 2I] -> silu(x[:, :I]) * x[:, I:]",
)
