"""One streaming launch's cost on this device, and the decode floor it sets.

A decode step is a chain of launches, each reading its bytes once: a projection's weight,
a layer's K/V. One launch that streams ``b`` bytes takes about ``fixed + b / rate``: the
launch, the first bytes' latency and the tail cost ``fixed`` whatever the size. At a
small model's few-MB weights the fixed part outweighs the bytes, so it decides the step
(``docs/notes/2026-12-04-decode-launch-floor.md``).

:func:`measure` fits the line on this device. A bare read kernel (each program sums a
block, so nothing but the read costs) runs over buffers of 4 to 256 MB, cycled past L2 in
one CUDA graph as a model's layers are. :func:`decode_floor_ms` is then the least a dense
decoder's step can take while each of its four projections (q/k/v, o, gate/up, down) and
its decode attention is a launch of its own, plus the LM head: the floor of that
structure, not of every design.
"""

from __future__ import annotations

import statistics

import torch
import triton
import triton.language as tl

SIZES_MB = (4, 16, 64, 256)
CYCLED_MB = 512  # bytes a size's graph cycles through, several times the L2
LAUNCHES = 128  # launches in every size's graph: its own launch shared alike
_BLOCK = 4096  # elements a program sums


@triton.jit
def _read_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + pid, tl.sum(x.to(tl.float32), axis=0))


def read(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out[i]`` = the sum of ``x``'s ``i``-th block of 4096 elements (``x`` flat, ``out``
    float32 of one element a block): one launch that reads ``x`` once."""
    if not (x.is_contiguous() and out.is_contiguous()):
        raise ValueError("read: x and out must be contiguous (it walks their memory flat)")
    n = x.numel()
    blocks = triton.cdiv(n, _BLOCK)
    if out.numel() != blocks:
        raise ValueError(f"read: out has {out.numel()} elements, {blocks} blocks need one each")
    _read_kernel[(blocks,)](x, out, n, BLOCK=_BLOCK)
    return out


def fit(points: list[tuple[float, float]]) -> dict:
    """The least-squares line through ``(bytes, us)`` points: its fixed microseconds, its
    rate in bytes a second and its largest miss."""
    if len(points) < 2 or len({b for b, _ in points}) < 2:
        raise ValueError("fit: a line needs points at two sizes at least")
    slope, fixed = statistics.linear_regression([b for b, _ in points], [t for _, t in points])
    if slope <= 0:
        raise ValueError(f"fit: the times fall with the bytes ({points}): no rate")
    miss = max(abs(fixed + slope * b - t) for b, t in points)
    return {"fixed_us": round(fixed, 3), "bytes_per_s": round(1e6 / slope),
            "largest_miss_us": round(miss, 3),
            "points": [{"bytes": int(b), "us": round(t, 3)} for b, t in points]}


def measure(device="cuda", sizes_mb=SIZES_MB) -> dict:
    """The line of one bare read on ``device`` (CUDA): for each size, :data:`LAUNCHES`
    launches cycling over distinct bf16 buffers, :data:`CYCLED_MB` in all, captured in
    one CUDA graph and replayed; the replay's time over its launches. Every size's graph
    has as many launches, so the graph's own launch adds the same to each point."""
    from graphcap.bench.timing import cycled_ms

    points = []
    for mb in sizes_mb:
        n = mb * (1 << 20) // 2
        copies = max(2, -(-CYCLED_MB // mb))
        xs = [torch.ones(n, dtype=torch.bfloat16, device=device) for _ in range(copies)]
        outs = [torch.empty(triton.cdiv(n, _BLOCK), dtype=torch.float32, device=device)
                for _ in range(copies)]
        each = [lambda x=x, o=o: read(x, o) for x, o in zip(xs, outs, strict=True)]
        calls = [each[i % copies] for i in range(LAUNCHES)]
        points.append((2 * n, cycled_ms(calls) * 1e3))
        del xs, outs, each, calls
    return fit(points)


def kv_tokens(args, layer: int, context: int) -> int:
    """The K/V tokens layer ``layer`` of a preset (``args``) reads of a ``context``-token
    request: its window of them where it is windowed."""
    return min(context, args.window_of(layer) or context)


def decode_floor_ms(args, batch: int, context: int, line: dict,
                    dtype_bytes: int = 2) -> float | None:
    """The least a dense decoder's step (``args``: a preset's ``ModelArgs``) takes at
    ``batch`` requests of ``context`` tokens (a windowed layer's window) when its q/k/v,
    o, gate/up and down projections and its decode attention are each a launch, every
    launch at ``line`` (:func:`measure`), and the LM head one more; None for experts
    (routed, not dense)."""
    if args.experts:
        return None
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    reads = [n * dtype_bytes for i in range(args.layers) for n in (
        (q + 2 * kv) * args.hidden, args.hidden * q, 2 * args.intermediate * args.hidden,
        args.hidden * args.intermediate,
        batch * kv_tokens(args, i, context) * 2 * kv)]
    reads.append(args.vocab_size * args.hidden * dtype_bytes)
    us = sum(line["fixed_us"] + b / line["bytes_per_s"] * 1e6 for b in reads)
    return round(us / 1e3, 4)


__all__ = ["SIZES_MB", "decode_floor_ms", "fit", "kv_tokens", "measure", "read"]
