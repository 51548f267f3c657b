"""qwen3-0.6b full-triton with and without programmatic dependent launch, in one process
(device side): PYTHONPATH=. python3 tools/gpu/pdl_probe.py; JSON in $OUT/pdl-probe.json.

Both runners capture the same buckets; their calls and bare replays are timed
interleaved (as `graphcap bench prefill` times arms), their logits compared bit for bit,
their replays profiled for kernel time and idle share at 16 tokens, and the host path of
a call split into its steps."""

import json
import os
import time

import torch

import graphcap
from graphcap.bench.arms import prompts
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.prefill import SETTLE_MS, host_us, top_kernels
from graphcap.core.batch import check_prefill
from graphcap.models import build_model
from graphcap.opsdb.triton.common import pdl, programmatic_launch

LENGTHS = [16, 64, 256]
model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, logits="last")
inputs = prompts(LENGTHS, model.args.vocab_size, "cuda")
result = {**environment(), "pdl_available": pdl(torch.device("cuda")), "lengths": LENGTHS}
runners = {}
for enabled in (True, False):
    with programmatic_launch(enabled):
        start = time.perf_counter()
        runners[f"pdl-{'on' if enabled else 'off'}"] = graphcap.capture(
            model, "full", buckets=LENGTHS, max_requests=1, attention="triton")
        result[f"build_s_pdl_{'on' if enabled else 'off'}"] = time.perf_counter() - start

# A third runner: PDL, and q/k/v through the fused norm-and-linear kernel at up to 16
# rows (dispatch leaves rms_norm_linear to the norm and cuBLAS, measured without PDL).
from graphcap.opsdb.triton import linear  # noqa: E402

unfused_rows = linear.fused_rows


def fused_qkv_rows(weight, kind):
    if kind == "plain" and weight.numel() * weight.element_size() <= 16 << 20:
        return 16
    return unfused_rows(weight, kind)


linear.fused_rows = fused_qkv_rows
start = time.perf_counter()
runners["pdl-on-fused-qkv"] = graphcap.capture(model, "full", buckets=LENGTHS,
                                               max_requests=1, attention="triton")
result["build_s_pdl_on_fused_qkv"] = time.perf_counter() - start
linear.fused_rows = unfused_rows

result["same_logits"] = {}
for n in LENGTHS:
    on, off, fused = (r(*inputs[n], seq_lens=[n]) for r in runners.values())
    result["same_logits"][n] = {"on_off": bool(torch.equal(on, off)),
                                "fused_qkv_max_abs": float((fused - off).abs().max()),
                                "logits_abs_max": float(off.abs().max())}

result["timings"] = {}
for n in LENGTHS:
    arms = {}
    for name, r in runners.items():
        arms[f"{name}-call"] = lambda r=r, n=n: r(*inputs[n], seq_lens=[n])
        arms[f"{name}-replay"] = r.entries[n].replay
    result["timings"][n] = time_interleaved(arms, reps=60, settle_ms=SETTLE_MS)
    print(n, {k: v["median_ms"] for k, v in result["timings"][n].items()}, flush=True)

from torch.profiler import ProfilerActivity, profile  # noqa: E402

result["profile_16"] = {}
for name, r in runners.items():
    entry = r.entries[16]
    for _ in range(5):
        entry.replay()
    torch.cuda.synchronize()
    reps = 20
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(reps):
        entry.replay()
    end_ev.record()
    end_ev.synchronize()
    wall = start_ev.elapsed_time(end_ev) / reps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            entry.replay()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernel_ms = sum(e.device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA and e.count) / 1e3
    result["profile_16"][name] = {"wall_ms": round(wall, 4),
                                  "kernel_ms": round(kernel_ms / reps, 4),
                                  "top_kernels": top_kernels(events, reps, top=16)}

# The host path of a 16-token call, step by step (perf_counter, from an idle GPU).
r = runners["pdl-on"]
ids, pos = inputs[16]
steps = {
    "call": lambda: r(ids, pos, seq_lens=[16]),
    "replay": r.entries[16].replay,
    "check_prefill": lambda: check_prefill(ids, pos, [16], r.device),
    "foreach_copy": lambda: torch._foreach_copy_([b[:16] for b in r._inputs], [ids, pos]),
    "metadata_update": lambda: r.metadata[16].update([16], derive=False),
    "clone_logits": lambda: r._outputs[0][:1].clone(),
}
with torch.inference_mode():  # as the runner's replay path runs them
    result["host_us_16"] = {k: host_us(fn, 200) for k, fn in steps.items()
                            if k != "call"}
result["host_us_16"]["call"] = host_us(steps["call"], 200)
print(json.dumps({k: v for k, v in result.items() if k != "timings"}, indent=1)[:6000])
with open(os.path.join(os.environ.get("OUT", "/tmp"), "pdl-probe.json"), "w") as f:
    json.dump(result, f, indent=1)
