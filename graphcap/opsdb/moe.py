"""Mixture-of-experts ops: top-k softmax routing and grouped gated experts (SwiGLU, or
gpt-oss's clamped GLU with biases)."""

from __future__ import annotations

import torch

from graphcap.opsdb import checks, reference
from graphcap.opsdb.spec import Kernel, register_op


def check_topk(router_logits, top_k, renormalize):
    checks.tensor("moe_topk_softmax", "router_logits", router_logits, ndim=2)
    if not 1 <= top_k <= router_logits.shape[1]:
        raise checks.OpInputError(
            f"moe_topk_softmax: top_k={top_k} must be in 1..{router_logits.shape[1]} "
            "(the number of experts)")


def check_experts(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, alpha=0.0,
                  limit=0.0, interleaved=False):
    op = "moe_experts"
    checks.tensor(op, "x", x, ndim=2)
    checks.tensor(op, "w13", w13, ndim=3, dtypes=(x.dtype,), device=x.device)
    checks.tensor(op, "w2", w2, ndim=3, dtypes=(x.dtype,), device=x.device)
    checks.tensor(op, "topk_weights", topk_weights, ndim=2, device=x.device)
    checks.tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64),
                  device=x.device)
    e, two_i, h = w13.shape
    checks.same(op, "the hidden size", h, x.shape[1], "w13", "x")
    checks.same(op, "the expert shape", (e, h, two_i // 2), tuple(w2.shape), "w13", "w2")
    checks.same(op, "the shape", tuple(topk_weights.shape), tuple(topk_ids.shape),
                "topk_weights", "topk_ids")
    checks.same(op, "the token count", topk_ids.shape[0], x.shape[0], "topk_ids", "x")
    for name, bias, shape in (("b13", b13, (e, two_i)), ("b2", b2, (e, h))):
        if bias is not None:
            checks.tensor(op, name, bias, ndim=2, dtypes=checks.FLOATS, device=x.device)
            checks.same(op, "the shape", tuple(bias.shape), shape, name, "its weight's rows")
    for name, value in (("alpha", alpha), ("limit", limit)):
        if not value >= 0:
            raise checks.OpInputError(f"{op}: {name} must be >= 0 (0: SwiGLU; alpha > 0: "
                                      f"gpt-oss's clamped GLU), got {value!r}")


def topk_inputs(device, dtype, max_tokens: int = 48):
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t, e = d(st.integers(0, max_tokens)), d(st.sampled_from([4, 8, 16]))
        # Distinct logits, exact in every dtype: top-k has no ties to break.
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        ranks = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]) if t else (
            torch.zeros(0, e, dtype=torch.long))
        logits = ((ranks - e / 2) * 0.25).to(device=device, dtype=dtype)
        return logits, d(st.integers(1, min(e, 4))), d(st.booleans())

    return draw()


def experts_inputs(device, dtype, max_tokens: int = 24):
    from hypothesis import strategies as st

    from graphcap.opsdb.inputs import tensors

    @st.composite
    def draw(d):
        t, e, k = d(st.integers(0, max_tokens)), d(st.sampled_from([4, 8])), d(
            st.integers(1, 2))
        h, i = d(st.sampled_from([32, 64])), d(st.sampled_from([32, 64]))
        x, w13, w2 = tensors(d, device, dtype, (t, h), (e, 2 * i, h), (e, h, i), scale=0.3)
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        logits = torch.randn(t, e, generator=gen)
        weights, ids = reference.moe_topk_softmax(logits, k, True)
        b13 = b2 = None
        if d(st.booleans()):  # biases and gpt-oss's clamped GLU, or plain SwiGLU
            b13, b2 = (t * 0.3 for t in tensors(d, device, dtype, (e, 2 * i), (e, h)))
        glu = d(st.sampled_from([(0.0, 0.0), (1.702, 7.0), (1.702, 0.1)]))
        interleaved = d(st.booleans())
        if d(st.booleans()):  # transposed views of [E, H, 2I] and [E, I, H], as gpt-oss's
            w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
            w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        return (x, w13, w2, weights.to(device), ids.to(device), b13, b2, *glu, interleaved)

    return draw()


MOE_TOPK_SOFTMAX = register_op(
    "graphcap::moe_topk_softmax",
    "(Tensor router_logits, int top_k, bool renormalize) -> (Tensor, Tensor)",
    reference=reference.moe_topk_softmax,
    kernels={"triton": Kernel("graphcap.opsdb.triton.moe_routing:moe_topk_softmax",
                              requires=("triton",))},
    check=check_topk, inputs=topk_inputs,
    doc="softmax over experts, top-k: weights [T, k] fp32, ids [T, k] int32",
)


def _experts_fake(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, alpha=0.0,
                  limit=0.0, interleaved=False):
    return torch.empty_like(x)


MOE_EXPERTS = register_op(
    "graphcap::moe_experts",
    "(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "Tensor? b13=None, Tensor? b2=None, float alpha=0.0, float limit=0.0, "
    "bool interleaved=False) -> Tensor",
    reference=reference.moe_experts,
    kernels={"triton": Kernel("graphcap.opsdb.triton.moe:moe_experts", requires=("triton",))},
    fake=_experts_fake,
    check=check_experts, inputs=experts_inputs,
    doc="grouped gated experts weighted by the routing: SwiGLU, or gpt-oss's clamped GLU "
        "(alpha, limit), with optional biases; gate/up halves or interleaved rows, weights "
        "of any strides",
)
