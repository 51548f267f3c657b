"""Breakable CUDA graph: capture op by op, close the segment at each eager break.

During capture a break handler is installed (``graphcap.core.breaks``). Each call of an
``@eager_on_graph`` function, or of a split op such as attention, ends the current graph
segment, runs the function once eagerly, records it, and begins a new segment on the same
pool and stream. Replay walks the record: segment, break, segment, ...

A break replays by calling its function again on the very argument tensors of capture
(held strongly here: a weak reference let later captures reuse their memory and gave
silent wrong output in the field; lists and dicts among them are rebuilt as they were
at the call, and a tensor among them that the forward gave another shape or strides in
place after the call, ``t_()``, ``unsqueeze_()``, as a view of its layout at the call), and
copying the fresh result into the buffers the capture gave the next segment: copies, made
at capture, of what the function returned then (the forward gets views of them, which it
may reshape in place), so a replay writes only memory graphcap allocated (never a
tensor the function returned that belongs to the model or the caller). A result on an
argument's memory (the argument, a view of it, an ``out=`` it wrote, a tensor a module
argument holds) is no copy: the next segment reads that memory, as eager code would, and
a replay must return the same view of it. A fresh result of another structure, shape,
dtype or device than at capture, or another view where an argument's was, or results
apart that shared memory at capture, raises :class:`~graphcap.errors.ReplayError`; so
does a result new at capture that lies on an argument's memory, or another result's,
at replay (a write through it would not reach the other: the graph reads a copy).

At capture each break runs on real values: the segment before it is replayed once as soon
as it is captured (a captured segment has run nothing yet), so the break sees what an
eager forward of the capture's batch would give it.

A break whose function is *graphable* (a split op whose per-batch state lives in static
buffers: attention under a backend that runs with the runner's prepared metadata) does not
break at all: it runs inside the open segment and is captured with it, so a forward whose
every break is graphable is one graph per shape, as under full capture. The segment then
reads the state object the split op read at capture (the prepared metadata), listed in
``BreakableCapture.states``: see :class:`BreakableCapture` for who keeps it current.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from graphcap.breakable.results import (
    _check_aliasing,
    _check_arguments,
    _check_result,
    _given,
    _layout,
    _own,
    _shares,
)
from graphcap.core.breaks import break_handler
from graphcap.core.graphs import GraphPool
from graphcap.core.snapshot import autocast_state
from graphcap.core.strategy import Captured, Strategy
from graphcap.core.trees import tensor_leaves
from graphcap.errors import CaptureError, ReplayError
from graphcap.tp.group import check_finished


@dataclass
class Break:
    fn: Callable
    args: tuple
    kwargs: dict
    output: Any  # the buffers the next segment reads: graphcap's own, or an argument's
    layout: tuple | None = None  # _layout(output)
    on_args: tuple[bool, ...] = ()  # per tensor of output: on an argument's memory
    # tree_flatten((args, kwargs)) at the call: where it holds lists or dicts (which the
    # forward may change after the call: a list of hidden states appended to; or the break
    # itself, on some calls only), replays rebuild them as at the call, else pass the same
    # objects.
    at_call: tuple | None = None
    shares: tuple = ()  # _shares of the result at capture
    called: list | None = None  # per leaf of at_call, a tensor's _alias at the call
    moved: dict = field(default_factory=dict)  # at_call's index: _alias (see settle)
    given: frozenset = frozenset()  # _given at the call: the memory it was given
    # autocast_state() at the call, where the forward set another than its caller's (a
    # replay runs none of the forward's Python, its ``with torch.autocast`` neither)
    autocast: tuple | None = None

    def __post_init__(self):
        self.rebuild = self.at_call is not None and _holds_mutable(self.at_call[1])
        # Where a result on an argument's memory lies at capture (the forward may reshape
        # the tensor in place after the call: the replay's must lie where it did then).
        leaves = tensor_leaves(self.output)
        self.sites = [(t.data_ptr(), t.stride()) if on else None for t, on in
                      zip(leaves, self.on_args or (False,) * len(leaves), strict=True)]

    def settle(self) -> None:
        """At the end of the capture: an argument the forward gave another shape, strides
        or memory in place after the call is passed to replays as it was at the call."""
        if self.called is None:
            return
        called, self.called = self.called, None
        self.moved = _moved(self.at_call[0], called)
        self.rebuild = self.rebuild or bool(self.moved)

    def replay(self) -> None:
        if self.rebuild:  # a fresh view of a moved one: the function may reshape it too
            leaves = self.at_call[0] if not self.moved else \
                [self.moved[i].detach() if i in self.moved else t
                 for i, t in enumerate(self.at_call[0])]
            args, kwargs = tree_unflatten(leaves, self.at_call[1])
        else:
            args, kwargs = self.args, self.kwargs
        try:
            with _autocast(self.autocast):
                fresh = self.fn(*args, **kwargs)
        except Exception as exc:
            exc.add_note(
                f"graphcap: raised by eager break {self.name} at a replay, which runs none "
                "of the forward's Python: a try/except around the call in the forward does "
                "not catch it there as it does eagerly; decide inside the break (return a "
                "flag tensor) rather than raise")
            raise
        if self.layout is not None and (now := _layout(fresh)) != self.layout:
            part = 1 if now[1] != self.layout[1] else 0  # the tensors, else the structure
            raise ReplayError(
                f"eager break {self.name} returned {now[part]} at replay but "
                f"{self.layout[part]} at capture: the graph after it reads buffers of the "
                "capture's structure, shapes and dtypes. Return tensors of the same "
                "structure, shapes, dtypes and devices on every call (or write into an out= "
                "tensor you are given)")
        kept, fresh_leaves = tensor_leaves(self.output), tensor_leaves(fresh)
        if self.layout is not None:
            _check_aliasing(self, fresh_leaves)
        for i, (buf, new) in enumerate(zip(kept, fresh_leaves, strict=True)):
            if self.sites[i] is None:  # graphcap's own buffer
                buf.copy_(new)
            elif (new.data_ptr(), new.stride()) != self.sites[i]:
                raise ReplayError(
                    f"eager break {self.name} returned a view of its arguments at capture "
                    "(an argument, a view of one, or a tensor a module argument holds), "
                    "and another tensor at replay: the graph after it reads that view. "
                    "Return the same view of the same argument on every call, or a "
                    ".clone() of it where the forward only reads it")

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


def _autocast(state: tuple | None):
    """Autocast on the CPU and CUDA as ``state`` (their ``autocast_state()``) says; None:
    as it is."""
    if state is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    for kind, dtype in zip(("cpu", "cuda"), state, strict=True):
        stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=dtype is not None))
    return stack


def _alias(t) -> torch.Tensor | None:
    """A view of all of tensor ``t`` as it lies now, which a later ``t.t_()`` or
    ``t.unsqueeze_()`` leaves as it is (an empty one too: its shape is what a break
    reads); None for no tensor, or one without a storage or an address to view."""
    if not isinstance(t, torch.Tensor):
        return None
    try:
        t.untyped_storage(), t.data_ptr()
    except (RuntimeError, TypeError, ValueError):  # no storage to view
        return None
    return t.detach()


def _moved(leaves: list, called: list) -> dict:
    """The tensors among ``leaves`` (an argument list's) whose memory, shape or strides
    changed in place since ``called`` (their ``_alias`` at the call): index -> alias."""
    return {i: a for i, (t, a) in enumerate(zip(leaves, called, strict=True))
            if a is not None and _where(t) != _where(a)}


def _where(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride()


def _holds_mutable(spec) -> bool:
    """Whether the ``tree_flatten`` spec of ``(args, kwargs)`` has a node among the
    arguments other than a tuple (a list, a dict, a registered class), which could change
    in place between replays; the call's own tuple of arguments and dict of keywords
    cannot."""
    def children(node) -> list:  # a method in newer torch, a field before
        return node.children() if callable(getattr(node, "children", None)) \
            else node.children_specs

    def mutable(node) -> bool:
        return not node.is_leaf() and (not issubclass(node.type, tuple) or any(
            map(mutable, children(node))))
    return any(mutable(c) for part in children(spec) for c in children(part))


def note_state(states: list, static_state: Callable[[], object], state: object) -> None:
    """Add ``(static_state, state)`` to a capture's ``states`` unless it is there already
    (every attention layer of a forward reads the same metadata object)."""
    if not any(g is static_state and s is state for g, s in states):
        states.append((static_state, state))


def states_current(states: list) -> bool:
    """True while each ``(static_state, state)`` pair's function still returns its state."""
    return all(current() is state for current, state in states)


class BreakableCapture:
    """The segments and breaks of one shape, captured by running ``fn`` once.

    Its segments read the state objects listed in ``states`` (attention metadata whose
    buffers a split op captured inside a segment). A caller that keeps them current, as
    a runner does (it owns each shape's metadata and only ever rewrites its buffers),
    passes ``trusted_states=True`` and replays check nothing; otherwise every replay
    checks them, and under another state object runs ``fn`` eagerly instead (the segments
    would read the old object's buffers)."""

    def __init__(self, pool: GraphPool, trusted_states: bool = False):
        self.pool = pool
        self.trusted_states = trusted_states
        self.items: list = []  # Graph segments and Breaks, in replay order
        self.states: list[tuple[Callable[[], object], object]] = []  # (static_state, its state)
        self.in_graph = 0  # graphable split ops captured inside a segment
        self._segment = None
        self._raised: tuple | None = None  # an exception at a break the forward caught
        self._fn: Callable[[], Any] | None = None
        self._outputs: Any = None
        self._modules: dict = {}  # _given's modules of this capture
        self._autocast: tuple | None = None  # autocast_state() as the forward began
        self._inference = False  # whether it ran in inference mode (its tensors: inference's)

    def _open(self) -> None:
        self._segment = self.pool.graph()
        self._segment.begin()

    def _close(self) -> None:
        segment, self._segment = self._segment, None
        with warnings.catch_warnings():  # before a first break or between two: no ops,
            # which torch tells as a graph "captured on wrong device or stream"
            warnings.filterwarnings("ignore", "The CUDA Graph is empty")
            segment.end()
        self.items.append(segment)

    def _on_break(self, fn, args, kwargs, static_state=None):
        state = static_state() if static_state is not None else None
        if state is not None:  # static state: captured inside the open segment
            self.in_graph += 1
            note_state(self.states, static_state, state)
            with break_handler(None):
                return fn(*args, **kwargs)
        name = getattr(fn, "__qualname__", repr(fn))
        check_finished((args, kwargs), f"eager break {name!r}")
        at_call = tree_flatten((args, kwargs))
        called = [_alias(t) for t in at_call[0]]  # its tensors as the break sees them
        autocast = autocast_state()
        what = f"the graph segment before eager break {name}"
        try:
            self._close()  # a capture invalidated earlier (a host sync caught) fails here
            what = f"eager break {name}"
            _check_arguments(name, at_call[0])
            given = _given(at_call[0], self._modules)  # before the call: not what it makes
            # No handler inside a break: one calling another marked function runs it.
            with self.pool.warmup(), break_handler(None):  # the capture stream, no capture
                self.items[-1].replay()  # its inputs: real values, not capture garbage
                raw = fn(*args, **kwargs)
                if self.pool.emulated:  # an argument the break itself reshaped in place:
                    # the emulated segments before it keep its layout, as CUDA's kernels do
                    for i, was in _moved(at_call[0], called).items():
                        self.items[-1]._freeze(at_call[0][i], was)
                output, on_args = _own(raw, given)
                shares = _shares(tensor_leaves(raw), on_args)
            _check_result(name, output, self.pool.device)
        except BaseException as exc:  # the forward may catch it: its ops need a segment
            self._raised = (what, exc)
            self._open()
            raise
        self.items.append(Break(fn, args, kwargs, output, _layout(output), on_args,
                                at_call, shares=shares, called=called,
                                given=frozenset(given),
                                autocast=autocast if autocast != self._autocast else None))
        self._open()
        # The forward gets views of graphcap's buffers: one it reshapes in place (t_())
        # leaves the buffer a replay copies into as it is.
        flags = iter(on_args)
        return tree_map(lambda t: t if not isinstance(t, torch.Tensor) or next(flags)
                        else t.detach(), output)

    def run(self, fn: Callable[[], Any]) -> Any:
        """Capture ``fn()`` (once per capture) and return its outputs: as a graph's, the
        tensors every :meth:`replay` writes, garbage until the first replay (but for a
        break's result), overwritten by each replay after it."""
        if self._fn is not None:
            raise CaptureError("this BreakableCapture has run already: make a new one")
        self._fn = fn
        self._raised = None
        self._autocast = autocast_state()
        self._inference = torch.is_inference_mode_enabled()
        self._open()
        try:
            with break_handler(self._on_break):
                out = fn()
        except BaseException as exc:
            self._raised = None  # see _caught
            err = self._segment.abort(exc) if self._segment is not None else exc
            self._segment = None
            try:
                if err is not exc:
                    raise err from exc
                raise
            finally:
                del err  # see _caught
        finally:
            self._modules.clear()  # their tensors, held no longer
        self._close()
        for item in self.items:
            if isinstance(item, Break):
                item.settle()
        if self._raised is not None:
            raise self._caught()
        self._outputs = out
        return out

    def _caught(self) -> CaptureError:
        """The refusal of an exception at a break that the forward caught. Held by neither
        this capture nor a local of :meth:`run`, whose frame its traceback reaches: either
        would make a cycle only gc frees, the segments' memory and the breaks' tensors
        with it."""
        (what, exc), self._raised = self._raised, None
        error = CaptureError(
            f"{what} raised {type(exc).__name__} ({exc}) at capture and the "
            "forward caught it: the graphs would replay the path it took then on every "
            "call. Decide before the break (or inside it) without raising")
        error.__cause__ = exc
        return error

    def current(self) -> bool:
        """True while every static state the segments read is the one they captured."""
        return states_current(self.states)

    def replay(self) -> None:
        """Segment, break, segment, ...; unless ``trusted_states``, under another state
        object than the captured one the function runs eagerly instead and its results
        are copied into the captured outputs. The breaks run in inference mode as at
        capture (a copy into a buffer made in it must be), whatever the caller's is now."""
        if torch.is_inference_mode_enabled() != self._inference:
            with torch.inference_mode(self._inference):
                return self.replay()
        if not self.trusted_states and not self.current():
            fresh = self._fn()
            for kept, new in zip(tensor_leaves(self._outputs), tensor_leaves(fresh),
                                 strict=True):
                kept.copy_(new)
            return
        for item in self.items:
            item.replay()

    @property
    def graphs(self) -> list:
        """The segments."""
        return [i for i in self.items if not isinstance(i, Break)]


class BreakableStrategy(Strategy):
    """``strategy="breakable"``: segments between eager breaks, no compiler involved."""

    name = "breakable"

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        bcg = BreakableCapture(pool, trusted_states=True)  # the runner owns the metadata
        bcg.run(fn)
        segments = len(bcg.graphs)
        return Captured(bcg.replay, segments=segments, breaks=len(bcg.items) - segments,
                        splits_in_graph=bcg.in_graph)


class DebugStrategy(Strategy):
    """``debug=True`` / ``GRAPHCAP_DEBUG_CUDA_GRAPH=1``: the whole forward is one eager
    break, through the same runner path (padding, metadata, slicing) as a capture."""

    name = "breakable"
    debug = True
    sizes_pool = False  # no graph is captured into the pool

    def capture(self, fn, key, pool: GraphPool) -> Captured:
        fn()  # it writes the runner's outputs itself, as every call of it does
        # Not a Break: the forward's own Python runs, its try/except too, so an error of
        # the model reaches the caller as eagerly, without a note on breaks' replays.
        return Captured(fn, segments=0, breaks=1)
