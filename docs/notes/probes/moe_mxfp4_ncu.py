"""Where opsdb's CUDA MXFP4 expert kernels wait: Nsight Compute's speed of light, occupancy,
scheduler statistics and every issue-stall reason of each expert kernel of one
``graphcap.opsdb.cuda.moe.moe_experts`` call on gpt-oss-120b's experts (128, H = I = 2880,
top-4, random routing, random operand-order weights), at the tiles the library picks:

    PYTHONPATH=. [PROBE_TOKENS=512] python3 docs/notes/probes/moe_mxfp4_ncu.py

The script runs itself under ``ncu`` (``/usr/local/cuda/bin/ncu``, or ``NCU``) with
``PROBE_TARGET=1``, profiles the second of two calls (the first builds and warms) and
writes $OUT/moe-mxfp4-ncu.json: per kernel, each metric's value, the stall reasons as
warps stalled per issued instruction (largest first). ncu locks the SM clock at about
1.33 GHz, so its durations are not the timings of the other probes."""

import csv
import io
import json
import os
import subprocess
import sys

SECTIONS = ("SpeedOfLight", "Occupancy", "SchedulerStats", "WarpStateStats",
            "MemoryWorkloadAnalysis")
STALLS = r"regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio"


def target() -> None:
    """Two calls of moe_experts at PROBE_TOKENS tokens (ncu profiles the second)."""
    import torch

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from moe_mxfp4_decode import random_layer

    from graphcap.opsdb import mxfp4, reference
    from graphcap.opsdb.cuda.moe import moe_experts

    torch.manual_seed(0)
    experts, hidden, inter, k = 128, 2880, 2880, 4
    tokens = int(os.environ.get("PROBE_TOKENS", "512"))
    w13, s13, b13, w2, s2, b2 = random_layer(experts, hidden, inter, "cuda")
    ow13, os13 = mxfp4.operand_order(w13, s13, True, True)
    ow2, os2 = mxfp4.operand_order(w2, s2, False, False)
    x = (torch.randn(tokens, hidden, device="cuda") * 0.5).bfloat16()
    weights, ids = reference.moe_topk_softmax(torch.randn(tokens, experts, device="cuda"),
                                              k, True)
    for _ in range(2):
        moe_experts(x, ow13, ow2, weights, ids, b13, b2, alpha=1.702, limit=7.0,
                    interleaved=True, w13_scale=os13, w2_scale=os2)
    torch.cuda.synchronize()


def parse(stdout: str) -> dict:
    """ncu's CSV: per kernel (``"<ID> <name>"``, in launch order), its metrics and its
    stall reasons as warps stalled per issued instruction, largest first."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO("\n".join(lines[header:]))):
        name = row["Kernel Name"].split("(")[0].replace("void ", "")
        metrics = kernels.setdefault(f"{row['ID']} {name}", {"metrics": {}, "stalls": {}})
        metric, value = row["Metric Name"], row["Metric Value"].replace(",", "")
        if not metric:
            continue
        try:
            number = float(value)
        except ValueError:
            continue
        if metric.startswith("smsp__average_warps_issue_stalled_"):
            reason = metric.removeprefix("smsp__average_warps_issue_stalled_")
            metrics["stalls"][reason.removesuffix("_per_issue_active.ratio")] = number
        else:
            metrics["metrics"][f"{metric} ({row['Metric Unit']})"] = number
    for entry in kernels.values():
        entry["stalls"] = dict(sorted(entry["stalls"].items(), key=lambda kv: -kv[1]))
    return kernels


def profile() -> dict:
    ncu = os.environ.get("NCU", "/usr/local/cuda/bin/ncu")
    command = [ncu, "-k", "regex:experts", "-s", "2", "-c", "2", "--csv",
               *[a for s in SECTIONS for a in ("--section", s)], "--metrics",
               "smsp__inst_executed.sum,dram__bytes_read.sum," + STALLS,
               sys.executable, os.path.abspath(__file__)]
    env = dict(os.environ, PROBE_TARGET="1")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    kernels = parse(done.stdout)
    return {"command": " ".join(command[:-2]) + " python3 moe_mxfp4_ncu.py",
            "tokens": int(os.environ.get("PROBE_TOKENS", "512")), "kernels": kernels}


def main() -> None:
    if os.environ.get("PROBE_TARGET"):
        target()
        return
    from graphcap.bench.common import environment

    result = {"what": "Nsight Compute of opsdb's CUDA MXFP4 expert kernels "
                      "(docs/notes/probes/moe_mxfp4_ncu.py)", **environment(), **profile()}
    for name, entry in result["kernels"].items():
        top = list(entry["stalls"].items())[:6]
        print(name, " ".join(f"{reason} {value:.2f}" for reason, value in top))
    with open(os.path.join(os.environ.get("OUT", "."), "moe-mxfp4-ncu.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
