"""What the bench's tests share: a prefill result's row, torch seeing a GPU."""

from __future__ import annotations

import torch


def row(n, **ms):
    """A prefill result's row: ``n`` tokens, each arm's ms."""
    return {"tokens": n, "ms": ms}


def fake_gpu(monkeypatch):
    """torch seeing one H100 (for the command line's checks and the run's record)."""
    from graphcap.bench import common

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(common, "_pdl", lambda: True)
