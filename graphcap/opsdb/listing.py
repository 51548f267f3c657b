"""What ``graphcap ops`` prints: every op, its kernels (available or why not), its fake
(given or derived), and whether it is capturable and a split point."""

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


def render(device: torch.device | str, as_json: bool = False) -> str:
    rows = describe(device)
    if as_json:
        return json.dumps({"device": str(device), "ops": rows}, indent=2)
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
    return "\n".join(lines)
