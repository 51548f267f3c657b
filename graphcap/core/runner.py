"""The runner: one class for every strategy and every kind of input. It owns the capture
shapes (one :class:`ShapeEntry` each), the static output buffers, padding a live batch
into its bucket, slicing outputs, eager fallback and its counters; a strategy decides how
each shape is captured (:mod:`graphcap.core.strategy`), an inputs object what the model's
arguments are (:mod:`graphcap.core.inputs`).

A runner serves one call at a time (calls from several threads are serialised), and checks
on every call that the model is the one it captured (:mod:`graphcap.core.snapshot`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcap.core.breaks import changed_by_a_break
from graphcap.core.buckets import pick_bucket
from graphcap.core.fixes import AGAIN, FIXES
from graphcap.core.graphs import new_pool
from graphcap.core.inputs import Batch, Inputs
from graphcap.core.outputs import check_outputs
from graphcap.core.runner_config import RunnerConfig
from graphcap.core.serial import Serial
from graphcap.core.snapshot import ModelSnapshot, held_tensors, settled
from graphcap.core.stats import CountFailures, Stats, report_of
from graphcap.core.strategy import Strategy
from graphcap.errors import (
    BadBatch,
    CaptureError,
    GraphcapError,
    ModelChanged,
    UnsupportedStrategy,
)

log = logging.getLogger("graphcap")


@dataclass
class ShapeEntry:
    """One captured shape: its bucket, the inputs' state of it (prefill: its attention
    metadata, which only this shape's replays rewrite), and its strategy's capture."""

    bucket: int
    state: Any
    replay: Callable[[], None]
    segments: int = 1
    breaks: int = 0
    splits_in_graph: int = 0
    # The model's tensors as this shape's capture began, which its graph may read: held,
    # so that one replaced as later shapes build (a lazy mask) is never freed under it.
    kept: tuple = ()


class Runner:
    """Callable like the model: pads to a bucket, replays (or runs eagerly), slices."""

    def __init__(self, model, strategy: Strategy, config: RunnerConfig, inputs: Inputs,
                 source: torch.nn.Module | None = None):
        self.model, self.strategy, self.config, self.inputs = model, strategy, config, inputs
        self.device = inputs.device
        # The module whose tensors the graphs read (``model`` unless a compiled wrapper).
        self.source = source if source is not None else model
        self.pool = new_pool(self.device)
        self.stats = Stats()
        self.entries: dict[int, ShapeEntry] = {}
        self._outputs: list[torch.Tensor] = []  # max-size static outputs, shared by shapes
        self._out_spec = None
        self._serial = Serial(self.device)
        self._snapshot: ModelSnapshot | None = None
        self._devices: set[torch.device] = set()

    @property
    def max_tokens(self) -> int:
        return self.config.buckets[-1]

    # -- calls ---------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        with self._serial.only("a call of the runner"):
            self._serial.order()
            start = time.perf_counter()  # after the lock: another call's wait is not ours
            stale = self._snapshot is not None and not self._snapshot.current()  # None: uncaptured
            kept = self.inputs.forget() if stale and self.config.on_change == "recapture" \
                else None  # a changed model of tensors may take other shapes
            try:
                return self._call(start, stale, args, kwargs)
            except BaseException:  # refused before a recapture: the shapes its graphs take
                if kept is not None and self.entries:
                    self.inputs.remember(kept)
                raise

    def _call(self, start: float, stale: bool, args, kwargs):
        batch = self._agreed(self.inputs.check, args, kwargs)  # before anything runs
        self.stats.calls += 1
        with CountFailures(self.stats):
            if stale:  # a split model's ranks: all refuse, or agree in _on_change
                self._on_change(batch, self._agreed(self._check_change))
                start = time.perf_counter()  # a replay's host time, not the capture's
            elif self.strategy.captures and not self.entries:
                self._capture_all(batch, None)  # on the first call (tensors)
                start = time.perf_counter()
            entry, reason = self._agreed(self._route, batch)
            if (ranks := self.config.ranks) is not None:  # one graph, or one batch
                route = f"replay {entry.bucket}" if entry else f"eager ({reason})"
                ranks.agree(f"{route}: {self.inputs.describe(batch)}", "a call of the runner")
            with self._together("a call of the runner"):
                try:
                    out = self._replay(entry, batch) if entry else self._eager(batch, reason)
                    if entry is not None:
                        self.stats.replay_host_s += time.perf_counter() - start
                    self.inputs.commit(batch)  # it ran; a Ctrl-C before it is whole: none
                except BaseException:  # the model may have run in part
                    self.inputs.abandon(batch)
                    raise
            return out

    def _agreed(self, check, *args):
        """``check(*args)``, which may refuse the call (a ``GraphcapError``); a refusing rank
        of a split model tells the others, so that every rank raises (none waits in vain)."""
        try:
            return check(*args)
        except GraphcapError as exc:
            if self.config.ranks is not None:
                self.config.ranks.agree(f"refused ({type(exc).__name__}: {exc})",
                                        "a call of the runner")
            raise

    def _together(self, what: str):
        """Where a split model's ranks run collectives together (a no-op unsplit)."""
        ranks = self.config.ranks
        return contextlib.nullcontext() if ranks is None else ranks.together(what)

    def _route(self, batch: Batch) -> tuple[ShapeEntry | None, str]:
        """Replay a shape, run eagerly, or refuse, and why (one reason per branch)."""
        if not self.strategy.captures:
            return None, "eager"  # the eager strategy: no graphs at all
        bucket, reason = None, self.inputs.fits(batch)  # more requests than slots
        if reason is None:  # past the largest bucket, or padded more than twice over
            bucket, reason = pick_bucket(batch.tokens, self.config.buckets,
                                         self.config.max_pad_ratio)
        if bucket is not None:
            return self.entries[bucket], "replay"
        if not self.config.fallback:
            raise BadBatch(f"{self._why_eager(reason, batch)} and fallback=False; "
                           f"{FIXES[reason]} or allow the eager fallback")
        return None, reason  # a counted fallback

    def _why_eager(self, reason: str, batch: Batch) -> str:
        pad = f"; its bucket is over {self.config.max_pad_ratio:g}x that" * (reason == "padding")
        return (f"a batch of {batch.tokens} token{'s' * (batch.tokens != 1)} cannot replay a "
                f"graph ({reason.replace('_', ' ')}: buckets up to {self.max_tokens} tokens"
                f"{self.inputs.limits()}{pad})")

    def _replay(self, entry: ShapeEntry, batch: Batch):
        # Host time here is what the GPU waits for: one staged copy, the rest in the graph.
        with torch.inference_mode():
            self.inputs.stage(batch, entry.bucket, entry.state)
            if entry.breaks:  # Python runs between graphs: in the shape's forward context
                with self.inputs.context(entry.state):
                    entry.replay()
                if not (self.strategy.debug or self._snapshot.current()):
                    raise changed_by_a_break(self._snapshot, self.config.on_change)
            else:
                entry.replay()
        rows = self.inputs.out_rows(batch)
        # Copied outside inference mode (ordinary tensors); narrow_copy: a clone, one op.
        outs = [buf.narrow_copy(0, 0, rows) if self.config.copy_outputs else buf[:rows]
                for buf in self._outputs]
        self.stats.replays[entry.bucket] += 1  # once it returns (else a failure only)
        return tree_unflatten(outs, self._out_spec)

    def _eager(self, batch: Batch, reason: str):
        """Run the model without graphs: the eager strategy, or a counted fallback."""
        run = self.inputs.eager(self.model, batch)
        if reason == "eager":
            with torch.no_grad():
                return run()
        # A fallback runs in inference mode, as capture did (a compiled forward traced in it
        # would recompile under no_grad, capturing in fallbacks); outputs cloned outside it.
        with torch.inference_mode():
            out = run()
        flat, spec = tree_flatten(out)
        outs = [t.clone() if isinstance(t, torch.Tensor) else t for t in flat]
        self.stats.fallbacks[reason] += 1  # once it returns (one that raised is a failure)
        if self.stats.fallbacks[reason] == 1 and self.config.tell_fallbacks:  # once a reason
            log.warning("graphcap: a call ran eagerly: %s; later ones are only counted "
                        "(report()['fallbacks']): %s to replay them",
                        self._why_eager(reason, batch), FIXES[reason])
        return tree_unflatten(outs, spec)

    def _check_change(self) -> str:
        """The model is not the one captured: what changed, or ``ModelChanged`` where it
        moved to another device or the runner refuses changes (``on_change="error"``)."""
        changes = self._snapshot.changes()
        name, what = type(self.source).__name__, "; ".join(changes)
        devices = self._snapshot.devices()
        if devices != self._devices:
            raise ModelChanged(
                f"{name} moved from {sorted(map(str, self._devices))} to "
                f"{sorted(map(str, devices))} since capture ({what}): a runner's buffers and "
                "graphs live on one device; capture the model again there with "
                "graphcap.capture", changes)
        if self.config.on_change == "error":
            raise ModelChanged(
                f"{name} changed since capture ({what}), and its graphs read the tensors of "
                "capture: call runner.recapture() to capture the model as it is now (one "
                "that takes inputs of other dtypes now: runner.capture_all(example)), or "
                "update weights in place (with torch.no_grad(): p.copy_(new)), which replays "
                "see (or capture with on_change='recapture')", changes)
        return what

    def _on_change(self, batch: Batch, what: str) -> None:
        """The model is not the one captured (``what`` changed; :meth:`_check_change` let
        it pass): capture it again, from this call's shapes for inputs that take them."""
        if self.config.ranks is not None:  # every rank's changed alike, or all raise
            self.config.ranks.agree_change(type(self.source).__name__, what)
        log.warning("graphcap: %s changed since capture (%s); capturing its %d shapes again",
                    type(self.source).__name__, what, len(self.config.buckets))
        self.stats.recaptures += 1  # one that fails too: the next call's capture is its own
        self._capture_all(batch, None)  # shapes taken from this call, where inputs take any

    # -- capture -------------------------------------------------------------------
    def capture_all(self, example: tuple | None = None, progress=None) -> None:
        """Capture every bucket, largest first (its memory is then reused by the rest);
        ``example``: arguments of a call, for inputs whose buffers take their shapes from
        one; ``progress(done, total)`` is called after each shape. Called again, it
        captures every shape again from scratch (the first shape warmed up again), of
        the dtypes and shapes of ``example`` where given (a model cast to another dtype)."""
        with self._serial.only("capture_all()"):
            self._captures("capture_all()")
            batch = None if example is None else self._agreed(self.inputs.check_example, example)
            self._capture_all(batch, progress)

    def recapture(self) -> None:
        """Capture every shape again from the model as it is now: after a change the
        runner cannot see (a Python attribute its forward reads), or to pick up a changed
        one before the next call does."""
        with self._serial.only("recapture()"):
            self._captures("recapture()")
            if not self.entries and self.inputs.needs_batch:
                raise CaptureError(
                    "recapture(): this runner has captured nothing yet; it captures on its "
                    "first call, from that call's shapes")
            self._capture_all(None, None)

    def _captures(self, what: str) -> None:
        if not self.strategy.captures:
            raise UnsupportedStrategy(f"{what}: strategy {self.strategy.name!r} captures "
                                      "nothing (every call runs the model eagerly)")
        self._serial.order()

    def _capture_all(self, batch: Batch | None, progress) -> None:
        ranks = self.config.ranks
        if ranks is not None:  # the same shapes, from batches of the same shapes
            ranks.agree(f"capture {self.config.buckets}" + (
                f": {self.inputs.describe(batch)}" if batch is not None else ""), "a capture")
        # An earlier capture held, of inputs whose dtypes and shapes a call gave: its own.
        again = self._snapshot is not None and self.inputs.needs_batch
        self._reset()
        # State derived from the parameters (fused weights) updated outside any graph.
        before = getattr(self.source, "graphcap_before_capture", None)
        try:  # a rank failing in the set-up (out of memory) stops the others too
            with self._together("a capture"):
                if before is not None:
                    with torch.inference_mode():
                        before()
                self.inputs.allocate(self.max_tokens, batch)  # no inference tensors
                with torch.inference_mode():
                    for done, bucket in enumerate(reversed(self.config.buckets), 1):
                        self._capture_one(bucket, first=done == 1)
                        if progress is not None:
                            progress(done, len(self.config.buckets))
            self.pool.release_cache()  # what later warm-ups left outside the pool
            if ranks is not None:  # a rank that failed after its last collective says so
                ranks.agree("captured", "the end of a capture")
        except BaseException as exc:
            # No half-built state, nor shapes of a call not captured: a later call starts over.
            self._reset()
            self.inputs.forget()
            if again and batch is None and isinstance(exc, Exception):
                exc.add_note(AGAIN)
            raise
        # The model as the graphs read it: after its warm-ups (lazy modules materialise,
        # a forward may replace a buffer on first sight of the largest shape).
        self._snapshot = ModelSnapshot(self.source)
        self._devices = self._snapshot.devices()
        self.inputs.captured([e.state for e in self.entries.values()])

    def _reset(self) -> None:
        """No captured shape, no static buffers (the inputs keep the shapes they took)."""
        self.entries.clear()
        self._outputs, self._out_spec, self._snapshot = [], None, None
        self.inputs.reset()

    def _captured_fn(self, bucket: int, state):
        # The capture keeps it (an eager re-run, a debug break): the runner weakly, or it
        # and its captures would form a cycle only a gc pass frees, graphs and pool with it.
        # A partial, not a closure: each frame of a failed capture's traceback keeps its
        # function, and a closure its state (a cache), past clearing the frames' locals.
        return partial(Runner._run_captured, weakref.ref(self), bucket, state)

    @staticmethod
    def _run_captured(runner: weakref.ref, bucket: int, state) -> list:
        self = runner()
        rows = self.inputs.rows(bucket)
        self.inputs.derive(state)
        flat, spec = tree_flatten(self.inputs.forward(self.model, bucket, state))
        check_outputs(flat, bucket, self.inputs, self._outputs)
        if self._out_spec is not None and spec != self._out_spec:
            raise UnsupportedStrategy(
                f"the model returned {spec} for {bucket} tokens but {self._out_spec} "
                "for the first shape: a captured model must return outputs of one "
                "structure for every shape")
        self._out_spec = spec
        for buf, out in zip(self._outputs, flat, strict=True):
            buf[:rows].copy_(out)
        return [buf[:rows] for buf in self._outputs]

    def _capture_one(self, bucket: int, first: bool) -> None:
        state = self.inputs.prepare(bucket)
        direct_failure = None
        # A split model warms every shape up: a direct capture that failed would be warmed
        # and retried on that rank alone, its collectives out of step with the others'.
        if not (first or self.config.warmup == "every" or self.strategy.warms_every_shape
                or self.config.ranks is not None):
            try:
                self._capture_timed(bucket, state)
                return
            except UnsupportedStrategy:
                raise  # the model's outputs do not fit a graph: no warm-up changes that
            except Exception as exc:
                # Something this shape runs first cannot run under capture (a library's
                # lazy set-up; a module load a driver refuses during capture): warm it up
                # eagerly, and capture again. An error of the model recurs there: raised.
                self.stats.warmup_retries += 1
                # Its words only: its traceback would keep the failed graphs until gc runs.
                direct_failure = f"{type(exc).__name__}: {exc}"
        try:
            self._warm_up(bucket, state, sizes=first and self.strategy.sizes_pool)
            self._capture_timed(bucket, state)
        except Exception as exc:
            if direct_failure is not None:
                exc.add_note(f"graphcap: the direct capture of {bucket} tokens before this "
                             f"warm-up had failed with {direct_failure}")
            raise

    def _warm_up(self, bucket: int, state, sizes: bool = False) -> None:
        start = time.perf_counter()
        with self.pool.warmup(sizes=sizes), self.strategy.watch(bucket):
            out, runs = settled(self.source, f"the warm-up of {bucket} tokens",
                                partial(self.inputs.forward, self.model, bucket, state),
                                self.config.ranks and self.config.ranks.gather)
            flat, _ = tree_flatten(out)
            check_outputs(flat, bucket, self.inputs, self._outputs)
            outs = [(o.shape[1:], o.dtype, o.device) for o in flat]
            # Freed before the warm-up ends: a sizing warm-up counts them as transient,
            # as the capture, which copies them into the static outputs, frees them.
            del flat, out
        if not self._outputs:
            rows = self.inputs.rows(self.max_tokens)
            self._outputs = [torch.empty((rows, *tail), dtype=dtype, device=device)
                             for tail, dtype, device in outs]
        self.stats.warmups += runs
        self.stats.warmup_s += time.perf_counter() - start

    def _capture_timed(self, bucket: int, state) -> None:
        # What the model holds as the graph begins (its warm-up's tensors included); those
        # it makes inside the capture are the graph's own, remade by every replay.
        kept = tuple(held_tensors(self.source))
        start = time.perf_counter()
        try:
            captured = self.strategy.capture(self._captured_fn(bucket, state), bucket,
                                             self.pool)
        finally:
            self.stats.capture_s += time.perf_counter() - start
        self.entries[bucket] = ShapeEntry(bucket, state, **vars(captured), kept=kept)
        if self.stats.first_shape_s is None:
            self.stats.first_shape_s = self.stats.warmup_s + self.stats.capture_s

    # -- report --------------------------------------------------------------------
    def report(self) -> dict:
        """The strategy (``debug``: its debug mode, which captures nothing); shapes; per shape the
        graphs replayed (``segments``), the functions run eagerly between them (``breaks``), the
        split ops captured in a graph (``splits_in_graph``); graph memory, build seconds, counters;
        ``warmups``: eager warm-up forwards before captures (a warm-up that made a parameter or
        buffer counts twice: it ran again), ``warmup_retries``: shapes whose direct capture failed
        and were warmed up and captured again; what the inputs report (prefill: ``attention``, the
        backend the captured forward called, None if none); ``host_us_per_replay``: the mean host
        time of a replayed call, from the lock to the graph's launch."""
        with self._serial.held():
            return report_of(self)
