"""What a runner counts (:class:`Stats`) and reports (:func:`report_of`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class Stats:
    calls: int = 0
    replays: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    failed: int = 0  # calls that raised after their batch was accepted
    recaptures: int = 0  # captures of every shape again, after the model changed
    warmup_s: float = 0.0
    capture_s: float = 0.0
    warmups: int = 0  # eager warm-up forwards run before a capture
    warmup_retries: int = 0  # shapes whose direct capture failed, then warmed and captured
    first_shape_s: float | None = None  # warm-up and capture of the first (largest) shape
    replay_host_s: float = 0.0  # host time of replayed calls, from the lock to the launch


class CountFailures:
    """Counts a call that raises after it was accepted (``report()["failed"]``), so that
    every call is a replay, a fallback or a failure."""

    def __init__(self, stats: Stats):
        self.stats = stats

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.stats.failed += 1


def report_of(runner) -> dict:
    """``runner.report()``'s dict (``Runner.report`` says what each entry means)."""
    entries = sorted(runner.entries.items())
    return {
        "strategy": runner.strategy.name,
        "debug": runner.strategy.debug,
        "device": str(runner.device),
        "graph_kind": runner.pool.kind,
        "shapes": [k for k, _ in entries],
        "segments": {k: e.segments for k, e in entries},
        "breaks": {k: e.breaks for k, e in entries},
        "splits_in_graph": {k: e.splits_in_graph for k, e in entries},
        "graph_pool_bytes": runner.pool.bytes(),
        # The block the first warm-up sized the pool with (0: not sized, e.g. an
        # earlier, higher peak of the process hid the warm-up's; see GraphPool.warmup).
        "pool_sized_bytes": runner.pool.sized_bytes,
        "build_s": {"warmup": round(runner.stats.warmup_s, 4),
                    "capture": round(runner.stats.capture_s, 4),
                    "first_shape": round(runner.stats.first_shape_s or 0.0, 4)},
        "warmups": runner.stats.warmups,
        "warmup_retries": runner.stats.warmup_retries,
        "calls": runner.stats.calls,
        "replays": dict(runner.stats.replays),
        "fallbacks": dict(runner.stats.fallbacks),
        "failed": runner.stats.failed,
        "recaptures": runner.stats.recaptures,
        "host_us_per_replay": round(1e6 * runner.stats.replay_host_s
                                    / max(sum(runner.stats.replays.values()), 1), 1),
        **runner.inputs.report(),
    }
