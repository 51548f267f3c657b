"""Whether decode attention's deep tiles speed up a whole decode step (device side):

    PYTHONPATH=. python3 docs/notes/probes/decode_attention_ab.py [preset...]

Alone the deep tiles (:data:`graphcap.opsdb.triton.decode_grid.DEEP`: two key/value buffers,
one program an SM, split to fill the SMs once) read qwen3-0.6b's K/V at batch 8 in 14.5
us against 16.2, yet the bench's step profile gave the kernel 17.0 us a launch at batch 8
(under PDL a kernel's time counts its wait). A full runner of ``DecodeInputs`` (context
1024, batches 1, 8, 16) captured with today's tiles and with the 3-stage tiles before
them, each with PDL on and off; calls timed interleaved, each step's kernels profiled
(their durations clean in the PDL-off runners only). JSON in
$OUT/decode-attention-ab.json."""

import json
import os
import sys

import torch
from probe_common import captured_under, prefilled_decode

from graphcap.bench.common import environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.opsdb.triton import decode
from graphcap.opsdb.triton.decode_grid import splits_for

CONTEXT, BATCHES = 1024, (1, 8, 16)
TODAY = decode.tiles_for


def shallow(programs: int, max_len: int, sms: int, shared: int, row_bytes: int = 256):
    """The tiles before the deep ones: one key/value buffer whatever the stages."""
    cfg = ({"BLOCK_N": 128, "num_warps": 4, "num_stages": 3} if programs < sms else
           {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2})
    return cfg, splits_for(programs, max_len, cfg["BLOCK_N"], sms)


def one(preset: str) -> dict:
    model, cache, tokens = prefilled_decode(preset, max(BATCHES), CONTEXT)
    runners = captured_under(model, cache, BATCHES, decode, "tiles_for",
                             {"deep": TODAY, "shallow": shallow})
    cases = {(b, *key): (lambda r=r, b=b: r(tokens[:b], positions=[CONTEXT] * b,
                                            slots=list(range(b))))
             for b in BATCHES for key, r in runners.items()}
    times = time_interleaved(cases, reps=50, rounds=5)
    rows = []
    for b in BATCHES:
        want = cases[b, "shallow", False]().float()
        for name, pdl in runners:
            got = cases[b, name, pdl]().float()
            prof = profile_steps(cases[b, name, pdl])
            attention = [k for k in prof.get("top_kernels") or []
                         if k["kernel"] == "_decode_kernel"]
            rows.append({"batch": b, "tiles": name, "pdl": pdl,
                         "ms": times[b, name, pdl]["median_ms"],
                         "attention_us": round(attention[0]["us"] / attention[0]["launches"], 2)
                         if attention else None,
                         "max_logit_diff": float((got - want).abs().max()),
                         "kernels": prof.get("kernels"), "idle_share": prof.get("idle_share"),
                         "top_kernels": prof.get("top_kernels")})
            print(f"{preset} b={b} {name:>7} pdl={pdl!s:>5}: {rows[-1]['ms']:.4f} ms, "
                  f"attention {rows[-1]['attention_us']} us a layer, idle "
                  f"{rows[-1]['idle_share']}, diff {rows[-1]['max_logit_diff']:.3g}",
                  flush=True)
    del runners, cases, model, cache
    torch.cuda.empty_cache()
    return {"preset": preset, "rows": rows}


if __name__ == "__main__":
    presets = sys.argv[1:] or ["qwen3-0.6b"]
    out = {"what": "decode step: decode attention's deep tiles against the 3-stage ones, "
                   "PDL on and off, full runner", **environment(),
           "context": CONTEXT, "models": [one(p) for p in presets]}
    with open(os.path.join(os.environ.get("OUT", "."), "decode-attention-ab.json"), "w") as f:
        json.dump(out, f, indent=1)
