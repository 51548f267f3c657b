"""gpt-oss-120b's MXFP4 expert projections by opsdb's CUDA kernels built several ways at once
(``graphcap/opsdb/cuda/moe_mxfp4.cu`` with extra defines), each tile timed alone (device side):

    PYTHONPATH=. [PROBE_VARIANTS="base=;other=-DNAME=VALUE"] \
        [PROBE_TOKENS=128,512,2048] [PROBE_TILES=mma:8:2:4,wgmma:32:1:2] \
        python3 docs/notes/probes/moe_mxfp4_wgmma.py

Each variant is the sweep's build (``GRAPHCAP_MXFP4_SWEEP``) plus its defines, built in
parallel. Per token count (128, 512, 2048; 128 experts, H = I = 2880, top-4, random routing)
and tile: gate/up and down device ms (graphed_ms: 4 calls a graph, 10 replays; the routing
aligned once, outside the timing) and the largest difference of the down rows from the first
tile's (the 8-row mma.sync tile, built by the first variant). The mma.sync tiles run on the
first variant only. ``PROBE_TILES`` picks tiles as kind:rows:a:b (kind mma or wgmma).
JSON in $OUT/moe-mxfp4-wgmma.json. Its runs:
`2026-12-04-moe-mxfp4-wgmma-variants-a874c94-h200.json`, by this script's first form (tiles,
token counts and variants written in; that record's first run used two switches since
removed), and `2026-12-04-moe-mxfp4-decode-shifts-h200.json` (its variants' defines, too,
since removed from moe_mxfp4.cu), and `2026-12-04-moe-mxfp4-bulk-h200.json` (two defines
since removed; its third run, of tiles fed by a producer warp's bulk copies, is this script
at `6a4d31a`, whose moe_mxfp4.cu had them)."""

import functools
import gc
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

TILES = [("mma", 8, 2, 4), ("mma", 16, 4, 4), ("wgmma", 16, 2, 1), ("wgmma", 32, 1, 1),
         ("wgmma", 32, 1, 2), ("wgmma", 32, 2, 2), ("wgmma", 32, 2, 1), ("wgmma", 64, 1, 1),
         ("wgmma", 64, 1, 2), ("wgmma", 64, 2, 1), ("wgmma", 64, 2, 2)]


def tiles() -> list[tuple[str, int, int, int]]:
    spec = os.environ.get("PROBE_TILES")
    if not spec:
        return TILES
    return [(kind, int(m), int(a), int(b)) for kind, m, a, b in
            (t.split(":") for t in spec.split(","))]


def variants() -> dict[str, list[str]]:
    spec = os.environ.get("PROBE_VARIANTS", "base=")
    return {name: flags.split() for name, flags in (v.split("=", 1) for v in spec.split(";"))}


def main() -> None:
    from torch.utils.cpp_extension import load

    import graphcap.opsdb.cuda as cuda_kernels
    from graphcap.bench.common import environment
    from graphcap.bench.timing import graphed_ms
    from graphcap.opsdb import mxfp4, reference
    from graphcap.opsdb.triton import moe_routing

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_mxfp4_decode import random_layer

    source = str(Path(cuda_kernels.__file__).with_name("moe_mxfp4.cu"))

    def build(item):
        name, defines = item
        return name, load(f"graphcap_moe_mxfp4_{name}", [source], extra_cuda_cflags=[
            *cuda_kernels.flags(), "-DGRAPHCAP_MXFP4_SWEEP", *defines])

    with ThreadPoolExecutor(4) as pool:
        modules = dict(pool.map(build, variants().items()))
    experts, hidden, inter, k = 128, 2880, 2880, 4
    torch.manual_seed(0)
    w13, s13, b13, w2, s2, b2 = random_layer(experts, hidden, inter, "cuda")
    ow13, os13 = mxfp4.operand_order(w13, s13, True, True)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    rows = []
    for tokens in [int(t) for t in os.environ.get("PROBE_TOKENS", "128,512,2048").split(",")]:
        x = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16()
        weights, ids = reference.moe_topk_softmax(torch.randn(tokens, experts, device="cuda"),
                                                  k, True)
        wts = weights.reshape(-1).float().contiguous()
        first = None
        for kind, m, a, b in tiles():
            sorted_pairs, cum_padded = moe_routing.align_pairs(ids, experts, m)
            result = {}
            for name, module in modules.items():
                if kind == "mma" and name != next(iter(modules)):
                    continue
                fn = module.experts if kind == "mma" else module.experts_wgmma
                o1 = torch.empty(ids.numel(), inter, dtype=torch.bfloat16, device="cuda")
                o2 = torch.empty(ids.numel(), hidden, dtype=torch.bfloat16, device="cuda")

                pairs = ids.numel()
                gate_up = functools.partial(fn, x, ow13, os13, b13, sorted_pairs, cum_padded, wts,
                                            o1, 0, m // 8, a, b, pairs, k, True, 1.702, 7.0)
                down = functools.partial(fn, o1, ow2, os2, b2, sorted_pairs, cum_padded, wts, o2,
                                         1, m // 8, a, b, pairs, k, False, 0.0, 0.0)
                gate_up()
                down()
                if first is None:
                    first = o2.clone()
                result[name] = {"gate_up_ms": round(graphed_ms(gate_up, calls=4, reps=10), 4),
                                "down_ms": round(graphed_ms(down, calls=4, reps=10), 4),
                                "max_diff": round((o2.float() - first.float()).abs().max()
                                                  .item(), 4)}
                gc.collect()
                torch.cuda.empty_cache()
            print(tokens, (kind, m, a, b), result, flush=True)
            rows.append({"tokens": tokens, "tile": [kind, m, a, b], "variants": result})
            out = {"what": "opsdb's MXFP4 expert kernels built several ways (moe_mxfp4_wgmma.py)",
                   **environment(), "variants": variants(), "rows": rows}
            with open(os.path.join(os.environ.get("OUT", "."), "moe-mxfp4-wgmma.json"), "w") as f:
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
