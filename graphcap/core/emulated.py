"""A CPU emulator of CUDA graphs: record the aten ops of a region, replay them.

Capture runs the region once under a ``TorchDispatchMode`` that records every op with the
very tensor objects it touched. Replay walks the record without running any Python of the
region, with CUDA-graph semantics:

- tensors are the recorded objects (static addresses): new contents copied into a captured
  input are read, a new tensor object passed later is not;
- Python scalars and control flow are baked at capture;
- view ops are not re-run (a view stays a view of the same storage); ops that may alias
  or copy (``contiguous``, ``reshape``) re-run when they copied; an in-place view
  (``t_``, ``unsqueeze_``) leaves the ops recorded before it the shape they saw;
- in-place and ``out=`` ops re-run on the recorded tensors;
- functional ops re-run and their results are copied into the recorded outputs, so outputs
  are the same objects every replay and are overwritten by the next one;
- random ops draw fresh values on each replay (CUDA graphs advance the Philox offset);
  one given a generator other than the device's default is refused, as CUDA refuses it;
- ``empty``-style allocations launch nothing and are not re-run;
- in a graph of another device, an op of host tensors alone runs once, at capture.

Two details make capture itself behave as on CUDA, where capture launches nothing: memory older
than the capture that the region mutated, and the random generators, are restored when capture
ends; memory allocated during capture is filled with 0xFF bytes (NaN in floats, -1 in ints; True
in bools), as on CUDA it holds garbage until a replay. Host synchronisations raise
``CaptureError`` (:mod:`graphcap.core.hostsync`; the calls that wait for the device, as
``torch.cuda.synchronize()``, are swapped for checked ones while a graph records), and a region
that catches one fails at ``end()`` all the same, as CUDA invalidates the capture. Composite ops
are recorded as the ops they are made of, under ``torch.inference_mode`` as under ``no_grad``
(so ``int(t)`` is seen as the ``Tensor.item`` it is).

Differences from CUDA that stay: memory freed inside the region is not handed to later captures
on the same pool (the emulator never reuses a block), and a custom op's Python implementation
runs again on every replay (CUDA replays only the kernels it launched), inside the
``contextvars`` context of its capture (so it sees the forward context it saw then, whose
buffers hold the current batch). A custom op is one kernel to the emulator: a host sync inside
its implementation is not seen (its torch reference may read values on the CPU, where its CUDA
kernel reads none), nor does a replay check its host reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_map

from graphcap.compat import imports
from graphcap.core import hostsync
from graphcap.core.graph_base import Graph
from graphcap.core.trees import storage_key, storages, tensor_leaves
from graphcap.tp.group import check_finished

aten = torch.ops.aten
_GRAPHS: weakref.WeakSet = weakref.WeakSet()  # every live EmulatedGraph, of every pool

_NO_KERNEL = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}


def _kind(func) -> str:
    """How an op replays: 'mutate' (re-run), 'view'/'alloc' (skip), 'functional' (re-run, copy).
    An in-place view (``unsqueeze_``, ``t_``) changes a tensor's shape, which a replay
    leaves alone, as CUDA's does: 'view'."""
    if torch.Tag.inplace_view in func.tags:
        return "view"
    schema = func._schema
    if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return "mutate"
    if any(r.alias_info is not None for r in schema.returns):
        return "view"
    if func in _NO_KERNEL:
        return "alloc"
    return "functional"


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensors an op declares it writes (``Tensor(a!)`` arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += tensor_leaves(value)
    return out


def _aliases_an_input(out, args, kwargs) -> bool:
    inputs = {t.untyped_storage().data_ptr() for t in tensor_leaves((args, kwargs))}
    return all(t.untyped_storage().data_ptr() in inputs for t in tensor_leaves(out))


def _replay_context() -> contextvars.Context:
    """The context a custom op replays in: the capture's, less its break handler (over)."""
    from graphcap.core.breaks import clear_handler

    ctx = contextvars.copy_context()
    ctx.run(clear_handler)
    return ctx


def _is_builtin(func) -> bool:
    return func.namespace in ("aten", "prims")


def _decompose(mode: TorchDispatchMode, func, args, kwargs):
    """Run a composite aten op (``CompositeImplicitAutograd``) as the ops it is made of,
    under ``mode``; ``NotImplemented`` for any other op.

    Under ``torch.inference_mode`` (the runner captures under it) a dispatch mode sees
    composite ops whole: ``int(t)`` arrives as ``aten.item``, ``torch.where(cond)`` as
    ``aten.nonzero_numpy``, and their host reads, made inside the composite kernel,
    never reach the mode. Decomposed, the mode sees what it sees under ``no_grad``."""
    if not _is_builtin(func):
        return NotImplemented
    with mode:
        return func.decompose(*args, **kwargs)


def _check_recordable(func, out) -> None:
    """Outputs the emulator can keep: tensors with storage. A wrapper subclass has none;
    the one a capture meets is an asynchronous collective's result, refused as the CUDA
    graph's break would refuse it."""
    for t in tensor_leaves(out):
        try:
            t.untyped_storage().data_ptr()
        except RuntimeError:
            check_finished(t, f"{func} (recorded by the graph emulator)")
            raise hostsync.CaptureError(
                f"the graph emulator cannot record {func}: it returned a "
                f"{type(t).__name__}, a tensor subclass without storage of its own") from None


@dataclass
class _Step:
    func: Any
    args: tuple
    kwargs: dict
    kind: str
    outs: list[torch.Tensor] = field(default_factory=list)
    keep: list[int] | None = None  # which returned tensors go to outs (None: all)
    context: contextvars.Context | None = None  # custom ops replay in their capture context

    def run(self):
        if self.context is not None:
            return self.context.run(self.func, *self.args, **self.kwargs)
        return self.func(*self.args, **self.kwargs)


class _HostMethodGuard(TorchFunctionMode):
    """Rejects Tensor methods that read device memory without dispatching an aten op."""

    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with self.graph._refusing():
            hostsync.check_method(func, args, kwargs, self.graph.device)
        if func is torch.Tensor.__setitem__ and self.graph.device.type == "cpu" and \
                isinstance(args[2] if len(args) > 2 else None, (int, float, bool)):
            token = hostsync.SCALAR_ASSIGNMENT.set(True)  # x[i] = 0.0: no host data
            try:
                return func(*args, **kwargs)
            finally:
                hostsync.SCALAR_ASSIGNMENT.reset(token)
        return func(*args, **kwargs)


class _Recorder(TorchDispatchMode):
    """Runs each op once and appends it to the graph's steps."""

    def __init__(self, graph: EmulatedGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = _decompose(self, func, args, kwargs)
        if out is not NotImplemented:
            return out
        graph = self.graph
        with graph._refusing():
            hostsync.check_op(func, args, kwargs, graph.device)
        # CUDA refuses it before the op launches: a region that catches it captures well
        hostsync.check_generator(func, args, kwargs, graph.device)
        kind = _kind(func)
        if torch.Tag.inplace_view in func.tags:
            graph._freeze(args[0])
        if kind == "mutate":  # host memory (of a CUDA tensors' graph) it writes stays written
            for t in (t for t in _written(func, args, kwargs) if t.device == graph.device):
                graph._snapshot(t)
        out = func(*args, **kwargs)  # a custom op: one kernel, its insides unseen
        if _is_builtin(func) and all(t.device != graph.device
                                     for t in tensor_leaves((args, kwargs, out))):
            return out  # host work in a graph of another device: done once, as on CUDA
        if kind == "view" and not _aliases_an_input(out, args, kwargs):
            kind = "functional"  # contiguous/reshape/to: an alias by schema, here a copy
        step = _Step(func, args, kwargs, kind,
                     context=None if _is_builtin(func) else _replay_context())
        if kind in ("functional", "alloc", "mutate"):
            with graph._refusing():
                _check_recordable(func, out)
        if kind in ("functional", "alloc"):
            step.outs = tensor_leaves(out)
            # New memory, unless the op returned an argument's (as _unsafe_view can).
            given = storages((args, kwargs))
            for t in step.outs:
                if storage_key(t) not in given:
                    graph._allocated(t)
        elif kind == "mutate":  # and what it returns beside the written arguments
            written = {t.untyped_storage().data_ptr() for t in _written(func, args, kwargs)}
            returned = tensor_leaves(out)
            step.keep = [i for i, t in enumerate(returned)
                         if t.untyped_storage().data_ptr() not in written]
            step.outs = [returned[i] for i in step.keep]
            for t in step.outs:
                graph._allocated(t)
        graph._steps.append(step)
        return out


def _recorder() -> _Recorder | None:
    """The recorder of the emulated graph recording on this thread (mode stack), or None."""
    return next((m for m in _get_current_dispatch_mode_stack() if isinstance(m, _Recorder)),
                None)


def recording() -> bool:
    """Whether an emulated graph is recording on this thread."""
    return _recorder() is not None


def _check_wait(wait: hostsync.HostWait, args: tuple) -> None:
    """Refuse a host wait (``torch.cuda.synchronize()``) of what this thread records."""
    recorder = _recorder()
    if recorder is not None and wait.waits(recorder.graph.device, args):
        with recorder.graph._refusing():
            hostsync.refuse_wait(wait)


class EmulatedGraph(Graph):
    """A graph recorded by dispatch mode and replayed op by op (see the module docstring)."""

    emulated = True

    def __init__(self, pool):
        _GRAPHS.add(self)
        self.pool = pool
        self.device = pool.device
        self._steps: list[_Step] = []
        self._modes: list = []
        self._snapshots: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}
        self._internal: dict[int, tuple[torch.UntypedStorage, bool]] = {}
        self._bytes = 0
        self._segments = 0
        self._refused: hostsync.CaptureError | None = None  # the first refusal met

    # -- capture -------------------------------------------------------------------
    @property
    def capturing(self) -> bool:
        return bool(self._modes)

    def begin(self) -> None:
        """Start recording (one capture per graph, as on CUDA)."""
        if self._modes:
            raise hostsync.CaptureError("begin() called twice: end() the current capture first")
        if self._segments:
            raise hostsync.CaptureError(
                "this graph is captured already: reset() it or make a new one")
        imports.complete(imports.EMULATOR)  # what the modes import: whole before they run
        cuda = [self.device.index] if self.device.type == "cuda" else []
        self._modes = [torch.random.fork_rng(cuda), hostsync.host_waits_checked(_check_wait),
                       _HostMethodGuard(self), _Recorder(self)]
        for mode in self._modes:
            mode.__enter__()

    def end(self) -> None:
        """Stop recording; undo capture-time writes to older memory, poison new memory."""
        if not self._modes:
            raise hostsync.CaptureError("end() without begin()")
        if self._refused is not None:  # the region caught it and went on
            refused = self._refused
            self.abort(refused)
            raise hostsync.CaptureError(
                f"{refused} The captured region caught this error and went on: CUDA "
                "invalidates a capture at such an operation (its end fails), so the "
                "emulator refuses the capture too, rather than replay the path taken "
                "after it. Let the error through, or decide before the capture",
                op=refused.op, site=refused.site) from refused
        self._exit_modes()
        self._as_cuda_leaves_it()
        self._segments += 1

    def abort(self, exc: BaseException) -> BaseException:
        """End a capture that raised: memory as CUDA leaves it (a tensor the region made
        and kept holds garbage), drop the record, return the error."""
        self._exit_modes()
        self._as_cuda_leaves_it()
        self.reset()
        return exc

    @contextlib.contextmanager
    def _refusing(self):
        """Remember a ``CaptureError`` raised in the block (the first one), so that a
        region catching it cannot end its capture as if nothing had happened."""
        try:
            yield
        except hostsync.CaptureError as exc:
            if self._refused is None:
                self._refused = exc
            raise

    def _as_cuda_leaves_it(self) -> None:
        """Memory as a CUDA capture, which runs nothing, leaves it: older memory the region
        wrote put back, memory it made garbage (NaN in every float dtype, -1 in ints, True
        in bools) until a replay."""
        for storage, saved in self._snapshots.values():
            storage.copy_(saved)
        self._snapshots.clear()
        for storage, is_bool in self._internal.values():
            storage.fill_(0x01 if is_bool else 0xFF)

    def _exit_modes(self) -> None:
        modes, self._modes = self._modes, []
        for mode in reversed(modes):
            mode.__exit__(None, None, None)

    def _freeze(self, t: torch.Tensor, was: torch.Tensor | None = None) -> None:
        """``t``'s shape is about to change in place (``t_``, ``unsqueeze_``): the steps
        recorded so far, of every graph of every pool (a breakable capture's earlier segments,
        other runners' graphs), keep reading and writing it as it is now, through a view of its
        present shape (a replay runs them on the recorded objects, which by then have the last
        shape; CUDA's kernels keep the layout they were launched with). ``was``: ``t`` as it lay
        before a change made outside any recording (by an eager break), the layout they keep."""
        was = t if was is None else was

        def frozen(x):
            return (was.as_strided(was.size(), was.stride(), was.storage_offset())
                    if x is t else x)

        for graph in list(_GRAPHS):
            for step in graph._steps:
                step.args, step.kwargs = tree_map(frozen, (step.args, step.kwargs))
                step.outs = [frozen(out) for out in step.outs]

    def _snapshot(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in self._internal and key not in self._snapshots:
            self._snapshots[key] = (storage, storage.clone())

    def _allocated(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() and key not in self._internal and key not in self._snapshots:
            self._internal[key] = (storage, t.dtype == torch.bool)
            self._bytes += storage.nbytes()

    # -- replay --------------------------------------------------------------------
    def replay(self) -> None:
        """Re-run the recorded device work on the recorded tensors; no region Python runs."""
        if self._modes:
            raise hostsync.CaptureError("replay() during capture: end() the capture first")
        if not self._segments:
            raise hostsync.CaptureError("replay() before any capture: capture a region first")
        with torch.inference_mode():
            for step in self._steps:
                if step.kind == "mutate" and not step.outs:
                    step.run()
                elif step.kind in ("mutate", "functional"):
                    fresh = tensor_leaves(step.run())
                    if step.keep is not None:
                        fresh = [fresh[i] for i in step.keep]
                    for out, new in zip(step.outs, fresh, strict=True):
                        out.copy_(new)

    def reset(self) -> None:
        """Forget the record and release the memory it held."""
        self._steps.clear()
        self._snapshots.clear()
        self._internal.clear()
        self._bytes = 0
        self._segments = 0
        self._refused = None

    @property
    def num_ops(self) -> int:
        return sum(step.kind in ("mutate", "functional") for step in self._steps)
