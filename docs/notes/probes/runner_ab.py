"""The runner's host path, one tree against another on one machine: run as
``python3 runner_ab.py TREE...``; each tree (a folder holding a ``graphcap`` package) is
timed in a process of its own, the trees alternating, three rounds. Per process: a full
runner of qwen3-0.6b (bf16, last-token logits, Triton attention, buckets 16 and 512, one
request slot); ``host_call_us`` is the median host time of a call made on an idle GPU
(synchronised before each: the checks, staging and launch alone), ``call_ms`` the CUDA-
event time of a call back to back with the next, ``replay_ms`` the same of the bare
graph. Public API only, so any tree since the runner took ``attention=`` runs it."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

ONE = r"""
import json, statistics, time, torch, graphcap
from graphcap.models import build_model
model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
runner = graphcap.capture(model, "full", buckets=[16, 512], max_requests=1, attention="triton")
ids = torch.randint(1, 1000, (16,), device="cuda")
pos = torch.arange(16, device="cuda")
call = lambda: runner(ids, pos, seq_lens=[16])
for _ in range(200):
    call()
torch.cuda.synchronize()
host = []
for _ in range(300):
    torch.cuda.synchronize()
    t = time.perf_counter(); call(); host.append((time.perf_counter() - t) * 1e6)
def events(fn, n=300):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); start.record()
    for _ in range(n):
        fn()
    end.record(); torch.cuda.synchronize()
    return start.elapsed_time(end) / n
graph = runner.entries[16].replay if hasattr(runner, "entries") else None
out = {"host_call_us": round(statistics.median(host), 1), "call_ms": round(events(call), 4)}
if graph is not None:
    out["replay_ms"] = round(events(graph), 4)
print("RESULT " + json.dumps(out))
"""


def main(trees: list[str]) -> None:
    rows = []
    for round_ in range(3):
        for tree in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, "-c", ONE], env=env, capture_output=True,
                                  text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                print(proc.stdout[-2000:], proc.stderr[-3000:])
                raise SystemExit(f"{tree}: no result")
            rows.append({"round": round_, "tree": tree, **json.loads(line[7:]),
                         "process_s": round(time.perf_counter() - start, 1)})
            print(rows[-1], flush=True)
    summary = {tree: {k: statistics.median(r[k] for r in rows if r["tree"] == tree)
                      for k in ("host_call_us", "call_ms")} for tree in trees}
    print("SUMMARY " + json.dumps(summary))


if __name__ == "__main__":
    main(sys.argv[1:])
