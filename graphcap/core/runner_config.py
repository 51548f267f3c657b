"""The options of a :class:`graphcap.core.runner.Runner` (``graphcap.capture`` makes them
from a :class:`graphcap.config.CaptureConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RunnerConfig:
    buckets: list[int]
    fallback: bool = True
    copy_outputs: bool = True
    max_pad_ratio: float = 2.0
    # "first": an eager warm-up forward before the first (largest) shape's capture only;
    # later shapes are captured directly, and one whose capture fails is warmed up and
    # captured again. "every": a warm-up before every capture (a strategy whose warm-ups
    # compile, tc_piecewise, warms every shape either way).
    warmup: str = "first"
    # A model changed since capture: "recapture" (every shape, at that call) or "error".
    on_change: str = "recapture"
    # A model split across ranks: its graphcap.tp.TPGroup. agree(key, what) returns when
    # every rank passed the same key (a capture's shapes, a call's route and batch, a
    # refusal; agree_change: a changed model), else raises on every rank; together(what)
    # wraps the ranks' collectives, so that a rank raising there stops the others at once.
    ranks: Any = None
    # The first fallback of each reason a warning naming what lets it replay; False where
    # fallbacks are asked for (graphcap.testing's replay check draws them on purpose).
    tell_fallbacks: bool = True
