"""Pieces the runner probes of tools/gpu share (imported by the scripts beside it)."""

import torch

import graphcap
from graphcap.bench.common import time_interleaved
from graphcap.bench.prefill import SETTLE_MS
from graphcap.engine.eager import prefill
from graphcap.inputs import DecodeInputs
from graphcap.kv import PagedKVCache
from graphcap.models import build_model
from graphcap.opsdb.triton.common import programmatic_launch


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


def prefilled_decode(preset: str, slots: int, context: int):
    """The preset (bf16, CUDA), a paged cache of ``slots`` requests prefilled with
    ``context`` random tokens each (room for one more), and a next token per request."""
    model = build_model(preset, device="cuda", dtype=torch.bfloat16)
    a = model.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=slots,
                         max_len=context + 1, dtype=torch.bfloat16, device="cuda")
    for slot in range(slots):
        cache.admit(slot, context + 1)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, a.vocab_size, (slots * context,), generator=gen).cuda()
    prefill(model, cache, prompt, [context] * slots, list(range(slots)))
    tokens = torch.randint(1, a.vocab_size, (slots,), generator=gen).cuda()
    return model, cache, tokens


def decode_cases(runners: dict, tokens, batches, context: int) -> dict:
    """``(batch, name) -> call``: each runner's decode step of the first ``batch``
    requests, every one at position ``context``."""
    return {(b, name): (lambda r=r, b=b: r(tokens[:b], positions=[context] * b,
                                           slots=list(range(b))))
            for b in batches for name, r in runners.items()}


def captured_under(model, cache, batches, module, attr: str, values: dict) -> dict:
    """Full decode runners of ``model`` over ``cache`` at ``batches``, one per (name, PDL
    on or off), each captured with ``module.attr`` set to ``values[name]`` (put back
    after each capture)."""
    shipped = getattr(module, attr)
    runners = {}
    for name, value in values.items():
        for pdl in (True, False):
            setattr(module, attr, value)
            try:
                with programmatic_launch(pdl):
                    runners[name, pdl] = graphcap.capture(
                        model, "full", buckets=list(batches), inputs=DecodeInputs(cache))
            finally:
                setattr(module, attr, shipped)
    return runners


def timed_batch1(runners: dict, tokens, context: int) -> tuple[dict, dict]:
    """Each runner's batch-1 decode call (request 0 at position ``context``) and their
    times, interleaved: ``(cases, times)`` keyed as ``runners``."""
    cases = {key: (lambda r=r: r(tokens[:1], positions=[context], slots=[0]))
             for key, r in runners.items()}
    return cases, time_interleaved(cases, reps=50, rounds=5)



def policy_rows(preset: str, model, cases: dict, times: dict, context: int,
                top: int = 5) -> list:
    """One row per ``(policy, pdl)`` batch-1 case: its median time, the step's floor, its
    logits' largest difference from ``("today", True)``'s, and the profiler's kernels and
    GPU idle share; each printed with its ``top`` kernels."""
    from graphcap.bench.decode import profile_steps, step_bytes
    from graphcap.bench.decode_attention import PEAK_BYTES_PER_S

    want = cases["today", True]().float()
    rows = []
    for (name, pdl), call in cases.items():
        prof = profile_steps(call)
        rows.append({"policy": name, "pdl": pdl, "ms": times[name, pdl]["median_ms"],
                     "floor_ms": round(step_bytes(model, 1, context + 1)
                                       / PEAK_BYTES_PER_S * 1e3, 4),
                     "max_logit_diff_vs_today": float((call().float() - want).abs().max()),
                     **prof})
        print(f"{preset} {name:>20} pdl={pdl!s:>5}: {rows[-1]['ms']:.4f} ms, "
              f"{prof.get('kernels')} kernels, idle {prof.get('idle_share')}, diff "
              f"{rows[-1]['max_logit_diff_vs_today']:.3g}", flush=True)
        for k in prof.get("top_kernels", [])[:top]:
            print(f"      {k['kernel'][:60]:60} {k['launches']:5.0f} {k['us']:9.1f} us")
    return rows
