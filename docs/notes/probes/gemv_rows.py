"""graphcap's GEMV-form linear (``graphcap.opsdb.triton.gemv``) against the tensor-core
few-row kernel and cuBLAS, per decode projection and row count (device side):

    PYTHONPATH=. python3 docs/notes/probes/gemv_rows.py

Timed as ``linear_floor.py`` times (CUDA graphs of back-to-back launches over weights
cycled past L2), plain projections (no norm or epilogue) at 1, 2, 4 and 8 rows; the
GEMV form with today's ``gemv_config`` and a sweep of its tiles (columns, BLOCK_K, warps; best
kept). ``PROBE_MODELS=qwen3`` keeps that preset's shapes. Says up to how many rows the
GEMV form wins. JSON in $OUT/gemv-rows.json."""

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

ROWS = (1, 2, 4, 8)
# warps 1 and 2: a row's sum over K stays within fewer warps (fewer shared-memory rounds);
# 8 and 16 columns: each program reads x (rows x K, from L2) for more weight columns
SWEEP = [(2, bk, w) for bk in (1024, 2048) for w in (1, 2, 4)] + \
    [(bn, 4096 // bn, w) for bn in (8, 16) for w in (2, 4)]
POOL_BYTES = 512 << 20


def shape_rows(n: int, k: int) -> dict:
    nbytes = n * k * 2
    copies = max(4, min(32, POOL_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               / k ** 0.5 for _ in range(copies)]
    out = {}
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
        best = None
        for bn, bk, w in SWEEP:
            if bn * min(bk, 1 << (k - 1).bit_length()) > 16384 or (bn > 2 and m == 1):
                continue
            tiles = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": w}
            us = per_launch_us(lambda i, t=tiles, x=x: gemv_linear(x, weights[i], tiles=t), copies)
            if best is None or us < best[0]:
                best = (us, tiles)
        row["gemv_best"], row["gemv_best_tiles"] = round(best[0], 2), best[1]
        row["gemv_tiles"] = gemv_config(k)
        out[m] = row
        print(f"{n}x{k} m={m}: " + " ".join(f"{a} {row[a]}" for a in (
            "skinny", "cublas", "gemv", "gemv_best")) + f" {best[1]}", flush=True)
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
