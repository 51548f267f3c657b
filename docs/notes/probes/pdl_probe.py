"""A preset's full-triton runner with and without programmatic dependent launch, in one
process (device side):

    PYTHONPATH=. python3 tools/gpu/pdl_probe.py [preset] [lengths...]

JSON in $OUT/pdl-probe-<preset>.json. Both runners capture the same buckets; their calls
and bare replays are timed interleaved (as `graphcap bench prefill` times arms), their
logits compared bit for bit, the host path of a 16-token call split into its steps (from
an idle GPU, before any profiling: a profiler leaves launches slower), and their replays
profiled at the shortest length. Under PDL a kernel starts before the previous one ends,
so its summed kernel time counts its wait and exceeds the wall time; busy time and the
per-kernel figures count each moment once."""

import json
import os
import sys
import time
from types import SimpleNamespace

import torch
from probe_common import calls_and_replays

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import environment
from graphcap.bench.prefill import host_us, idle_share
from graphcap.core.checks import check_prefill
from graphcap.models import build_model
from graphcap.opsdb.triton.common import pdl, programmatic_launch

PRESET = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
LENGTHS = [int(n) for n in sys.argv[2:]] or [16, 64, 256]
model = build_model(PRESET, device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
result = {**environment(), "preset": PRESET, "pdl_available": pdl(torch.device("cuda")),
          "lengths": LENGTHS}
runners = {}
for enabled in (True, False):
    name = f"pdl-{'on' if enabled else 'off'}"
    with programmatic_launch(enabled):
        start = time.perf_counter()
        runners[name] = graphcap.capture(model, "full", buckets=LENGTHS, max_requests=1,
                                         attention="triton")
        result[f"build_s_{name}"] = round(time.perf_counter() - start, 3)

result["same_logits"] = {}
for n in LENGTHS:
    on, off = (r(*inputs[n], seq_lens=[n]) for r in runners.values())
    result["same_logits"][n] = bool(torch.equal(on, off))

n0 = LENGTHS[0]


def host_steps(r, ids, pos) -> dict:
    """Host microseconds of each step of a call's replay path, and of the call."""
    steps = {
        "check_prefill": lambda: check_prefill(ids, pos, [n0], r.device),
        "foreach_copy": lambda: torch._foreach_copy_([b[:n0] for b in r._inputs], [ids, pos]),
        "metadata_update": lambda: r.metadata[n0].update([n0], derive=False),
        "replay": r.entries[n0].replay,
        "clone_logits": lambda: r._outputs[0][:1].clone(),
    }
    with torch.inference_mode():  # as the runner's replay path runs them
        host = {k: host_us(fn, 200) for k, fn in steps.items()}
    host["call"] = host_us(lambda: r(ids, pos, seq_lens=[n0]), 200)
    return host


result[f"host_us_{n0}"] = {}
for name, r in runners.items():
    result[f"host_us_{n0}"][name] = host_steps(r, *inputs[n0])
    print(name, result[f"host_us_{n0}"][name], flush=True)

result["timings"] = calls_and_replays(runners, inputs, LENGTHS)

# The bench's idle measurement of each runner's replay: wall, summed and busy kernel
# time, the top kernels.
result[f"profile_{n0}"] = {name: idle_share(SimpleNamespace(runner=r), n0)
                           for name, r in runners.items()}
print(json.dumps(result["same_logits"]), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), f"pdl-probe-{PRESET}.json"), "w") as f:
    json.dump(result, f, indent=1)
