"""Where graphcap's decode attention kernel waits at batch 1 (qwen3-0.6b's heads, context
1024): Nsight Compute's speed of light, launch statistics, occupancy and every issue-stall
reason of ``graphcap::decode_attention``'s Triton kernel at the tiles the library picks,
beside the read-only kernel of ``decode_chain.py`` on the same grid, an arm with each
block's values loaded with its keys (``EARLY_V``) and one with its products in registers
(``CUDA_CORES``, 32-token blocks, the next asked for ahead):

    PYTHONPATH=. [PROBE_BATCH=1] python3 docs/notes/probes/decode_ncu.py

Item 116 of the performance history puts the kernel at 8.96 us alone, of which reading
takes 4.82 with this grid and the merge 1.57; this says what the other 2.6 us wait on.
The script runs itself under ``ncu`` (``/usr/local/cuda/bin/ncu``, or ``NCU``) with
``PROBE_TARGET=1``; each kernel is called twice and ncu profiles the second (caches flushed
before each, as ncu does by default). Writes $OUT/decode-ncu.json: per kernel, each
metric's value and the stall reasons as warps stalled per issued instruction (largest
first). ncu locks the SM clock, so its durations are not the other probes' timings."""

import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from moe_mxfp4_ncu import SECTIONS, STALLS, parse  # noqa: E402

ARMS = ("kernel", "kernel EARLY_V", "kernel CUDA_CORES", "read")


def target() -> None:
    """Two calls of each arm at PROBE_BATCH rows (ncu profiles the second of each)."""
    import math

    import torch
    from decode_chain import CONTEXT, HK, HQ, D, _cache, _read

    from graphcap.opsdb.triton.common import num_sms, programmatic_launch, shared_memory
    from graphcap.opsdb.triton.decode import decode_attention
    from graphcap.opsdb.triton.decode_grid import head_block, programs_of, tiles_for

    torch.manual_seed(0)
    batch = int(os.environ.get("PROBE_BATCH", "1"))
    cache = _cache(batch)
    q = torch.randn(batch, HQ, D, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.full((batch,), CONTEXT, dtype=torch.int32, device="cuda")
    kc, vc = cache.layer(0)
    dev = torch.device("cuda")
    cfg, splits = tiles_for(programs_of(batch, HQ, HK), CONTEXT, num_sms(dev),
                            shared_memory(dev), D * 2, head_block(HQ // HK), D)
    arms = {"kernel": lambda: decode_attention(q, kc, vc, cache.block_table, lens, out,
                                               1 / math.sqrt(D)),
            "kernel EARLY_V": lambda: decode_attention(q, kc, vc, cache.block_table, lens,
                                                       out, 1 / math.sqrt(D),
                                                       tiles={"EARLY_V": True}),
            "kernel CUDA_CORES": lambda: decode_attention(
                q, kc, vc, cache.block_table, lens, out, 1 / math.sqrt(D), num_splits=splits,
                tiles={"CUDA_CORES": True, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1,
                       "AHEAD": True}),
            "read": _read(cache, lens, splits, cfg["BLOCK_N"])[0]}
    with programmatic_launch(False):
        for name in ARMS:
            for _ in range(2):
                arms[name]()
            torch.cuda.synchronize()


def profile() -> dict:
    ncu = os.environ.get("NCU", "/usr/local/cuda/bin/ncu")
    # the kernels in ARMS' order, each's second call
    command = [ncu, "-k", "regex:_decode_kernel|_read_kernel", "--csv",
               *[a for s in (*SECTIONS, "LaunchStats") for a in ("--section", s)],
               "--metrics", "smsp__inst_executed.sum,dram__bytes_read.sum," + STALLS,
               sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ, PROBE_TARGET="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    kernels = parse(done.stdout)
    names = list(kernels)
    kept = {f"{ARMS[i // 2]}: {name}": kernels[name] for i, name in enumerate(names)
            if i % 2 == 1 and i // 2 < len(ARMS)}
    return {"command": " ".join(command[:-2]) + " python3 decode_ncu.py",
            "batch": int(os.environ.get("PROBE_BATCH", "1")), "kernels": kept}


def main() -> None:
    if os.environ.get("PROBE_TARGET"):
        target()
        return
    from graphcap.bench.common import environment

    result = {"what": "Nsight Compute of graphcap's decode attention kernel "
                      "(docs/notes/probes/decode_ncu.py)", **environment(), **profile()}
    for name, entry in result["kernels"].items():
        top = list(entry["stalls"].items())[:8]
        print(name, " ".join(f"{reason} {value:.2f}" for reason, value in top))
        print("   ", {k: v for k, v in entry["metrics"].items()
                      if k.split(" (")[0] in ("Duration", "Registers Per Thread",
                                              "Achieved Occupancy", "DRAM Throughput",
                                              "Dynamic Shared Memory Per Block")})
    with open(os.path.join(os.environ.get("OUT", "."), "decode-ncu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
