"""A decode step's MLP as one persistent launch with a grid barrier, against today's two
GEMV launches (device side, and on the CPU):

    PYTHONPATH=. python3 docs/notes/probes/persistent_mlp.py            # H200: timing
    PYTHONPATH=. python3 docs/notes/probes/persistent_mlp.py step       # H200: the step
    TRITON_INTERPRET=1 PYTHONPATH=. python3 docs/notes/probes/persistent_mlp.py

``h + down(silu(gate) * up)`` of ``rms_norm(h)`` at one row, qwen3-0.6b's shapes (hidden
1024, intermediate 3072). Today (``swiglu_half`` at one row) it is two GEMV launches:
gate/up with the RMSNorm folded in, then down with the residual; under PDL each program
reads its first weight slice before waiting for the kernel before, but the down launch's
programs find SMs only as gate/up's leave. Here ``P`` programs (all resident at once)
take gate/up's column pairs in turn and write ``silu(gate) * up`` to a scratch row, read
their first down slice into registers, meet at a grid barrier (an arrival count; the
last to leave resets it), and take down's column pairs, the scratch row read from L2.
The question: does a read that crosses the launch boundary (the down weights loaded
before the barrier) beat a second launch? If so, a layer's projections in fewer launches
is the road to qwen3-0.6b's 0.50 ms (performance history items 55-63).

Numerics as the GEMV's (the normed row rounded to the weights' dtype, float32 sums per
slice, SwiGLU's halves and the product rounded, the down product rounded before the
residual). Timing: 28 layers of distinct weights chained (each layer's output the next
one's input), in one CUDA graph, PDL on: today's two launches, the persistent launch at
one and two programs an SM, and the same kernel as two launches (``PHASE`` 1 then 2, no
barrier), which separates the barrier from the kernel's code. With TRITON_INTERPRET=1 and
no GPU (the interpreter runs programs one after another: no barrier can be met) the two
phases run as two launches, checked against the torch reference. JSON in
$OUT/persistent-mlp.json. ``step``: qwen3-0.6b's whole decode step at batch 1 (a full
runner of ``DecodeInputs``, context 1024) with each layer's MLP as today and as the
persistent launch (the model's ``swiglu_half`` swapped while capturing), calls timed
interleaved, logits compared; JSON in $OUT/persistent-mlp-step.json."""

import json
import os

import torch
import triton
import triton.language as tl

from graphcap.opsdb import reference as ops
from graphcap.opsdb.triton.common import (
    cast,
    interpreting,
    num_sms,
    pdl_args,
    pdl_launch_dependents,
    pdl_wait,
)

HIDDEN, INTER, LAYERS, EPS = 1024, 3072, 28, 1e-6


@triton.jit
def _grid_barrier(SYNC, P: tl.constexpr):
    """Every program of the launch (all resident) arrives before any goes on; the last to
    leave resets both counts for the next launch, which touches them only after its PDL
    wait, when this launch has finished."""
    tl.debug_barrier()  # the program's stores are made before its arrival is
    n = tl.atomic_add(SYNC, 1, sem="acq_rel", scope="gpu") + 1
    while n < P:
        n = tl.atomic_add(SYNC, 0, sem="acquire", scope="gpu")
    left = tl.atomic_add(SYNC + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        tl.atomic_xchg(SYNC, 0)
        tl.atomic_xchg(SYNC + 1, 0)
    tl.debug_barrier()


@triton.jit
def _down_slice(W2, it, pid, H, N_I, stride_w2, P: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_I: tl.constexpr, SLICES: tl.constexpr):
    """The weight slice of this program's ``it``-th (column pair, K slice) of down (past
    its last: every lane masked, nothing read)."""
    cols = (pid + (it // SLICES) * P) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = (it % SLICES) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask = (cols < H)[:, None] & (ks < N_I)[None, :]
    return tl.load(W2 + cols[:, None].to(tl.int64) * stride_w2 + ks[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _mlp_kernel(X, NORM_W, W13, W2, HBUF, Y, SYNC, eps, H, N_I, stride_w13, stride_w2,
                P: tl.constexpr, PHASE: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_I: tl.constexpr, SLICES: tl.constexpr,
                PDL: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    pdl_launch_dependents(PDL)
    offs = tl.arange(0, BLOCK_N)
    if PHASE != 1:  # down's first slice, before anything waits (the gate/up launch reads none)
        w2 = _down_slice(W2, 0, pid, H, N_I, stride_w2, P, BLOCK_N, BLOCK_I, SLICES)
    if PHASE != 2:  # gate/up: column pairs pid, pid + P, ... of N_I; H in one slice
        hs = tl.arange(0, BLOCK_H)
        h_ok = hs < H
        cols = pid * BLOCK_N + offs
        rows = W13 + cols[:, None].to(tl.int64) * stride_w13 + hs[None, :]
        mask = (cols < N_I)[:, None] & h_ok[None, :]
        w_g = tl.load(rows, mask=mask, other=0.0)
        w_u = tl.load(rows + N_I * stride_w13, mask=mask, other=0.0)
        pdl_wait(PDL)
        x = tl.load(X + hs, mask=h_ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
        g = tl.load(NORM_W + hs, mask=h_ok, other=0.0).to(tl.float32)
        xn = cast(x * rstd * g, X.dtype.element_ty, INTERPRET).to(tl.float32)[None, :]
        for blk in range(pid, tl.cdiv(N_I, BLOCK_N), P):
            cols = blk * BLOCK_N + offs
            gate = cast(tl.sum(w_g.to(tl.float32) * xn, axis=1), X.dtype.element_ty,
                        INTERPRET).to(tl.float32)
            up = cast(tl.sum(w_u.to(tl.float32) * xn, axis=1), X.dtype.element_ty,
                      INTERPRET).to(tl.float32)
            nxt = cols + P * BLOCK_N  # the next pair's rows, read while this one is stored
            rows = W13 + nxt[:, None].to(tl.int64) * stride_w13 + hs[None, :]
            mask = (nxt < N_I)[:, None] & h_ok[None, :]
            w_g = tl.load(rows, mask=mask, other=0.0)
            w_u = tl.load(rows + N_I * stride_w13, mask=mask, other=0.0)
            tl.store(HBUF + cols, cast(gate * tl.sigmoid(gate) * up, HBUF.dtype.element_ty,
                                       INTERPRET), mask=cols < N_I)
    else:
        pdl_wait(PDL)
    if PHASE == 0:
        _grid_barrier(SYNC, P)
    if PHASE != 1:  # down: column pairs pid, pid + P, ... of H, N_I in SLICES slices
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        steps = tl.cdiv(tl.cdiv(H, BLOCK_N) - pid, P) * SLICES
        for it in range(0, steps):
            ks = (it % SLICES) * BLOCK_I + tl.arange(0, BLOCK_I)
            hv = tl.load(HBUF + ks, mask=ks < N_I, other=0.0, cache_modifier=".cg")
            acc += tl.sum(w2.to(tl.float32) * hv.to(tl.float32)[None, :], axis=1)
            w2 = _down_slice(W2, it + 1, pid, H, N_I, stride_w2, P, BLOCK_N, BLOCK_I, SLICES)
            if it % SLICES == SLICES - 1:
                cols = (pid + (it // SLICES) * P) * BLOCK_N + offs
                res = tl.load(X + cols, mask=cols < H, other=0.0).to(tl.float32)
                y = cast(acc, Y.dtype.element_ty, INTERPRET).to(tl.float32) + res
                tl.store(Y + cols, cast(y, Y.dtype.element_ty, INTERPRET), mask=cols < H)
                acc = tl.zeros([BLOCK_N], dtype=tl.float32)


def persistent_mlp(h, norm, eps, gate_up, down, sync, hbuf, programs: int,
                   phases: bool = False) -> torch.Tensor:
    """``h + down(silu(gate) * up)`` of ``rms_norm(h)`` for one row ``h`` [1, H]:
    ``gate_up`` [2I, H] (gate rows, then up rows), ``down`` [H, I]; ``sync`` two zeroed
    int32, ``hbuf`` [I] scratch. ``phases``: two launches, no barrier."""
    (_, hidden), inter = h.shape, down.shape[1]
    assert h.shape[0] == 1 and hidden <= 2048 and programs <= triton.cdiv(hidden, 2)
    y = torch.empty_like(h)
    block_i = min(triton.next_power_of_2(inter), 2048)  # the GEMV's slice (gemv_config)
    common = dict(P=programs, BLOCK_N=2, BLOCK_H=triton.next_power_of_2(hidden),
                  BLOCK_I=block_i, SLICES=triton.cdiv(inter, block_i),
                  INTERPRET=interpreting(), num_warps=4, **pdl_args(h.device, 1, "gemv"))
    args = (h, norm, gate_up, down, hbuf, y, sync, float(eps), hidden, inter,
            gate_up.stride(0), down.stride(0))
    for phase in ((1, 2) if phases else (0,)):
        _mlp_kernel[(programs,)](*args, PHASE=phase, **common)
    return y


def reference(h, norm, eps, gate_up, down) -> torch.Tensor:
    """The GEMV's numerics in torch (opsdb's references, each product rounded to h's
    dtype), float32 sums."""
    xn = ops.rms_norm(h, norm, eps)
    act = ops.silu_and_mul((xn.float() @ gate_up.float().t()).to(h.dtype))
    return ((act.float() @ down.float().t()).to(h.dtype).float() + h.float()).to(h.dtype)


def layers(device, dtype, hidden=HIDDEN, inter=INTER, count=LAYERS, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def param(*shape, scale):
        t = (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)
        return torch.nn.Parameter(t, requires_grad=False)

    return [(param(hidden, scale=0.1).add_(1.0), param(2 * inter, hidden, scale=0.02),
             param(hidden, inter, scale=0.02)) for _ in range(count)]


def check_on_cpu() -> None:
    hidden, inter = 64, 96
    h = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    sync, hbuf = torch.zeros(2, dtype=torch.int32), torch.empty(inter, dtype=torch.bfloat16)
    for programs in (1, 3, 32):
        for norm, gate_up, down in layers("cpu", torch.bfloat16, hidden, inter, 2, programs):
            got = persistent_mlp(h, norm, EPS, gate_up, down, sync, hbuf, programs, True)
            want = reference(h, norm, EPS, gate_up, down)
            err = (got.float() - want.float()).abs().max().item()
            print(f"{programs} programs: max difference from the reference {err:.3g}")
            assert err <= 0.02 * want.float().abs().max().item(), err
    print("interpreted: both phases equal the reference")


def main() -> None:
    from graphcap.bench.common import environment
    from graphcap.bench.timing import cycled_ms
    from graphcap.models.blocks import swiglu_half

    dev = torch.device("cuda")
    weights = layers(dev, torch.bfloat16)
    h0 = (torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)) * 0.5).to(
        dev, torch.bfloat16)
    sync = torch.zeros(2, dtype=torch.int32, device=dev)
    hbuf = torch.empty(INTER, dtype=torch.bfloat16, device=dev)
    sms = num_sms(dev)

    def chain(step):
        def run():
            x = h0
            for norm, gate_up, down in weights:
                x = step(x, norm, gate_up, down)
            return x
        return run

    variants = {"today (two GEMV launches)": lambda x, n, gu, d: swiglu_half(x, n, EPS, gu, d)}
    for per_sm in (1, 2):
        p = min(sms * per_sm, HIDDEN // 2)
        variants[f"persistent, {p} programs"] = (
            lambda x, n, gu, d, p=p: persistent_mlp(x, n, EPS, gu, d, sync, hbuf, p))
        variants[f"two launches, {p} programs"] = (
            lambda x, n, gu, d, p=p: persistent_mlp(x, n, EPS, gu, d, sync, hbuf, p, True))
    base = chain(variants["today (two GEMV launches)"])()
    want = h0
    for norm, gate_up, down in weights:
        want = reference(want, norm, EPS, gate_up, down)
    rows = []
    for name, step in variants.items():
        out = chain(step)()
        ms = cycled_ms([chain(step)], warmup=3, reps=30)
        rows.append({"variant": name, "ms_28_layers": round(ms, 4),
                     "us_a_layer": round(ms * 1000 / LAYERS, 2),
                     "max_diff_vs_today": float((out.float() - base.float()).abs().max()),
                     "max_diff_vs_reference": float((out.float() - want.float()).abs().max())})
        print(rows[-1], flush=True)
        torch.cuda.synchronize()
    out = {"what": "qwen3-0.6b's MLP at one row: one persistent launch with a grid barrier "
                   "against two GEMV launches", **environment(), "hidden": HIDDEN,
           "intermediate": INTER, "layers": LAYERS, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "persistent-mlp.json"), "w") as f:
        json.dump(out, f, indent=1)


def step() -> None:
    """The decode step at batch 1 with today's MLP and with the persistent one."""
    import sys

    from graphcap.bench.common import environment, time_interleaved
    from graphcap.inputs import DecodeInputs
    from graphcap.models import decoder

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from probe_common import decode_cases, prefilled_decode

    import graphcap

    context, programs = 1024, 2 * num_sms(torch.device("cuda"))
    model, cache, tokens = prefilled_decode("qwen3-0.6b", 1, context)
    sync = torch.zeros(2, dtype=torch.int32, device="cuda")
    hbuf = torch.empty(model.args.intermediate, dtype=torch.bfloat16, device="cuda")
    today = decoder.swiglu_half

    def persistent(h, norm, eps, gate_up, down, tp=None):
        if h.shape[0] != 1 or tp is not None:
            return today(h, norm, eps, gate_up, down, tp)
        return persistent_mlp(h, norm, eps, gate_up, down, sync, hbuf,
                              min(programs, h.shape[1] // 2))

    runners = {}
    for name, mlp in (("today", today), ("persistent MLP", persistent)):
        decoder.swiglu_half = mlp
        try:
            runners[name] = graphcap.capture(model, "full", buckets=[1],
                                             inputs=DecodeInputs(cache))
        finally:
            decoder.swiglu_half = today
    cases = decode_cases(runners, tokens, [1], context)
    times = time_interleaved(cases, reps=60, rounds=6)
    want = cases[1, "today"]().float()
    rows = [{"variant": name, "ms": times[1, name]["median_ms"],
             "max_logit_diff_vs_today": float((cases[1, name]().float() - want).abs().max())}
            for name in runners]
    print(rows, flush=True)
    out = {"what": "qwen3-0.6b's decode step at batch 1, each layer's MLP as today and as "
                   "one persistent launch", **environment(), "context": context,
           "programs": programs, "rows": rows}
    with open(os.path.join(os.environ.get("OUT", "."), "persistent-mlp-step.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    import sys

    if not torch.cuda.is_available():
        check_on_cpu()
    else:
        (step if sys.argv[1:] == ["step"] else main)()
