"""graphcap's GEMV-form linear (``graphcap.opsdb.triton.gemv``) against the tensor-core
few-row kernel and cuBLAS, per decode projection and row count (device side):

    PYTHONPATH=. python3 docs/notes/probes/gemv_rows.py

Timed as ``linear_floor.py`` times (CUDA graphs of back-to-back launches over weights
cycled past L2), plain projections (no norm or epilogue) at 1, 2, 4 and 8 rows; the
GEMV form with today's ``gemv_config``, and a sweep (``SWEEP``) of the GEMV form's tiles
(a row at a time or every row at once) and of the few-row kernel's (whole-K slices, one
split), sorted. ``PROBE_MODELS=qwen3`` keeps that preset's shapes, ``PROBE_ROWS=1,5``
the row counts (a verify step of 1 + 4 tokens has 5). Says which form wins at each.
JSON in $OUT/gemv-rows.json."""

import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from linear_floor import SHAPES, per_launch_us  # noqa: E402

from graphcap.bench.common import environment  # noqa: E402
from graphcap.opsdb.triton.gemv import gemv_config, gemv_linear  # noqa: E402
from graphcap.opsdb.triton.linear import skinny_linear  # noqa: E402

ROWS = tuple(int(r) for r in os.environ.get("PROBE_ROWS", "1,2,4,8").split(","))
# (label, kernel, tiles). GEMV a row at a time: warps 1 and 2 keep a row's sum over K
# within fewer warps; 8 columns read x (rows x K, from L2) once for more weight. GEMV with
# every row at once (ALL_ROWS: one reduction over K a slice). The tensor-core few-row
# kernel with one K split and whole-K slices (no partials to merge).
SWEEP = [("gemv", (2, bk, w, False)) for bk, w in ((1024, 1), (2048, 2), (2048, 4))] + \
    [("gemv", (8, 512, 4, False))] + \
    [("gemv", (bn, 0, w, True)) for bn in (2, 4, 8) for w in (2, 4)] + \
    [("skinny", (bn, bk, split)) for bn in (16, 32) for bk in (256, 1024) for split in (1, 2)]
POOL_BYTES = 512 << 20


def sweep_tiles(kind: str, spec: tuple, m: int, k: int) -> dict | None:
    """The tiles of one sweep point at ``m`` rows and ``k`` inputs (None: skipped)."""
    kp2 = 1 << (k - 1).bit_length()
    rows_p2 = max(2, 1 << (m - 1).bit_length())
    if kind == "skinny":
        bn, bk, split = spec
        if m == 1 or (split > 1 and bk * split > kp2):
            return None
        return {"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": min(bk, kp2), "SPLIT_K": split,
                "num_warps": 4, "num_stages": 2 if bk <= 256 else 1}
    bn, bk, w, all_rows = spec
    if m == 1 and (bn > 2 or all_rows):
        return None
    if all_rows:  # the [rows, columns, BLOCK_K] products: 128 float32 a thread
        bk = max(64, 128 * 32 * w // (rows_p2 * bn))
    bk = min(bk, kp2)
    if bn * bk > 16384:
        return None
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w, "ALL_ROWS": all_rows}


def shape_rows(n: int, k: int) -> dict:
    nbytes = n * k * 2
    copies = max(4, min(32, POOL_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               / k ** 0.5 for _ in range(copies)]
    out = {}
    kernels = {"gemv": gemv_linear, "skinny": skinny_linear}
    for m in ROWS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        want = F.linear(x.float(), weights[0].float())
        row = {}
        for name, fn in (("skinny", lambda i, x=x: skinny_linear(x, weights[i])),
                         ("cublas", lambda i, x=x: F.linear(x, weights[i])),
                         ("gemv", lambda i, x=x: gemv_linear(x, weights[i]))):
            got = fn(0).float()
            assert torch.allclose(got, want, atol=3e-2, rtol=3e-2), f"{name} is wrong"
            row[name] = round(per_launch_us(fn, copies), 2)
        sweep = []
        for kind, spec in SWEEP:
            tiles = sweep_tiles(kind, spec, m, k)
            if tiles is None:
                continue

            def fn(i, t=tiles, x=x, f=kernels[kind]):
                return f(x, weights[i], tiles=t)

            got = fn(0).float()
            assert torch.allclose(got, want, atol=3e-2, rtol=3e-2), f"{kind} {tiles} is wrong"
            us = round(per_launch_us(fn, copies), 2)
            sweep.append({"kernel": kind, "tiles": tiles, "us": us})
        sweep.sort(key=lambda r: r["us"])
        row["sweep"] = sweep
        row["best"] = sweep[0]
        row["gemv_tiles"] = gemv_config(k)
        out[m] = row
        print(f"{n}x{k} m={m}: " + " ".join(f"{a} {row[a]}" for a in (
            "skinny", "cublas", "gemv")) + " | " + "; ".join(
            f"{r['kernel']} {r['us']} {r['tiles']}" for r in sweep[:4]), flush=True)
    weights.clear()
    torch.cuda.empty_cache()
    return {"bytes": nbytes, "rows": out}


def main() -> None:
    out = {"what": "GEMV-form linear against the few-row kernel and cuBLAS, us a launch in "
                   "CUDA graphs of back-to-back launches", **environment(),
           "pdl_env": os.environ.get("GRAPHCAP_PDL", ""), "shapes": {}}
    for name, (n, k) in SHAPES.items():
        if os.environ.get("PROBE_MODELS", "") not in name:
            continue
        print(name, flush=True)
        out["shapes"][name] = shape_rows(n, k)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "gemv-rows.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
