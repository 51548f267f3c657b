"""The runner's host path before and after a replay, for two trees on one CPU:

    .venv/bin/python docs/notes/probes/prelaunch_ab.py <tree> [attention] [calls]

Runs from ``<tree>`` (a checkout of any commit: ``git worktree add /tmp/old <commit>``),
captures a one-layer ``tiny`` decoder under full (one 16-token bucket, one request slot)
on the graph emulator, and times, per call, the host microseconds from the call's entry
to the replay's start (what the GPU waits for) and from the replay's end to the call's
return; prints the medians. Run the trees alternately, twice each: the CPU's own speed
drifts between runs."""

import statistics
import sys
import time

sys.path.insert(0, sys.argv[1])

import dataclasses  # noqa: E402

import torch  # noqa: E402

import graphcap  # noqa: E402
from graphcap.core import emulated  # noqa: E402
from graphcap.models import PRESETS, Decoder  # noqa: E402

attention = sys.argv[2] if len(sys.argv) > 2 else "torch_masked"
calls = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
torch.manual_seed(0)
args = dataclasses.replace(PRESETS["tiny"], layers=1)
model = Decoder(args, logits="last").eval()
marks = {}
replay = emulated.EmulatedGraph.replay


def timed_replay(self):
    marks["in"] = time.perf_counter()
    replay(self)
    marks["out"] = time.perf_counter()


emulated.EmulatedGraph.replay = timed_replay  # before capture: the entries bind it
runner = graphcap.capture(model, "full", buckets=[16], max_requests=1, attention=attention)
ids, pos = torch.randint(1, args.vocab_size, (16,)), torch.arange(16)
before, after = [], []
for i in range(calls):
    start = time.perf_counter()
    runner(ids, pos, seq_lens=[16])
    end = time.perf_counter()
    if i >= calls // 10:
        before.append(marks["in"] - start)
        after.append(end - marks["out"])
print(sys.argv[1], "host us before the replay", round(statistics.median(before) * 1e6, 1),
      "after it", round(statistics.median(after) * 1e6, 1))
