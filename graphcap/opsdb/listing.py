"""What ``graphcap ops`` prints: every op, its kernels (available or why not), its fake
(given or derived), and whether it is capturable and a split point; and every attention
backend, whether it runs here and under which strategies."""

from __future__ import annotations

import json

import torch

from graphcap.opsdb.spec import REGISTRY


def describe(device: torch.device | str) -> list[dict]:
    rows = []
    for qualname in sorted(REGISTRY):
        spec = REGISTRY[qualname]
        rows.append({
            "op": qualname,
            "schema": spec.schema,
            "kernels": {b: ("available" if why is None else why)
                        for b, why in spec.available(device).items()},
            "fake": "derived" if spec.fake_derived else "given",
            "capturable": spec.capturable,
            "split": spec.split,
            "doc": spec.doc,
        })
    return rows


def attention_backends(device: torch.device | str) -> list[dict]:
    """Every attention backend, prefill's and then decode's (attention over the paged
    cache): whether it runs here (or why not), whether its metadata is static (it runs
    under full capture, and inside breakable and tc_piecewise graphs), and which per-layer
    options it computes (a sliding window, soft-capped scores, sinks)."""
    from graphcap.opsdb.attention import BACKENDS, DECODE_BACKENDS
    from graphcap.opsdb.attention.variant import OPTIONS

    rows = []
    for name, cls in BACKENDS.items():
        backend = cls()
        why = backend.unavailable(device)
        rows.append({"backend": name, "kind": "prefill", "available": why is None,
                     "why_not": why, "static_metadata": cls.static_metadata,
                     "dtypes": [str(d).removeprefix("torch.") for d in cls.dtypes],
                     "options": [o for o in OPTIONS if o in backend.options]})
    for name, cls in DECODE_BACKENDS.items():
        rows.append({"backend": name, "kind": "decode", "available": None,
                     "why_not": "checked against a cache (get_backend(kind='decode'))",
                     "static_metadata": True, "dtypes": [],
                     "options": [o for o in OPTIONS if o in cls.options]})
    return rows


def render(device: torch.device | str, as_json: bool = False) -> str:
    rows, attention = describe(device), attention_backends(device)
    if as_json:
        return json.dumps({"device": str(device), "ops": rows, "attention": attention},
                          indent=2)
    lines = [f"opsdb on {device}: {len(rows)} ops", ""]
    for row in rows:
        ok = [b for b, s in row["kernels"].items() if s == "available"]
        lines.append(f"{row['op']}  fake={row['fake']}  capturable={row['capturable']}  "
                     f"split={row['split']}")
        lines.append(f"    {row['doc']}")
        lines.append(f"    available: {', '.join(ok) or 'none'}")
        for b, s in row["kernels"].items():
            if s != "available":
                lines.append(f"    {b}: {s}")
    lines += ["", f"attention backends on {device}:"]
    for row in attention:
        options = f"options: {', '.join(row['options']) or 'none'}"
        if row["kind"] == "decode":
            lines.append(f"    {row['backend']} (decode, over the paged cache): {options}")
            continue
        where = "runs here" if row["available"] else row["why_not"]
        static = "static metadata: every strategy" if row["static_metadata"] else (
            "host lengths: not under full")
        lines.append(f"    {row['backend']}: {where}; {static}; {', '.join(row['dtypes'])}; "
                     f"{options}")
    return "\n".join(lines)
