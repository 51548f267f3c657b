"""``graphcap bench ops``: the project's Triton kernels against FlashInfer and FA4.

Targets (issue: opsdb): Triton rms_norm and silu_and_mul within 1.3x of FlashInfer's
time; Triton attention within 2x of FA4 and FlashInfer at 512, 2048 and 8192 tokens.
Arms of one case run interleaved, so machine drift hits them alike. Each figure is
kernel time: 20 calls captured in one CUDA graph, replayed, divided by 20.
"""

from __future__ import annotations

import datetime
import json
import math

import torch

import graphcap.opsdb  # noqa: F401  (registers the ops)
from graphcap.bench.common import commit
from graphcap.bench.timing import graphed_ms
from graphcap.core.context import forward_context
from graphcap.opsdb import get_op
from graphcap.opsdb.attention import BACKENDS

DTYPE = torch.bfloat16


def _interleaved(arms: dict, rounds: int = 3) -> dict[str, float]:
    """Kernel time per call of each arm (CUDA-graph replays), median over rounds."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(rounds):
        for name, fn in arms.items():
            samples[name].append(graphed_ms(fn))
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def _elementwise_cases(dev):
    rows = []
    for tokens in (16, 128, 512, 2048, 8192):
        for hidden in (1024, 4096):
            x = torch.randn(tokens, hidden, device=dev, dtype=DTYPE)
            w = torch.randn(hidden, device=dev, dtype=DTYPE)
            gate = torch.randn(tokens, 2 * hidden, device=dev, dtype=DTYPE)
            for op, args in (("rms_norm", (x, w, 1e-6)), ("silu_and_mul", (gate,))):
                spec = get_op(op)
                ok = [b for b, why in spec.backends(dev).items() if why is None]
                arms = {b: (lambda b=b, a=args, s=spec: s(*a, backend=b)) for b in ok}
                times = _interleaved(arms)
                rows.append({"op": op, "tokens": tokens, "hidden": hidden, "ms": times})
    return rows


def _attention_cases(dev):
    rows = []
    hq, hk, d = 16, 8, 128
    scale = 1 / math.sqrt(d)
    for tokens in (512, 2048, 8192):
        q = torch.randn(tokens, hq, d, device=dev, dtype=DTYPE)
        k, v = (torch.randn(tokens, hk, d, device=dev, dtype=DTYPE) for _ in range(2))
        out = torch.empty_like(q)
        arms = {}
        for name in ("triton", "flashinfer", "flash_attn"):
            backend = BACKENDS[name]()
            if backend.unavailable(dev):
                continue
            if name == "flashinfer":
                backend.configure(hq, hk, d, DTYPE)
            meta = backend.metadata(tokens, 1, dev).update([tokens])

            def call(m=meta, tensors=(q, k, v, out)):
                with forward_context(attention=m):
                    torch.ops.graphcap.attention(*tensors, scale)

            call()
            arms[name] = call
        rows.append({"op": "attention", "tokens": tokens, "heads": [hq, hk, d],
                     "ms": _interleaved(arms)})
    return rows


def _verdicts(rows):
    out = []
    for row in rows:
        ms = row["ms"]
        if "triton" not in ms:
            continue
        limit = 2.0 if row["op"] == "attention" else 1.3
        for peer in ("flashinfer", "flash_attn"):
            if peer in ms:
                ratio = ms["triton"] / ms[peer]
                out.append({"op": row["op"], "tokens": row["tokens"],
                            "hidden": row.get("hidden"), "vs": peer,
                            "triton_over_peer": round(ratio, 3), "limit": limit,
                            "met": ratio <= limit})
    return out


def run(out_path: str | None = None) -> dict:
    dev = torch.device("cuda")
    rows = _elementwise_cases(dev) + _attention_cases(dev)
    result = {
        "what": "graphcap bench ops", "date": datetime.date.today().isoformat(),
        "commit": commit(), "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__, "dtype": str(DTYPE), "cases": rows,
        "targets": _verdicts(rows),
    }
    text = json.dumps(result, indent=1)
    if out_path:
        with open(out_path, "w") as f:
            f.write(text)
    for t in result["targets"]:
        print(f"{t['op']:>13} T={t['tokens']:>5} H={t['hidden']}: triton/{t['vs']} = "
              f"{t['triton_over_peer']:.2f} (limit {t['limit']}) {'ok' if t['met'] else 'MISS'}")
    return result
