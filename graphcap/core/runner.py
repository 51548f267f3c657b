"""The runner: one class for every strategy. It owns the capture shapes, the static input
and output buffers, the attention metadata, padding a live batch into its bucket, slicing
outputs, eager fallback and its counters; a backend decides how each shape is captured.

Two kinds of input, as the model declares them (``graphcap.capture(..., inputs=)``):

- ``prefill``: ``model(input_ids, positions)`` over requests packed along dim 0, called
  through the runner as ``runner(input_ids, positions, seq_lens=[...])``; attention reads
  the metadata the runner prepares (``graphcap.core.context``). A prefill model whose
  ``output_rows`` is ``"requests"`` (last-token logits) is called
  ``model(input_ids, positions, last_rows)`` and returns one row per request slot.
- ``tensors``: any module whose tensor arguments share dim 0 (the token dim), e.g. an
  MLP. Shapes are captured on the first call (or from ``example_inputs``).

A runner serves one call at a time (calls from several threads are serialised), and
checks on every call that the model is the one it captured (:mod:`graphcap.core.snapshot`).
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from graphcap.core import batch as batching
from graphcap.core.backend import CaptureBackend, Captured
from graphcap.core.buckets import pick_bucket
from graphcap.core.context import forward_context
from graphcap.core.graphs import new_pool
from graphcap.core.serial import Serial
from graphcap.core.snapshot import ModelSnapshot
from graphcap.errors import ModelChanged, UnsupportedModel, UnsupportedStrategy

log = logging.getLogger("graphcap")


@dataclass
class RunnerConfig:
    buckets: list[int]
    max_requests: int
    attention: object | None = None  # an AttentionBackend (prefill models)
    fallback: bool = True
    copy_outputs: bool = True
    max_pad_ratio: float = 2.0
    # "tokens": outputs have a row per token; "requests" (prefill models that return one
    # row per request, e.g. last-token logits): a row per request slot.
    output_rows: str = "tokens"
    # "first": an eager warm-up forward before the first (largest) shape's capture only;
    # later shapes are captured directly, and one whose capture fails is warmed up and
    # captured again. "every": a warm-up before every capture. A backend that watches
    # warm-ups (tc_piecewise compiles in them) warms every shape either way.
    warmup: str = "first"
    # A model changed since capture: "recapture" (every shape, at that call) or "error".
    on_change: str = "recapture"
    # Prefill: (vocab size, max positions) to check token ids and positions against on
    # every call (one host sync), or None.
    input_bounds: tuple[int, int | None] | None = None


@dataclass
class Stats:
    calls: int = 0
    replays: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    eager_replays: Counter = field(default_factory=Counter)  # captured state not current
    failed: int = 0  # calls that raised after their batch was accepted
    recaptures: int = 0  # captures of every shape again, after the model changed
    warmup_s: float = 0.0
    capture_s: float = 0.0
    warmups: int = 0  # eager warm-up forwards run before a capture
    warmup_retries: int = 0  # shapes whose direct capture failed, then warmed and captured
    first_shape_s: float | None = None  # warm-up and capture of the first (largest) shape


class _CountFailures:
    """Counts a call that raises after it was accepted (``report()["failed"]``), so that
    every call is a replay, a fallback, an eager replay or a failure."""

    def __init__(self, stats: Stats):
        self.stats = stats

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if kind is not None:
            self.stats.failed += 1


class Runner:
    """Callable like the model: pads to a bucket, replays (or runs eagerly), slices."""

    def __init__(self, model: torch.nn.Module, backend: CaptureBackend, config: RunnerConfig,
                 device: torch.device, kind: str, source: torch.nn.Module | None = None):
        self.model, self.backend, self.config = model, backend, config
        self.device, self.kind = device, kind
        # The module whose parameters and buffers the graphs read (``model`` unless that
        # is a compiled wrapper of it).
        self.source = source if source is not None else model
        self._serial = Serial(device)
        self._snapshot: ModelSnapshot | None = None
        self._devices: set[torch.device] = set()
        self._attends = False  # graphcap attention ran in the captured forward (prefill)
        self.pool = new_pool(device)
        self.stats = Stats()
        self.entries: dict[int, Captured] = {}
        self.metadata: dict[int, object] = {}
        self._inputs: list[torch.Tensor] = []  # max-size static inputs, sliced per bucket
        self._specs: list[tuple[torch.dtype, tuple[int, ...]]] = []
        self._out_spec = None
        self._outputs: list[torch.Tensor] = []  # max-size static outputs, shared by shapes
        self._last_rows: torch.Tensor | None = None  # output_rows="requests": [slots]
        # Per (live token count, bucket): the input buffers' rows it fills and its padding
        # rows (slicing a tensor costs host microseconds, which the GPU waits for).
        self._rows_of: dict[tuple[int, int], tuple[list, list]] = {}

    # -- capture -------------------------------------------------------------------
    @property
    def max_tokens(self) -> int:
        return self.config.buckets[-1]

    def capture_all(self, example_args: tuple | None = None, progress=None) -> None:
        """Capture every bucket, largest first (its memory is then reused by the rest);
        ``progress(done, total)`` is called after each one. Called again, it captures
        every shape again from scratch (new buffers, the first shape warmed up again)."""
        with self._serial:
            self._capture_all(example_args, progress)

    def recapture(self) -> None:
        """Capture every shape again from the model as it is now: after a change the
        runner cannot see (a Python attribute its forward reads), or to pick up a changed
        one before the next call does. A tensors runner not yet called has nothing to do."""
        with self._serial:
            if self.kind == "prefill":
                self._capture_all(None, None)
            elif self._specs:
                self._capture_all(tuple(torch.zeros((1, *tail), dtype=dtype)
                                        for dtype, tail in self._specs), None)

    def _capture_all(self, example_args, progress) -> None:
        self._reset()
        self._snapshot = ModelSnapshot(self.source)
        self._devices = self._snapshot.devices()
        if self.kind == "prefill":
            ids = torch.zeros(self.max_tokens, dtype=torch.long, device=self.device)
            self._inputs = [ids, torch.zeros_like(ids)]
            if self.config.output_rows == "requests":
                self._last_rows = torch.zeros(self.config.max_requests, dtype=torch.long,
                                              device=self.device)
        else:
            self._specs = [(a.dtype, tuple(a.shape[1:])) for a in example_args]
            self._inputs = [torch.zeros((self.max_tokens, *tail), dtype=dtype,
                                        device=self.device) for dtype, tail in self._specs]
        try:
            with torch.inference_mode():
                for done, tokens in enumerate(reversed(self.config.buckets), 1):
                    self._capture_one(tokens, first=done == 1)
                    if progress is not None:
                        progress(done, len(self.config.buckets))
            self.pool.release_cache()  # what later warm-ups left outside the pool
        except BaseException:
            self._reset()  # leave no half-built state: a later call captures from scratch
            raise
        self._attends = any(meta.attended for meta in self.metadata.values())

    def _reset(self) -> None:
        """No captured shape, no static buffers."""
        self._inputs, self._specs, self._outputs, self._out_spec = [], [], [], None
        self._last_rows = None
        self._rows_of.clear()
        self.entries.clear()
        self.metadata.clear()
        self._snapshot, self._attends = None, False

    def _forward(self, tokens: int):
        args = [buf[:tokens] for buf in self._inputs]
        if self._last_rows is not None:
            args.append(self._last_rows)
        if self.kind == "prefill":
            with forward_context(attention=self.metadata[tokens]):
                return self.model(*args)
        return self.model(*args)

    def _rows(self, tokens: int) -> int:
        """Output rows of a shape: its tokens, or its request slots."""
        return self.config.max_requests if self.config.output_rows == "requests" else tokens

    def _captured_fn(self, tokens: int):
        rows = self._rows(tokens)
        # The capture keeps fn (an eager re-run, a debug break): weakly, or the runner and
        # its captures would form a cycle that only a gc pass frees, graphs and pool with it.
        runner = weakref.ref(self)

        def fn():
            self = runner()
            if self.kind == "prefill":  # per-batch buffers derived on the device, in-graph
                meta = self.metadata[tokens]
                meta.derive()
                if self._last_rows is not None:
                    meta.last_token_rows(out=self._last_rows)
            flat, spec = tree_flatten(self._forward(tokens))
            self._check_outputs(flat, tokens)
            self._out_spec = spec
            for buf, out in zip(self._outputs, flat, strict=True):
                buf[:rows].copy_(out)
            return [buf[:rows] for buf in self._outputs]
        return fn

    def _capture_one(self, tokens: int, first: bool) -> None:
        if self.kind == "prefill":
            meta = self.config.attention.metadata(tokens, self.config.max_requests,
                                                  self.device)
            self.metadata[tokens] = meta.update([tokens])
            if self._last_rows is not None:
                meta.last_token_rows(out=self._last_rows)
        direct_failure = None
        if not self._warms(first):
            try:
                self._capture_timed(tokens)
                return
            except UnsupportedStrategy:
                raise  # the model's outputs do not fit a graph: no warm-up changes that
            except Exception as exc:
                # Something this shape runs for the first time cannot run under capture
                # (a library's lazy set-up reading the device on the host; a kernel's
                # module load, on drivers that refuse it during capture), however the
                # library reports it: warm it up eagerly, as the first shape was, and
                # capture again. An error of the model itself recurs there and is raised.
                self.stats.warmup_retries += 1
                direct_failure = exc
        try:
            # The first warm-up sizes the pool, except where warm-ups compile (their
            # peak is the compiler's, not the graphs').
            self._warm_up(tokens, sizes=first and self._sizes_pool())
            self._capture_timed(tokens)
        except Exception as exc:
            if direct_failure is not None:
                exc.add_note(f"graphcap: the direct capture of {tokens} tokens before this "
                             f"warm-up had failed with {type(direct_failure).__name__}: "
                             f"{direct_failure}")
            raise

    def _sizes_pool(self) -> bool:
        """Whether the first warm-up sizes the pool: for backends that capture into it
        and whose warm-ups do not compile (a compiler's peak is not the graphs')."""
        return self.backend.captures_into_pool and not self.backend.watches_warmup

    def _warms(self, first: bool) -> bool:
        """Whether a shape gets an eager warm-up forward before its capture."""
        return first or self.config.warmup == "every" or self.backend.watches_warmup

    def _warm_up(self, tokens: int, sizes: bool = False) -> None:
        start = time.perf_counter()
        with self.pool.warmup(sizes=sizes), self.backend.watch(tokens):
            flat, _ = tree_flatten(self._forward(tokens))
            self._check_outputs(flat, tokens)
            outs = [(o.shape[1:], o.dtype, o.device) for o in flat]
            # Freed before the warm-up ends: a sizing warm-up counts them as transient,
            # as the capture, which copies them into the static outputs, frees them.
            del flat
        if not self._outputs:
            self._outputs = [torch.empty((self._rows(self.max_tokens), *tail), dtype=dtype,
                                         device=device) for tail, dtype, device in outs]
        self.stats.warmups += 1
        self.stats.warmup_s += time.perf_counter() - start

    def _capture_timed(self, tokens: int) -> None:
        start = time.perf_counter()
        try:
            self.entries[tokens] = self.backend.capture(self._captured_fn(tokens), tokens,
                                                        self.pool)
        finally:
            self.stats.capture_s += time.perf_counter() - start
        if self.stats.first_shape_s is None:
            self.stats.first_shape_s = self.stats.warmup_s + self.stats.capture_s

    def _check_outputs(self, flat: list, tokens: int) -> None:
        """Outputs a graph can return for shape ``tokens``: tensors with its rows along dim
        0 and, after the first shape, the same count, dtypes and trailing sizes as the
        first shape's (the static output buffers)."""
        rows = self._rows(tokens)
        bad = [tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
               for o in flat if not isinstance(o, torch.Tensor)
               or o.dim() == 0 or o.shape[0] != rows]
        what = ("one row per request slot (output_rows='requests')"
                if self.config.output_rows == "requests" else "one row per token")
        if bad:
            raise UnsupportedStrategy(
                f"the model returned {bad} for {tokens} tokens: a captured model must "
                f"return tensors with {what} along dim 0 ({rows} here; rows are padded and "
                "sliced), each row depending only on its own request's tokens")
        if not self._outputs:
            return
        got = [(o.dtype, tuple(o.shape[1:])) for o in flat]
        want = [(b.dtype, tuple(b.shape[1:])) for b in self._outputs]
        if got != want:
            raise UnsupportedStrategy(
                f"the model returned outputs of (dtype, trailing sizes) {got} for {tokens} "
                f"tokens but {want} for the first shape: a captured model must return the "
                "same outputs for every shape, only their rows differing")

    # -- calls ---------------------------------------------------------------------
    def __call__(self, *args, seq_lens=None):
        with self._serial:
            return self._call(args, seq_lens)

    def _call(self, args, seq_lens):
        if self.kind == "prefill":
            lens = batching.check_prefill(*args, seq_lens, self.device)
            if self.config.output_rows == "requests" and 0 in lens:
                raise batching.BadBatch(
                    f"seq_lens {lens} has a zero-length request, which has no last token: "
                    "this model returns one row per request; drop empty requests")
            if self.config.input_bounds is not None:
                batching.check_ranges(*args, *self.config.input_bounds)
            tokens = args[0].shape[0]
        else:
            if seq_lens is not None:
                raise batching.BadBatch(
                    f"seq_lens given, but this runner captured {type(self.source).__name__} "
                    "as a model of tensors along dim 0: declare a model of packed requests "
                    "with graphcap.capture(model, inputs='prefill') (or graphcap_inputs = "
                    "'prefill' on its class) and call runner(input_ids, positions, "
                    "seq_lens=[...])")
            lens = None
            if self.backend.captures:
                specs = self._specs if self._inputs else [
                    (a.dtype, tuple(a.shape[1:])) for a in args if isinstance(a, torch.Tensor)]
                tokens = batching.check_tensors(args, specs, self.device)
        self.stats.calls += 1
        with _CountFailures(self.stats):
            if not self.backend.captures:
                return self._eager(args, lens, "eager")
            if not self._inputs:  # a tensors model: captured on its first call
                self._capture_all(tuple(args), None)
            self._check_model()
            if lens is not None and len(lens) > self.config.max_requests:
                bucket, reason = None, "too_many_requests"
            else:
                bucket, reason = pick_bucket(tokens, self.config.buckets,
                                             self.config.max_pad_ratio)
            if lens is not None and not self._attends:
                self._check_packing(lens, self.config.attention.name)
            if bucket is None:
                return self._eager(args, lens, reason)
            return self._replay(bucket, args, lens, tokens)

    def _check_model(self) -> None:
        """The model must be the one captured: recapture it, or refuse, when not."""
        if self._snapshot is None or self._snapshot.current():
            return
        changes = self._snapshot.changes()
        name = type(self.source).__name__
        what = "; ".join(changes)
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
                "capture: call runner.recapture() to capture the model as it is now, or "
                "update weights in place (with torch.no_grad(): p.copy_(new)), which replays "
                "see (or capture with on_change='recapture')", changes)
        log.warning("graphcap: %s changed since capture (%s); capturing its %d shapes again",
                    name, what, len(self.config.buckets))
        self.recapture()
        self.stats.recaptures += 1

    def _check_packing(self, lens: list[int], backend: str) -> None:
        """Packed requests need graphcap attention, which alone sees their boundaries."""
        if sum(n > 0 for n in lens) > 1:
            raise UnsupportedModel(
                f"{type(self.source).__name__} ran no graphcap attention "
                f"(graphcap::attention, backend {backend!r}) in its forward, so its "
                f"attention cannot see where the {len(lens)} packed requests {lens} begin "
                "and end, and they would attend to each other. Route its attention "
                "through graphcap.opsdb.attention.ATTENTION (docs/models.md, 'Bring your own "
                "model'), or call it with one request per call")

    def _eager(self, args, lens, reason: str):
        """Run the model without graphs: the eager strategy, or a counted fallback."""
        if reason != "eager" and not self.config.fallback:
            raise batching.BadBatch(
                f"this batch cannot replay a graph ({reason.replace('_', ' ')}: "
                f"buckets up to {self.max_tokens} tokens, {self.config.max_requests} "
                "request slots) and fallback=False; enlarge max_tokens/max_requests or "
                "allow the eager fallback")
        meta = None
        if self.kind == "prefill":  # host work, outside any mode (so are the inputs)
            meta = self.config.attention.prepare(lens, self.device)
            if self.config.output_rows == "requests":
                args = (*args, meta.last_token_rows())
        if reason == "eager":
            with torch.no_grad():
                out = self._run_model(args, meta)
            if meta is not None and not meta.attended:
                self._check_packing(lens, meta.backend.name)
            return out
        self.stats.fallbacks[reason] += 1
        # A fallback runs in inference mode, as capture did: a compiled forward
        # (tc_piecewise) traced in it would otherwise recompile under no_grad, and its new
        # pieces capture graphs inside fallbacks. Outputs are cloned outside it, as replays.
        with torch.inference_mode():
            out = self._run_model(args, meta)
        flat, spec = tree_flatten(out)
        return tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t
                               for t in flat], spec)

    def _run_model(self, args, meta):
        if meta is None:
            return self.model(*args)
        with forward_context(attention=meta):
            return self.model(*args)

    def _replay(self, bucket: int, args, lens, tokens: int):
        # Each torch op here costs host time before the replay can start (the GPU waits):
        # one copy for all inputs, one host-to-device copy of the offsets; the rest of the
        # metadata (valid rows, last-token rows) is derived inside the graph. (The offsets'
        # copy as a node of the graph saved no measurable time, and made the next batch's
        # update wait for the whole previous replay instead of its copy.)
        with torch.inference_mode():
            rows, padding = self._input_rows(tokens, bucket)
            torch._foreach_copy_(rows, list(args))
            for buf in padding:
                buf.zero_()  # padding rows: finite, and never stale
            if lens is None:
                self._replay_entry(bucket)
            else:
                meta = self.metadata[bucket].update(lens, derive=False)
                self._replay_entry(bucket, meta)
        rows = len(lens) if self.config.output_rows == "requests" else tokens
        # Cloned outside inference mode: callers get ordinary tensors, as from the model.
        outs = [buf[:rows].clone() if self.config.copy_outputs else buf[:rows]
                for buf in self._outputs]
        return tree_unflatten(outs, self._out_spec)

    def _input_rows(self, tokens: int, bucket: int):
        """The input buffers' first ``tokens`` rows and their padding rows up to
        ``bucket``, sliced once per token count."""
        cached = self._rows_of.get((tokens, bucket))
        if cached is None:
            cached = ([buf[:tokens] for buf in self._inputs],
                      [buf[tokens:bucket] for buf in self._inputs] if tokens < bucket else [])
            self._rows_of[tokens, bucket] = cached
        return cached

    def _replay_entry(self, bucket: int, meta=None) -> None:
        """Replay a shape. ``meta``, its attention metadata, is the forward context of
        what a replay runs eagerly and of the check that its captured states are current;
        a replay that is graphs only and holds no state runs without a context."""
        entry = self.entries[bucket]
        if meta is None or not (entry.breaks or entry.states):
            self._replay_or_run(bucket, entry)
        else:
            with forward_context(attention=meta):
                self._replay_or_run(bucket, entry)

    def _replay_or_run(self, bucket: int, entry: Captured) -> None:
        if entry.current():
            entry.replay()
            self.stats.replays[bucket] += 1
        else:  # the graphs would read another state object's buffers: run eagerly
            self._captured_fn(bucket)()  # into the captured outputs, as a replay would
            self.stats.eager_replays[bucket] += 1

    # -- report --------------------------------------------------------------------
    def report(self) -> dict:
        """Shapes; per shape the graphs replayed (``segments``), the functions run eagerly
        between them (``breaks``) and the split ops captured inside a graph
        (``splits_in_graph``); graph memory, build seconds, counters (``eager_replays``:
        calls that ran eagerly because a captured state object was no longer current);
        ``warmups``: eager warm-up forwards before captures, ``warmup_retries``: shapes
        whose direct capture failed and were warmed up and captured again."""
        return {
            "strategy": self.backend.strategy,
            "device": str(self.device),
            "graph_kind": self.pool.kind,
            "shapes": sorted(self.entries),
            "segments": {k: e.segments for k, e in sorted(self.entries.items())},
            "breaks": {k: e.breaks for k, e in sorted(self.entries.items())},
            "splits_in_graph": {k: e.splits_in_graph for k, e in sorted(self.entries.items())},
            "graph_pool_bytes": self.pool.bytes(),
            # The block the first warm-up sized the pool with (0: not sized, e.g. an
            # earlier, higher peak of the process hid the warm-up's; see GraphPool.warmup).
            "pool_sized_bytes": self.pool.sized_bytes,
            "build_s": {"warmup": round(self.stats.warmup_s, 4),
                        "capture": round(self.stats.capture_s, 4),
                        "first_shape": round(self.stats.first_shape_s or 0.0, 4)},
            "warmups": self.stats.warmups,
            "warmup_retries": self.stats.warmup_retries,
            "calls": self.stats.calls,
            "replays": dict(self.stats.replays),
            "fallbacks": dict(self.stats.fallbacks),
            "eager_replays": dict(self.stats.eager_replays),
            "failed": self.stats.failed,
            "recaptures": self.stats.recaptures,
            # The attention backend the captured forward called (None: it called none).
            "attention": (self.config.attention.name
                          if self.kind == "prefill" and self._attends else None),
        }
