"""Mixture-of-experts ops: top-k softmax routing and grouped gated experts (SwiGLU, or
gpt-oss's clamped GLU with biases)."""

from __future__ import annotations

import torch

from graphcap.opsdb import checks, mxfp4, reference
from graphcap.opsdb.spec import Kernel, register_op


def check_topk(router_logits, top_k, renormalize):
    checks.tensor("moe_topk_softmax", "router_logits", router_logits, ndim=2)
    if not 1 <= top_k <= router_logits.shape[1]:
        raise checks.OpInputError(
            f"moe_topk_softmax: top_k={top_k} must be in 1..{router_logits.shape[1]} "
            "(the number of experts)")


def check_experts(x, w13, w2, topk_weights, topk_ids, b13=None, b2=None, alpha=0.0,
                  limit=0.0, interleaved=False, w13_scale=None, w2_scale=None):
    op = "moe_experts"
    checks.tensor(op, "x", x, ndim=2)
    quantized = _check_mxfp4(op, x, w13, w2, w13_scale, w2_scale)
    if quantized and mxfp4.is_operand_order(w13):
        e, two_i, h = _check_operand_order(op, x, w13, w2, w13_scale, w2_scale)
    else:
        weights = (torch.uint8,) if quantized else (x.dtype,)
        checks.tensor(op, "w13", w13, ndim=3, dtypes=weights, device=x.device)
        checks.tensor(op, "w2", w2, ndim=3, dtypes=weights, device=x.device)
        e, two_i, h = w13.shape
        packing = 2 if quantized else 1  # values a byte
        if two_i % (2 * packing):
            raise checks.OpInputError(
                f"{op}: w13 has {two_i} rows an expert; it needs gate and up rows alike "
                f"(an even count{', a multiple of 4 for MXFP4' if quantized else ''})")
        h *= packing
        checks.same(op, "the hidden size", h, x.shape[1], "w13", "x")
        checks.same(op, "the expert shape", (e, h, two_i // 2 // packing),
                    tuple(w2.shape), "w13", "w2")
        scales = (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)) if quantized else ()
        for name, scale, weight in scales:
            checks.tensor(op, name, scale, ndim=3, dtypes=(torch.uint8,), device=x.device)
            want = (*weight.shape[:2], weight.shape[2] * 2 // 32)
            checks.same(op, "the shape", tuple(scale.shape), want, name,
                        "one scale per 32 of its weight's values")
    checks.tensor(op, "topk_weights", topk_weights, ndim=2, device=x.device)
    checks.tensor(op, "topk_ids", topk_ids, ndim=2, dtypes=(torch.int32, torch.int64),
                  device=x.device)
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
    if limit > 0 and alpha == 0:
        raise checks.OpInputError(f"{op}: limit={limit} clamps gpt-oss's GLU, which alpha > 0 "
                                  "chooses; SwiGLU (alpha=0) clamps nothing: give alpha or "
                                  "leave limit 0")
    if two_i == 0:
        raise checks.OpInputError(f"{op}: experts of no intermediate rows (w13 {tuple(w13.shape)})")
    if e == 0:  # the kernels tile the routing by expert (the Triton launcher divided by E)
        raise checks.OpInputError(f"{op}: w13 {tuple(w13.shape)} holds no expert")


def _check_operand_order(op, x, w13, w2, w13_scale, w2_scale) -> tuple[int, int, int]:
    """(experts, 2I, H) of MXFP4 experts in operand order (:mod:`graphcap.opsdb.mxfp4`)."""
    for name, t, ndim in (("w13", w13, 5), ("w2", w2, 5), ("w13_scale", w13_scale, 6),
                          ("w2_scale", w2_scale, 6)):
        checks.tensor(op, name, t, ndim=ndim, dtypes=(torch.uint8,), device=x.device)
    e, blocks, chunks = w13.shape[:3]
    two_i, h = 16 * blocks, 64 * chunks
    checks.same(op, "the block shape", tuple(w13.shape[3:]), (32, 16), "w13",
                "operand order (512 bytes a block)")
    checks.same(op, "the hidden size", h, x.shape[1], "w13 (operand order)", "x")
    checks.same(op, "the expert shape", (e, h // 16, two_i // 2 // 64, 32, 16),
                tuple(w2.shape), "w13", "w2 (operand order)")
    for name, scale, weight in (("w13_scale", w13_scale, w13), ("w2_scale", w2_scale, w2)):
        checks.same(op, "the shape", tuple(scale.shape), (*weight.shape[:3], 8, 2, 2), name,
                    "its weight's operand order")
    return e, two_i, h


def _check_mxfp4(op, x, w13, w2, w13_scale, w2_scale) -> bool:
    """Whether the experts are MXFP4 (both scales given); refuses one scale alone, and
    sizes MXFP4 cannot hold."""
    if (w13_scale is None) != (w2_scale is None):
        raise checks.OpInputError(
            f"{op}: MXFP4 experts take both w13_scale and w2_scale (got only "
            f"{'w13_scale' if w2_scale is None else 'w2_scale'}); pass both, or neither "
            "for experts in x's dtype")
    if w13_scale is None:
        return False
    if x.shape[1] % 32 or (w13.ndim == 3 and w13.shape[1] % 64):
        raise checks.OpInputError(
            f"{op}: MXFP4 experts need the hidden size ({x.shape[1]}) and the expert "
            "intermediate size to be multiples of 32 (a scale per 32 values)")
    return True


def topk_inputs(device, dtype, max_tokens: int = 16):  # a program a token
    from hypothesis import strategies as st

    @st.composite
    def draw(d):
        t, e = d(st.integers(0, max_tokens)), d(st.sampled_from([4, 6, 8, 16]))
        # Logits exact in every dtype, distinct or with ties (broken by the lowest expert
        # id); now and then a NaN or infinite one (every id must still name an expert).
        gen = torch.Generator().manual_seed(d(st.integers(0, 2**31 - 1)))
        ranks = torch.stack([torch.randperm(e, generator=gen) for _ in range(t)]) if t else (
            torch.zeros(0, e, dtype=torch.long))
        if d(st.booleans()):
            ranks = ranks // 2  # pairs of equal logits
        logits = ((ranks - e / 2) * 0.25).to(device=device, dtype=dtype)
        if t and d(st.integers(0, 3)) == 0:
            row, col = d(st.integers(0, t - 1)), d(st.integers(0, e - 1))
            logits[row, col] = d(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
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
        if t and d(st.integers(0, 3)) == 0:  # a slot of no expert (-1, E): it adds nothing
            ids[d(st.integers(0, t - 1)), d(st.integers(0, k - 1))] = d(st.sampled_from([-1, e]))
        b13 = b2 = None
        if d(st.booleans()):  # biases and gpt-oss's clamped GLU, or plain SwiGLU
            b13, b2 = (t * 0.3 for t in tensors(d, device, dtype, (e, 2 * i), (e, h)))
        glu = d(st.sampled_from([(0.0, 0.0), (1.702, 7.0), (1.702, 0.1)]))
        interleaved = d(st.booleans())
        scales = (None, None)
        if dtype == torch.bfloat16 and d(st.booleans()):
            # MXFP4 experts (bf16 activations, as the kernel computes them): random codes,
            # scales about the weights' size
            w13, w2, *scales = (torch.randint(lo, hi, shape, dtype=torch.uint8, generator=gen)
                                .to(device) for lo, hi, shape in (
                                    (0, 256, (e, 2 * i, h // 2)), (0, 256, (e, h, i // 2)),
                                    (122, 124, (e, 2 * i, h // 32)),
                                    (122, 124, (e, h, i // 32))))
            if h == i == 64 and d(st.booleans()):  # the CUDA kernel's operand order
                w13, scales[0] = mxfp4.operand_order(w13, scales[0], True, interleaved)
                w2, scales[1] = mxfp4.operand_order(w2, scales[1], False, False)
        elif d(st.booleans()):  # transposed views of [E, H, 2I] and [E, I, H], as gpt-oss's
            w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
            w2 = w2.transpose(1, 2).contiguous().transpose(1, 2)
        return (x, w13, w2, weights.to(device), ids.to(device), b13, b2, *glu, interleaved,
                *scales)

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
                  limit=0.0, interleaved=False, w13_scale=None, w2_scale=None):
    return x.new_empty(x.shape)  # contiguous, as every kernel returns it


def _operand_order(x, w13, *args) -> str | None:
    if mxfp4.is_operand_order(w13):
        return None
    return "takes MXFP4 experts in operand order only (graphcap.opsdb.mxfp4.operand_order)"


def _published_order(x, w13, *args) -> str | None:
    if mxfp4.is_operand_order(w13):
        return "takes experts in the published order, not the CUDA kernel's operand order"
    return None


MOE_EXPERTS = register_op(
    "graphcap::moe_experts",
    "(Tensor x, Tensor w13, Tensor w2, Tensor topk_weights, Tensor topk_ids, "
    "Tensor? b13=None, Tensor? b2=None, float alpha=0.0, float limit=0.0, "
    "bool interleaved=False, Tensor? w13_scale=None, Tensor? w2_scale=None) -> Tensor",
    reference=reference.moe_experts,
    kernels={"cuda": Kernel("graphcap.opsdb.cuda.moe:moe_experts", requires=("triton", "ninja"),
                            accepts=_operand_order, interpretable=False),
             "triton": Kernel("graphcap.opsdb.triton.moe:moe_experts", requires=("triton",),
                              accepts=_published_order)},
    fake=_experts_fake,
    check=check_experts, inputs=experts_inputs,
    doc="grouped gated experts weighted by the routing (a slot of an id outside [0, E) adds "
        "nothing): SwiGLU, or gpt-oss's clamped GLU "
        "(alpha, limit), with optional biases; gate/up halves or interleaved rows, weights "
        "of any strides in x's dtype, or MXFP4 with their scales (as gpt-oss ships, or in "
        "the CUDA kernel's operand order: graphcap.opsdb.mxfp4)",
)
