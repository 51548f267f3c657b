"""Whether a row of the GEMV-form linear comes out bitwise the same whatever rows share
its launch, per mode, row count and dtype, and where it differs first (the RMSNorm's
scale, or the products): ``PYTHONPATH=. python3 docs/notes/probes/gemv_bitwise.py``.
With ``TRITON_DEFAULT_FP_FUSION=0`` Triton compiles without fused multiply-adds."""

from __future__ import annotations

import os

import torch

from graphcap.opsdb.triton import gemv
from tests.kernels.test_triton_linear import MODES, case

TILES = {"BLOCK_N": 2, "BLOCK_K": 64, "num_warps": 4}


def differing(mode: str, m: int, dtype: torch.dtype, seed: int) -> int:
    args, _, x = case(mode, m, 6, 160, dtype, seed)
    together = gemv.gemv_linear(x, tiles=TILES, **args)
    bad = 0
    for row in range(m):
        alone = {k: (v[row:row + 1] if k == "residual" else v) for k, v in args.items()}
        bad += not torch.equal(gemv.gemv_linear(x[row:row + 1], tiles=TILES, **alone),
                               together[row:row + 1])
    return bad


def main() -> None:
    print("fp fusion:", os.environ.get("TRITON_DEFAULT_FP_FUSION", "default"))
    for dtype in (torch.float32, torch.bfloat16):
        for mode in MODES:
            rows = {m: sum(differing(mode, m, dtype, seed) for seed in range(4))
                    for m in range(2, gemv.GEMV_ROWS + 1)}
            print(f"{str(dtype):15} {mode:10} rows differing by row count: {rows}")


if __name__ == "__main__":
    main()
