"""gpt-oss-120b's MXFP4 expert projections by opsdb's CUDA kernel (weights in the
mma.sync operand order, ``graphcap/opsdb/cuda/moe_mxfp4.cu``) over every tile it has,
against opsdb's ``tl.dot_scaled`` Triton kernels (device side):

    PYTHONPATH=. [PROBE_TOKENS=16,128,512] python3 docs/notes/probes/moe_mxfp4_cuda.py

Nsight Compute of the Triton kernels (`2026-12-03-ncu-moe-mxfp4-down-81eef98-h200.json`,
`2026-12-04-ncu-moe-mxfp4-a652043-h200.json`) finds them bound by instruction issue at
about 20% of DRAM bandwidth: some 9.5 thread instructions a weight value, most of them
moving bytes into the operand layout. The CUDA kernel reads the weights stored once in the
order its products hold them (:mod:`graphcap.opsdb.mxfp4`) and decodes a lane's bytes
straight into its operand registers: about 3 instructions a value. Built with the
``GRAPHCAP_MXFP4_SWEEP`` define: ``mma.sync`` tiles of 8, 16 and 32 rows, 1, 2 and 4 row
blocks a warp, and Hopper warpgroup tiles (``kernel="wgmma"``: 16, 32 and 64 rows, 1-2
64-row blocks a warpgroup, 1-2 warpgroups); moe.py's build has only the tiles
``graphcap.opsdb.cuda.moe.tile`` picks. ``PROBE_SWEEP=wgmma`` runs the warpgroup tiles beside
the two ``mma.sync`` tiles moe.py uses. Per token count: CUDA-graph device ms of the Triton
kernels and of each tile (each call with its routing alignment), and the largest
difference between their rows. JSON in $OUT/moe-mxfp4-cuda.json. The version of
``a596265`` carried its own copy of the kernel (8 and 16 rows); its run is
`2026-12-04-moe-mxfp4-cuda-a596265-h200.json`."""

import os
import sys
from pathlib import Path

import torch

from graphcap.opsdb import mxfp4
from graphcap.opsdb.triton import moe_routing

_MODULE = []
_STORED: dict = {}


def module():
    """The kernel built with every tile (once a process; nvcc and ninja)."""
    if not _MODULE:
        from torch.utils.cpp_extension import load

        import graphcap.opsdb.cuda as cuda_kernels
        source = Path(cuda_kernels.__file__).with_name("moe_mxfp4.cu")
        _MODULE.append(load("graphcap_moe_mxfp4_sweep", [str(source)],
                            extra_cuda_cflags=[*cuda_kernels.flags(), "-DGRAPHCAP_MXFP4_SWEEP"]))
    return _MODULE[0]


def stored(w, s, gate_up):
    """The operand order of ``w`` and ``s``, made once (a model stores it at load)."""
    key = (w.data_ptr(), s.data_ptr(), gate_up)
    if key not in _STORED:
        _STORED[key] = mxfp4.operand_order(w, s, gate_up, gate_up)
    return _STORED[key]


# The kernels a tile may name (``tiles["kernel"]``, default opsdb's): their launch function,
# built on first use. Other probes add theirs (moe_mxfp4_xs.py).
KERNELS = {"opsdb": lambda: module().experts, "wgmma": lambda: module().experts_wgmma}


def launch(mode, x, w, s, bias, weights, ids, out, tiles, alpha=0.0, limit=0.0):
    packed, scales = stored(w, s, mode == 0)
    sorted_pairs, cum_padded = moe_routing.align_pairs(ids, w.shape[0], tiles["m"])
    KERNELS[tiles.get("kernel", "opsdb")]()(
        x, packed, scales, bias, sorted_pairs, cum_padded, weights, out, mode, tiles["m"] // 8,
        tiles["rb"], tiles["warps"], ids.numel(), ids.shape[1], mode == 0, float(alpha),
        float(limit))
    return out


def gate_up(x, w13, s13, b13, ids, alpha, limit, tiles):
    """gpt-oss's gate/up rows [T * k, I] (bf16) by the kernel."""
    out = torch.empty(ids.numel(), w13.shape[1] // 2, dtype=torch.bfloat16, device=x.device)
    unused = torch.empty(1, dtype=torch.float32, device=x.device)
    return launch(0, x, w13, s13, b13, unused, ids, out, tiles, alpha, limit)


def down(inter, w2, s2, b2, weights, ids, tiles):
    """The down rows [T * k, H] (bf16), each times its routing weight, by the kernel."""
    out = torch.empty(ids.numel(), w2.shape[1], dtype=torch.bfloat16, device=inter.device)
    return launch(1, inter, w2, s2, b2, weights.reshape(-1).float().contiguous(), ids, out,
                  tiles)


def main() -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_mxfp4_decode import compare_tiles

    mma = [dict(m=m, rb=rb, warps=w) for m in (8, 16, 32) for rb in (1, 2, 4) for w in (4, 8)]
    # warpgroup tiles: rb 64-row blocks a warpgroup, warps: warpgroups a CTA
    wgmma = [dict(kernel="wgmma", m=m, rb=rb, warps=w) for m in (16, 32, 64)
             for rb, w in ((1, 2), (2, 1), (2, 2))]
    sweep = {"all": mma + wgmma, "wgmma": [dict(m=8, rb=2, warps=4), dict(m=16, rb=4, warps=4),
                                           *wgmma]}[os.environ.get("PROBE_SWEEP", "all")]
    compare_tiles(gate_up, down, sweep,
                  "gpt-oss-120b's MXFP4 gate/up and down: opsdb's tl.dot_scaled kernels against "
                  "opsdb's CUDA kernel (weights in operand order) at every tile",
                  "moe-mxfp4-cuda")


if __name__ == "__main__":
    main()
