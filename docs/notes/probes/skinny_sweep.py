"""Tiles of the few-row linear at 8 to 64 rows, per decode projection, against today's
``config`` and the unfused ops on cuBLAS (device side):

    PYTHONPATH=. python3 docs/notes/probes/skinny_sweep.py [rows,...] [shape,...]

At batch 64 a qwen3-0.6b decode step's linears took about 722 us against about 190 at
the bandwidth floor (o and down at 64 rows 6.7 us a launch, the line 3.4-3.6): today's
tiles keep all 64 rows and 32 columns in a program, so every column block reads the
whole x slice again from L2 (x's bytes times 32 for o) and a program walks only two
BLOCK_K slices. Here each projection, in the mode the decode step runs it (q/k/v and
gate/up with the RMSNorm, gate/up with SwiGLU; o and down with the residual add), is
timed at each tile of a grid of BLOCK_N x BLOCK_K x SPLIT_K (eight warps beside four
for the larger tiles; stages: as many as fit), as CUDA graphs of ``LAUNCHES`` launches
over copies of the weight cycled past L2 (each launch reads from memory, as in a step;
PDL as ``GRAPHCAP_PDL`` says). Arms beside the tiles: today's ``config`` and the
unfused ops (``F.rms_norm``, ``F.linear``, the SiLU-and-mul, the add). Every tile's
output is checked against the unfused ops first. Printed per shape: the unfused ops,
today, the best five tiles; JSON in $OUT/skinny-sweep.json."""

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from linear_floor import LAUNCHES, per_launch_us

from graphcap.bench.common import environment
from graphcap.opsdb.triton.common import shared_memory
from graphcap.opsdb.triton.linear import config, skinny_linear

SHAPES = {  # name: (N, K, mode) with weight [N, K] ([2N, K] for swiglu)
    "qwen3-0.6b qkv": (4096, 1024, "norm"), "qwen3-0.6b o": (1024, 2048, "residual"),
    "qwen3-0.6b gate/up": (3072, 1024, "swiglu"), "qwen3-0.6b down": (1024, 3072, "residual"),
}
ROWS = (64,)
POOL_BYTES = 256 << 20  # weights cycled: far more than the 50 MB L2
EPS = 1e-6


def tiles(m: int, n: int, k: int, swiglu: bool, sms: int, shared: int) -> list[dict]:
    """The grid of tiles swept: each with as many stages (2 to 4) as fit ``shared``, and
    K split so that the grid holds between half the SMs and four programs an SM."""
    block_m = max(16, triton.next_power_of_2(m))
    out = []
    for block_n in (16, 32, 64, 128):
        for block_k in (128, 256):
            per_stage = 2 * block_k * (block_m + block_n * (2 if swiglu else 1))
            stages = min(4, (shared - 8192) // per_stage)
            if stages < 2 or block_k > k:
                continue
            blocks = triton.cdiv(n, block_n)
            slices = triton.cdiv(k, block_k)
            for split in (1, 2, 4, 8, 16):
                if split > slices or not sms // 2 <= blocks * split <= 4 * sms:
                    continue
                for warps in (4, 8) if block_m * block_n >= 4096 else (4,):
                    out.append({"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k,
                                "SPLIT_K": split, "num_warps": warps, "num_stages": stages})
    return out


def shape_rows(name: str, n: int, k: int, mode: str, m: int, sms: int, shared: int) -> dict:
    swiglu = mode == "swiglu"
    rows_w = 2 * n if swiglu else n
    nbytes = rows_w * k * 2
    copies = max(4, min(LAUNCHES, POOL_BYTES // nbytes))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(rows_w, k, device="cuda", dtype=torch.bfloat16, generator=gen)
               / k ** 0.5 for _ in range(copies)]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    g = 1 + 0.1 * torch.randn(k, device="cuda", dtype=torch.bfloat16, generator=gen)
    res = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=gen)
    kw = {"residual": res} if mode == "residual" else {"norm_weight": g, "eps": EPS,
                                                       "swiglu": swiglu}

    def unfused(i):
        w = weights[i]
        if mode == "residual":
            return res + F.linear(x, w)
        y = F.linear(F.rms_norm(x, (k,), g, EPS), w)
        if swiglu:
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return y

    want = unfused(0).float()
    scale = want.abs().max().item()
    row = {"bytes": nbytes, "copies": copies, "rows": m, "mode": mode}

    def put(key, us, **more):
        row[key] = {"us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3), **more}

    put("unfused", per_launch_us(unfused, copies))
    today = config(m, n, k, norm=mode != "residual", swiglu=swiglu, sms=sms, shared=shared)
    swept = []
    for cfg in [today] + tiles(m, n, k, swiglu, sms, shared):
        try:
            got = skinny_linear(x, weights[0], tiles=cfg, **kw).float()
            err = (got - want).abs().max().item() / scale
            if err > 2e-2:
                swept.append({**cfg, "error": f"off by {err:.3g} of the output's scale"})
                continue
            us = per_launch_us(lambda i, c=cfg: skinny_linear(x, weights[i], tiles=c, **kw),
                               copies)
            swept.append({**cfg, "us": round(us, 2), "tb_s": round(nbytes / us / 1e6, 3)})
        except Exception as e:  # a tile the device refuses (shared memory, registers)
            swept.append({**cfg, "error": repr(e)[:200]})
    row["today"] = swept[0]
    row["tiles"] = sorted((t for t in swept[1:] if "us" in t), key=lambda t: t["us"])
    row["failed"] = [t for t in swept[1:] if "us" not in t]
    weights.clear()
    torch.cuda.empty_cache()
    best = row["tiles"][:5]
    print(f"{name:20s} m={m:2d} {nbytes / 2**20:5.1f} MB  unfused {row['unfused']['us']:6.2f}"
          f"  today {row['today'].get('us', 'x')}  best " + ", ".join(
              f"{t['us']} (n{t['BLOCK_N']} k{t['BLOCK_K']} s{t['SPLIT_K']} w{t['num_warps']} "
              f"st{t['num_stages']})" for t in best) + f"  [{len(row['failed'])} failed]",
          flush=True)
    return row


def main(rows, names) -> None:
    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    shared = shared_memory(device)
    out = {"what": "few-row linear tiles per decode projection and row count, against "
                   "today's config and the unfused ops; CUDA graphs of "
                   f"{LAUNCHES} launches over weights cycled past L2",
           **environment(), "pdl_env": os.environ.get("GRAPHCAP_PDL", ""), "sms": sms,
           "shared": shared, "rows": {}}
    path = os.path.join(os.environ.get("OUT", "/tmp"), "skinny-sweep.json")
    start = time.time()
    for m in rows:
        for name in names:
            n, k, mode = SHAPES[name]
            out["rows"][f"{name} m={m}"] = shape_rows(name, n, k, mode, m, sms, shared)
            out["seconds"] = round(time.time() - start, 1)
            with open(path, "w") as f:  # what is done so far survives a timeout
                json.dump(out, f, indent=1)


if __name__ == "__main__":
    main([int(m) for m in sys.argv[1].split(",")] if len(sys.argv) > 1 else list(ROWS),
         sys.argv[2].split(",") if len(sys.argv) > 2 else list(SHAPES))
