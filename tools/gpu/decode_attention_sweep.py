"""Tiles and splits of the Triton decode attention kernel on this GPU, beside FlashInfer:
``python tools/gpu/decode_attention_sweep.py OUT.json``. For each case the default arm,
then each tile setting at the default split count, then split counts around it.
``python tools/gpu/decode_attention_sweep.py OUT.json grid``: the few-row cases (qwen3-0.6b's
heads, batch 1 and 8 at context 1024, batch 1 at 4096) over every combination of tiles
and split counts (:data:`GRID`), where the defaults read 13-49% of the bandwidth.
``python tools/gpu/decode_attention_sweep.py OUT.json early``: every model, batch 1, 8
and 64 at contexts 1024 and 4096, the defaults against the same tiles with each block's
values loaded with its keys (``EARLY_V``).
``python tools/gpu/decode_attention_sweep.py OUT.json stages``: every model at batch 1 and
8 (contexts 1024 and 4096) and batch 64 (256 and 1024), the defaults against each block
size at the stage counts where Triton's pipeliner keeps more key and value blocks in
flight (:data:`STAGES`), at the default split count and a half and a quarter of it."""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch

from graphcap.bench.common import environment
from graphcap.bench.decode_attention import HEADS, case
from graphcap.opsdb.triton.common import num_sms
from graphcap.opsdb.triton.decode_grid import programs_of, splits_for

TILES = [{"BLOCK_N": n, "num_warps": w, "num_stages": s}
         for n, w, s in itertools.product((32, 64, 128), (4, 8), (2, 3))]
GRID = [{"tiles": {"BLOCK_N": n, "num_warps": w, "num_stages": s}, "num_splits": k}
        for n, w, s, k in itertools.product((32, 64, 128), (4, 8), (2, 3, 4), (1, 2, 4, 8, 16))
        if n * s <= 384]  # the stages' K and V tiles in shared memory (head dim 128)
GRID_CASES = (("qwen3-0.6b", 1, 1024), ("qwen3-0.6b", 8, 1024), ("qwen3-0.6b", 1, 4096))
# The block table's indirection costs the pipeliner half of num_stages: the kernel's key
# and value blocks get (num_stages - 1) // 2 shared-memory buffers, one up to 4 stages
# (docs/notes/probes/kernel_registers.py pipeline). Each block size at 2, 3 and 4 buffers,
# where those fit an SM's shared memory (64 KB a 128-token buffer at head dim 128).
STAGES = [{"BLOCK_N": n, "num_warps": 4, "num_stages": s}
          for n, s in itertools.product((32, 64, 128), (5, 7, 9)) if n * (s - 1) // 2 <= 384]
STAGE_CASES = (1, 1024), (1, 4096), (8, 1024), (8, 4096), (64, 256), (64, 1024)


def main(path: str, mode: str = "") -> None:
    dev = torch.device("cuda")
    rows = []
    start = time.perf_counter()
    cases = GRID_CASES if mode == "grid" else [
        (m, b, c) for m, (b, c) in itertools.product(HEADS, STAGE_CASES)] \
        if mode == "stages" else [
        (m, b, c) for m, b, c in itertools.product(HEADS, (1, 8, 64), (1024, 4096))]
    for model, batch, context in cases:
        hq, hk, d = HEADS[model]
        programs = programs_of(batch, hq, hk)
        auto = splits_for(programs, context, 64, num_sms(dev))
        if mode == "grid":
            extra = [g for g in GRID if g["num_splits"] * g["tiles"]["BLOCK_N"] <= context]
        elif mode == "early":
            extra = [{"tiles": {"EARLY_V": True}}]
        elif mode == "stages":
            extra = []
            for t in STAGES:
                own = splits_for(programs, context, t["BLOCK_N"], num_sms(dev))
                extra += [{"tiles": t, "num_splits": k}
                          for k in sorted({own, max(1, own // 2), max(1, own // 4)})]
        else:
            splits = sorted({max(1, auto // 4), max(1, auto // 2), auto * 2, auto * 4}
                            - {auto})
            splits = [s for s in splits if s <= 32 and (s == 1 or programs <= 1024)]
            extra = [{"tiles": t} for t in TILES] + [{"num_splits": s} for s in splits]
        row = case(batch, context, HEADS[model], dev, triton_tiles=extra)
        row["model"], row["auto_splits"] = model, auto
        best = min((k for k in row["ms"] if k.startswith("triton")), key=row["ms"].get)
        print(f"{model} b={batch} ctx={context}: triton {row['ms']['triton']:.4f} ms "
              f"({row['share']['triton']:.2f}), best {best} {row['ms'][best]:.4f} "
              f"({row['share'][best]:.2f}) "
              f"{extra[int(best[7:])] if '#' in best else ''}, flashinfer "
              f"{row['ms'].get('flashinfer')} ({row['share'].get('flashinfer')})",
              flush=True)
        rows.append(row)
    with open(path, "w") as f:
        json.dump({"what": "Triton decode attention tiles and splits, beside FlashInfer",
                   **environment(), "seconds": round(time.perf_counter() - start, 1),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(*sys.argv[1:3])
