"""A decode step's q/k-norm and rotary inside the attention kernel, against the q/k/v
kernel before it (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_rope.py [preset...]

Full runners of ``DecodeInputs`` (context 1024, batches 1, 8 and 64) on one model and
cache: ``one kernel`` with the default backend's ``rotates`` on while it captures
(``graphcap::qkv_cached_attention`` runs the decode attention kernel on the projection's
rows), ``key late`` the same with the own key's and value's work after the loop over the
cache (``KEY_LATE``), ``two kernels`` as the library captures it (``rotates`` off:
``graphcap::qkv_norm_rope``, then the attention kernel). Calls timed interleaved;
kernels a step and the GPU's idle share from the profiler (PDL on, as shipped); logits
of each against ``two kernels``; the registers and spills of every decode kernel
compiled. JSON in $OUT/decode-rope.json."""

import functools
import json
import os
import sys

import torch
from probe_common import decode_cases, prefilled_decode

import graphcap
from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.attention.paged import OpsdbDecode
from graphcap.opsdb.triton import decode

CONTEXT, BATCHES = 1024, (1, 8, 64)
VARIANTS = {"one kernel": (True, False), "key late": (True, True),
            "two kernels": (False, False)}
LATE = [False]


class _Late:
    """``_decode_kernel`` launched with ``KEY_LATE`` as :data:`LATE` says."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *a, **k: launch(*a, KEY_LATE=LATE[0], **k)


KERNEL = decode._decode_kernel
decode._decode_kernel = _Late(KERNEL)


def variant(name: str, call):
    """``call`` under variant ``name``'s settings (captures, and calls that may capture)."""
    rotates, late = VARIANTS[name]

    def run():
        shipped = OpsdbDecode.rotates
        OpsdbDecode.rotates, LATE[0] = rotates, late
        try:
            return call()
        finally:
            OpsdbDecode.rotates, LATE[0] = shipped, False
    return run


def registers() -> list:
    try:
        return _registers()
    except Exception as exc:  # what this Triton keeps differs by version
        return [{"error": repr(exc)}]


def _registers() -> list:
    out = []
    for cache in KERNEL.device_caches.values():
        for compiled in cache[0].values():
            consts = getattr(getattr(compiled, "src", None), "constants", {})
            out.append({"n_regs": getattr(compiled, "n_regs", None),
                        "n_spills": getattr(compiled, "n_spills", None),
                        "constants": {str(k): str(v) for k, v in dict(consts).items()}})
    return out


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    # graphcap.capture captures every bucket before it returns: each under its variant.
    runners = {}
    for name in VARIANTS:
        capture = functools.partial(graphcap.capture, model, "full", buckets=list(BATCHES),
                                    inputs=DecodeInputs(cache))
        runners[name] = variant(name, capture)()
    cases = {key: variant(key[1], call)
             for key, call in decode_cases(runners, tokens, BATCHES, CONTEXT).items()}
    times = time_interleaved(cases, reps=60, rounds=6)
    rows = []
    for b in BATCHES:
        want = cases[b, "two kernels"]().float()
        base = times[b, "two kernels"]["median_ms"]
        for name in runners:
            ms = times[b, name]["median_ms"]
            profile = profile_steps(cases[b, name])
            rows.append({"batch": b, "variant": name, "ms": ms,
                         "vs_two_kernels": round(ms / base, 4),
                         "kernels": profile["kernels"],
                         "idle_share": profile.get("idle_share"),
                         "max_logit_diff": float((cases[b, name]().float() - want)
                                                 .abs().max())})
            print(f"{preset} b={b} {name:>11}: {ms:.4f} ms ({rows[-1]['vs_two_kernels']:.3f}x"
                  f"), {profile['kernels']} kernels, diff {rows[-1]['max_logit_diff']:.3g}",
                  flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


def main(presets) -> dict:
    models = [one(p) for p in presets]
    regs = registers()
    for r in regs:
        print(r, flush=True)
    return {"models": models, "decode_kernels": regs}


if __name__ == "__main__":
    out = {"what": "decode step: rotary in the attention kernel against the q/k/v kernel",
           **environment(), "context": CONTEXT,
           **main(sys.argv[1:] or ["qwen3-0.6b"])}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-rope.json"), "w") as f:
        json.dump(out, f, indent=1)
