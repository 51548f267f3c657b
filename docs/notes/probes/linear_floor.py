"""How fast one launch can read a decode projection's weight, against graphcap's few-row
linear and cuBLAS (device side):

    PYTHONPATH=. python3 docs/notes/probes/linear_floor.py

A decode step's linears are 3-4 launches a layer each reading 4-12 MB (qwen3-0.6b) or
32-235 MB (llama3-8b). Per projection shape and row count (1, 8), each arm is captured
as a CUDA graph of ``LAUNCHES`` back-to-back launches, each over its own copy of the
weight (more bytes than L2 holds, so every launch reads from memory), and the graph's
replay time divided by the launches gives a launch's time as a decode step sees it (gaps
included). Arms:

- ``skinny``: graphcap's few-row linear (``skinny_linear``, today's ``config``, split-K
  and its in-kernel merge; PDL as ``GRAPHCAP_PDL`` says);
- ``cublas``: ``F.linear``;
- ``gemv``: a GEMV-form kernel written here, no tensor cores: a program per ``BLOCK_N``
  output columns loads its whole ``[BLOCK_N, K]`` weight slice at once (``BLOCK_K`` up to
  K: every byte in flight before the first multiply) and reduces each row on the CUDA
  cores; best of a small sweep of ``BLOCK_N`` x ``BLOCK_K`` x warps;
- ``read``: the same launch without x (the sum of the weight slice): how fast a launch
  of this size can read, whatever it computes.

Printed per shape: us a launch and TB/s, and the best gemv config. JSON in
$OUT/linear-floor.json."""

import json
import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from graphcap.bench.common import environment
from graphcap.opsdb.triton.linear import skinny_linear

SHAPES = {  # (N, K): weight [N, K]
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048),
    "qwen3-0.6b gate/up": (6144, 1024), "qwen3-0.6b down": (1024, 3072),
    "llama3-8b qkv": (6144, 4096), "llama3-8b o": (4096, 4096),
    "llama3-8b gate/up": (28672, 4096), "llama3-8b down": (4096, 14336),
}
ROWS = (1, 8)
LAUNCHES, REPS = 32, 20
POOL_BYTES = 512 << 20  # weights cycled: far more than the 50 MB L2
SWEEP = [(bn, bk, w) for bn in (2, 4, 8, 16) for bk in (1024, 2048, 4096) for w in (4, 8)]


@triton.jit
def _gemv_kernel(X, W, Y, N, K, stride_xm, stride_wn, stride_ym, M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, READ_ONLY: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    w_rows = W + cols[:, None].to(tl.int64) * stride_wn
    for m in tl.static_range(M):
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=col_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)
            if READ_ONLY:
                acc += tl.sum(w, axis=1)
            else:
                x = tl.load(X + m * stride_xm + k0 + ks, mask=k_ok, other=0.0)
                acc += tl.sum(w * x.to(tl.float32)[None, :], axis=1)
        tl.store(Y + m * stride_ym + cols, acc.to(Y.dtype.element_ty), mask=col_ok)


def gemv(x, w, y, block_n, block_k, warps, read_only=False):
    n, k = w.shape
    block_k = min(block_k, triton.next_power_of_2(k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, y, n, k, x.stride(0), w.stride(0), y.stride(0), M=x.shape[0],
        BLOCK_N=block_n, BLOCK_K=block_k, READ_ONLY=read_only, num_warps=warps)
    return y


def per_launch_us(launch, copies) -> float:
    """Replay time of a graph of LAUNCHES launches (launch(i) uses copy i % copies), per
    launch, median of REPS replays."""
    for i in range(copies):  # compile and warm every path outside the capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(LAUNCHES):
            launch(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / LAUNCHES)
    del graph
    return sorted(times)[len(times) // 2]


def shape_rows(n: int, k: int, m: int) -> dict:
    nbytes = n * k * 2
    copies = max(4, min(LAUNCHES, POOL_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) / k ** 0.5
               for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    want = F.linear(x.float(), weights[0].float())
    row = {"bytes": nbytes, "copies": copies}

    def put(name, us):
        row[name] = {"us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 2)}

    got = skinny_linear(x, weights[0]).float() if m <= 64 else None
    if got is not None:
        assert torch.allclose(got, want, atol=3e-2, rtol=3e-2), "skinny_linear is wrong"
        put("skinny", per_launch_us(lambda i: skinny_linear(x, weights[i]), copies))
    put("cublas", per_launch_us(lambda i: F.linear(x, weights[i]), copies))
    best = None
    for block_n, block_k, warps in SWEEP:
        if block_n * min(block_k, triton.next_power_of_2(k)) > 32768:
            continue  # more than 64 KB of bf16 registers a program
        gemv(x, weights[0], y, block_n, block_k, warps)
        assert torch.allclose(y.float(), want, atol=3e-2, rtol=3e-2), "gemv is wrong"
        us = per_launch_us(lambda i, c=(block_n, block_k, warps): gemv(x, weights[i], y, *c),
                           copies)
        if best is None or us < best[0]:
            best = (us, (block_n, block_k, warps))
    put("gemv", best[0])
    row["gemv"]["config"] = dict(zip(("BLOCK_N", "BLOCK_K", "num_warps"), best[1], strict=True))
    block_n, block_k, warps = best[1]
    put("read", per_launch_us(
        lambda i: gemv(x, weights[i], y, block_n, block_k, warps, read_only=True), copies))
    weights.clear()
    torch.cuda.empty_cache()
    return row


def main() -> None:
    out = {"what": "one launch's read of a decode projection's weight: graphcap's few-row "
                   "linear, cuBLAS, a GEMV-form kernel, a bare read; CUDA graphs of "
                   f"{LAUNCHES} launches over weights cycled past L2",
           **environment(), "pdl_env": os.environ.get("GRAPHCAP_PDL", ""), "rows": {}}
    for name, (n, k) in SHAPES.items():
        for m in ROWS:
            row = shape_rows(n, k, m)
            out["rows"][f"{name} m={m}"] = row
            print(f"{name:22s} m={m} {row['bytes'] / 2**20:6.1f} MB  " + "  ".join(
                f"{arm} {row[arm]['us']:7.2f} us {row[arm]['tb_s']:4.2f} TB/s"
                for arm in ("skinny", "cublas", "gemv", "read") if arm in row)
                + f"  gemv {row['gemv']['config']}", flush=True)
    path = os.path.join(os.environ.get("OUT", "/tmp"),
                        f"linear-floor{os.environ.get('PROBE_TAG', '')}.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
