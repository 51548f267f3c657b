"""Where a decode call's host time goes (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_host.py [preset] [batch] [prefill]

A full runner of ``DecodeInputs`` (context 1024) for the preset: its call and its bare
replay timed interleaved with CUDA events (as ``graphcap bench decode`` times a call),
each one's host microseconds from an idle GPU until it returns, each phase of the call's
host path timed alone from an idle GPU (the model's snapshot check, the inputs' check,
the route, staging, the replay's launch, the outputs' copy, the commit), the model's
check alone, and a cProfile of back-to-back calls (own time per function). With
``prefill``: a full runner of a prefill of ``batch`` tokens (one request, Triton
attention), as ``graphcap bench prefill``'s full arm calls it. JSON in
$OUT/<kind>-host-<preset>-<batch>.json."""

import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
from probe_common import prefilled_decode

import graphcap
from graphcap.bench.common import environment, host_us, time_interleaved
from graphcap.inputs import DecodeInputs
from graphcap.models import build_model

CONTEXT = 1024


def phases(runner, call, reps: int = 200) -> dict:
    """Median host microseconds of each phase of ``call`` (wrapped methods of the
    runner and its inputs), each call from an idle GPU."""
    spent: dict[str, list[float]] = {}
    wrapped = {"snapshot.current": (runner._snapshot, "current"),
               "inputs.check": (runner.inputs, "check"), "route": (runner, "_route"),
               "inputs.stage": (runner.inputs, "stage"),
               "inputs.out_rows": (runner.inputs, "out_rows"),
               "inputs.commit": (runner.inputs, "commit")}
    for entry in runner.entries.values():
        wrapped[f"replay {entry.bucket}"] = (entry, "replay")
    restore = []
    for name, (obj, attr) in wrapped.items():
        fn = getattr(obj, attr)
        restore.append((obj, attr, fn if attr in vars(obj) else None))

        def timed(*a, _fn=fn, _name=name, **k):
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                spent.setdefault(_name, []).append(time.perf_counter() - start)
        setattr(obj, attr, timed)
    total = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        total.append(time.perf_counter() - start)
    for obj, attr, fn in restore:
        if fn is None:
            delattr(obj, attr)
        else:
            setattr(obj, attr, fn)
    out = {name: round(statistics.median(v) * 1e6, 1) for name, v in spent.items()}
    out["call"] = round(statistics.median(total) * 1e6, 1)
    return out


def snapshot_check(runner, reps: int = 500) -> dict:
    """The model's check alone: host microseconds of ``ModelSnapshot.current``."""
    return {"tensors": len(runner._snapshot._stored),
            "us": host_us(runner._snapshot.current, reps)}


def main(preset: str, batch: int, kind: str) -> dict:
    if kind == "prefill":
        model = build_model(preset, device="cuda", dtype=torch.bfloat16)
        runner = graphcap.capture(model, "full", buckets=[batch], attention="triton")
        ids = torch.randint(1, model.args.vocab_size, (batch,), device="cuda")
        pos = torch.arange(batch, device="cuda")

        def call():
            return runner(ids, pos, seq_lens=[batch])
    else:
        model, cache, tokens = prefilled_decode(preset, batch, CONTEXT)
        runner = graphcap.capture(model, "full", buckets=[batch],
                                  inputs=DecodeInputs(cache))
        rows, positions = list(range(batch)), [CONTEXT] * batch

        def call():
            return runner(tokens[:batch], positions=positions, slots=rows)

    call()
    entry = runner.entries[batch]
    times = time_interleaved({"call": call, "replay": entry.replay}, reps=100, rounds=5)
    out = {"preset": preset, "batch": batch, "kind": kind,
           "call_ms": times["call"]["median_ms"], "replay_ms": times["replay"]["median_ms"],
           "host_call_us": host_us(call, 200), "host_replay_us": host_us(entry.replay, 200)}
    out["phases_us"] = phases(runner, call)
    out["snapshot_check_us"] = snapshot_check(runner)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(500):
        call()
    prof.disable()
    stats = pstats.Stats(prof)
    top = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:25]
    out["own_us_per_call"] = [
        {"function": f"{path.rsplit('/', 2)[-1]}:{line}({name})",
         "own_us": round(tt / 500 * 1e6, 2), "cumulative_us": round(ct / 500 * 1e6, 2)}
        for (path, line, name), (_, _, tt, ct, _) in top]
    print(json.dumps(out, indent=1), flush=True)
    return out


if __name__ == "__main__":
    preset = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 1
    kind = sys.argv[3] if len(sys.argv) > 3 else "decode"
    record = {"what": f"a {kind} call's host time", **environment(), "context": CONTEXT,
              **main(preset, batch, kind)}
    name = f"{kind}-host-{preset}-{batch}.json"
    with open(os.path.join(os.environ.get("OUT", "."), name), "w") as f:
        json.dump(record, f, indent=1)
