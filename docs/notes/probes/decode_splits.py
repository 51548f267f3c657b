"""Decode attention's splits taken from each row's length, against splits of the block
table's width (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_splits.py [batches]

The kernel's split count follows from host shapes (the table's width, the SMs), so a
graph captured for an engine's ``max_len`` (4096 by default) splits a 1024-token row as if
it held 4096 tokens: at batch 1 on qwen3-0.6b's heads, 16 splits of 256 tokens, of which
4 read anything (32 programs of 128 KB each, against 64 of 64 KB in a 1024-token table).
With ``SPLIT_OF_LENGTH`` (the kernel's default since this probe; history item 115) each
split takes its share of the row's own tokens (rounded up to ``BLOCK_N``, or to
``SPLIT_QUANTUM`` tokens), so a short row reads in more splits than the table width's
first few (1024 tokens of 16 splits: 8 of 128 tokens against 4 of 256; with 16-token
rounding all 16).

Measured on an H100 (``docs/results/2026-12-07-decode-splits-8eca117-h100.json``): batch
1, context 1024 in a 4096-token table 11.69 us to 9.36 (8.94 in a 1024-token table);
2048 in 8192 16.34 to 10.85; batch 8, 1024 in 4096 25.82 to 20.22; no change where the
table is the row's length; rounding to 16 tokens and twice the splits slower everywhere.

Arms, each alone over cache layers cycled past L2 (``graphcap.bench.timing.cycled_ms``),
PDL off, per (batch, context, table width): ``fixed`` (the host's split length,
``SPLIT_OF_LENGTH`` off), ``length``, ``length, quantum 16``, and the two length arms at
twice the splits. JSON in $OUT/decode-splits.json."""

import functools
import json
import math
import os
import sys

import torch

from graphcap.bench.common import environment
from graphcap.bench.timing import cycled_ms
from graphcap.kv import PagedKVCache
from graphcap.opsdb.triton.common import num_sms, programmatic_launch, shared_memory
from graphcap.opsdb.triton.decode import decode_attention
from graphcap.opsdb.triton.decode_grid import head_block, programs_of, tiles_for

HQ, HK, D = 16, 8, 128
CYCLE_BYTES = 160 << 20  # past L2
CASES = ((1024, 1024), (1024, 4096), (256, 4096), (2048, 8192))  # (context, table tokens)


def case(batch: int, context: int, table: int) -> dict:
    dev = torch.device("cuda")
    per_layer = batch * table * HK * D * 2 * 2
    layers = max(2, -(-CYCLE_BYTES // per_layer))
    cache = PagedKVCache(layers, HK, D, max_requests=batch, max_len=table,
                         dtype=torch.bfloat16, device=dev)
    for slot in range(batch):
        cache.admit(slot, table)
    cache.k.normal_()
    cache.v.normal_()
    q = torch.randn(batch, HQ, D, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    width_tokens = cache.block_table.shape[1] * cache.page_size
    cfg, splits = tiles_for(programs_of(batch, HQ, HK), width_tokens, num_sms(dev),
                            shared_memory(dev), D * 2, head_block(HQ // HK), D)
    scale = 1 / math.sqrt(D)

    def arm(**extra):
        return [functools.partial(decode_attention, q, *cache.layer(i), cache.block_table,
                                  lens, out, scale, **extra) for i in range(cache.layers)]

    length, quantum = {"SPLIT_OF_LENGTH": True}, {"SPLIT_OF_LENGTH": True, "SPLIT_QUANTUM": 16}
    fixed = {"SPLIT_OF_LENGTH": False}
    arms = {"fixed": arm(tiles=fixed), "length": arm(tiles=length),
            "length, quantum 16": arm(tiles=quantum)}
    if 2 * splits <= 64 and splits > 1:
        arms[f"length, splits {2 * splits}"] = arm(num_splits=2 * splits, tiles=length)
        arms[f"length, quantum 16, splits {2 * splits}"] = arm(num_splits=2 * splits,
                                                               tiles=quantum)
    want = arm(tiles=fixed)[0]
    want()
    ref = out.clone()
    us, errors, diffs = {}, {}, {}
    with programmatic_launch(False):
        for name, calls in arms.items():
            try:
                calls[0]()
                diffs[name] = float((out.float() - ref.float()).abs().max())
                us[name] = round(cycled_ms(calls) * 1e3, 2)
            except Exception as exc:  # noqa: BLE001  (told; the rest run)
                errors[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return {"batch": batch, "context": context, "table_tokens": width_tokens,
            "splits": splits, "tiles": cfg, "us": us, "max_abs_diff_vs_fixed": diffs,
            "errors": errors, "bytes": batch * context * HK * D * 2 * 2}


def main() -> None:
    batches = [int(b) for b in (sys.argv[1] if len(sys.argv) > 1 else "1,8").split(",")]
    rows = []
    for batch in batches:
        for context, table in CASES:
            row = case(batch, context, table)
            rows.append(row)
            for name, t in row["us"].items():
                print(f"b={batch:<3d} ctx={context:<5d} table={table:<5d} splits="
                      f"{row['splits']:<3d} {name:40s} {t:7.2f} us "
                      f"(diff {row['max_abs_diff_vs_fixed'][name]:.3g})", flush=True)
            for name, err in row["errors"].items():
                print(f"b={batch} ctx={context} table={table} {name}: {err}", flush=True)
    result = {**environment(), "what": "decode attention, splits of the row's length against "
              "splits of the table's width, each arm alone over layers cycled past L2, PDL off",
              "command": " ".join(sys.argv), "heads": [HQ, HK, D], "rows": rows}
    path = os.path.join(os.environ.get("OUT", "."), "decode-splits.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
