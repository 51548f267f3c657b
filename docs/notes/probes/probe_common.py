"""Pieces the runner probes of tools/gpu share (imported by the scripts beside it)."""

from graphcap.bench.common import time_interleaved
from graphcap.bench.prefill import SETTLE_MS


def diffs_vs(runners: dict, inputs: dict, lengths, base: str = "default") -> dict:
    """Per length, each runner's largest absolute logit difference from ``base``'s."""
    out = {}
    for n in lengths:
        want = runners[base](*inputs[n], seq_lens=[n]).float()
        out[n] = {name: float((r(*inputs[n], seq_lens=[n]).float() - want).abs().max())
                  for name, r in runners.items() if name != base}
    return out


def calls_and_replays(runners: dict, inputs: dict, lengths, reps: int = 60) -> dict:
    """Per length, each runner's call and bare replay timed interleaved (as the bench
    times arms), printed as they come."""
    out = {}
    for n in lengths:
        arms = {}
        for name, r in runners.items():
            arms[f"{name}-call"] = lambda r=r, n=n: r(*inputs[n], seq_lens=[n])
            arms[f"{name}-replay"] = r.entries[n].replay
        out[n] = time_interleaved(arms, reps=reps, settle_ms=SETTLE_MS)
        print(n, {k: v["median_ms"] for k, v in out[n].items()}, flush=True)
    return out
