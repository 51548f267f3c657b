"""One piece of the split graph and its graphs: warmed up, captured and replayed per token
count, and inline in a shape captured as one graph."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from graphcap.core.graph_base import Graph
from graphcap.core.hostsync import RUNNING_NODE, traced_site
from graphcap.core.trees import overlap, repeats_memory, storage_key
from graphcap.errors import CaptureError
from graphcap.piecewise import phase as phases
from graphcap.piecewise.hostvalues import HostValues, same_value
from graphcap.piecewise.inductor import OneOpPiece
from graphcap.piecewise.phase import Phase
from graphcap.piecewise.split import past_hooks
from graphcap.piecewise.writes import mutated_inputs


@dataclass
class PieceEntry:
    """One capture of a piece: its graph, the static inputs and outputs it reads and
    writes, and what it captured (the piece, or the piece as one op, kept alive here)."""

    graph: Graph
    static: list
    outputs: Any
    captured: Any
    # Arguments read in place that graphcap does not own (parameters, buffers): index ->
    # the address the graph reads (``p.data = new`` keeps the Parameter, not the address).
    foreign: dict[int, int]
    # Arguments read in place that were earlier pieces' static outputs: index -> address.
    shared: dict[int, int]
    # Outputs that are views of a copied argument: output index -> (argument index, offset
    # from the copy's): after each replay, the same view of the caller's tensor.
    aliases: dict[int, tuple[int, int]]
    state: Any = None  # split pieces: a weak reference to the state read at capture

    def __post_init__(self):
        self.viewed = frozenset(i for i, _ in self.aliases.values())  # read every replay
        # Copies that keep an expanded input's layout: refreshed through their distinct
        # elements, from a tensor of the same strides only.
        self.expanded = frozenset(i for i, s in enumerate(self.static)
                                  if isinstance(s, torch.Tensor) and i not in self.foreign
                                  and i not in self.shared and _expanded(s))


class PieceGraphs(torch.nn.Module):
    """One piece: eager warm-up, then one graph per capture size, replayed.

    Captured inputs: parameters, the arguments ``held`` names (a module's buffers: see
    :func:`~graphcap.piecewise.split.held_args`) and the static outputs of earlier captured
    pieces are read in place; any other tensor (the caller's inputs) gets a static copy,
    refreshed before each replay and, when the piece writes it, copied back after. A
    replay writes no tensor but the ones eager would: where a parameter or buffer read in
    place at capture is another tensor now (a weight or table reassigned after capture,
    another Parameter passed in), the size is captured again (``recaptures``), never
    copied into the old one; a held argument that moved twice (a buffer the forward
    reassigns on every call) is copied from then on, as the caller's inputs are;
    so is a size whose earlier piece's output read in place is another static output now
    (that piece captured again), and one given another tensor there runs eagerly. An
    output that is a view of a copied argument is returned as the same view of the
    caller's tensor, as eager returns it (a write through it reaches that tensor). A
    Python number baked at capture that changed: :mod:`~graphcap.piecewise.hostvalues`.

    ``opaque``: ``fn`` runs kernels the dispatcher never sees (Inductor's), so an emulated
    graph captures it as one op (:class:`~graphcap.piecewise.inductor.OneOpPiece`).

    ``static_state`` (split pieces): returns the static state object the split op reads now
    (attention: the prepared metadata), or None. A size whose capture finds one is
    captured and replayed as a graph while that object stays current (the caller of the
    compiled model owns it, so every replay checks); otherwise the split op runs eagerly."""

    def __init__(self, owner, fn, module: torch.nn.Module, opaque: bool = False,
                 static_state=None, held: frozenset[int] = frozenset(),
                 names: dict[int, str] | None = None):
        super().__init__()
        self.owner, self.fn, self.opaque = owner, fn, opaque
        # An FX piece's own forward, past nn.Module.__call__: a global module hook
        # (register_module_forward_hook) runs on the model's modules, as in eager, not on
        # graphcap's pieces too (the graphs would bake it in a second time).
        self.call_fn = past_hooks(fn)
        self.static_state, self.held = static_state, held
        self.host = HostValues(names or {})  # the Python numbers its graphs bake
        self.moves: dict[int, int] = {}  # held argument -> the times it moved
        self.seen_at: dict[int, int] = {}  # held argument -> its last address seen
        self.writes = mutated_inputs(module)
        self.seen: set[int] = set()
        self.eager_sizes: set[int] = set()  # split pieces whose state was not static
        self.uncapturable: dict[int, str] = {}  # size -> why its capture failed (on its own)
        self.entries: dict[int, PieceEntry] = {}

    def forward(self, box: list):
        """``box``: the piece's arguments, in a list the split module built for this call
        and holds no other reference to (``piece_calls``). A warm-up and a whole
        capture empty it and free each argument after its last use in the piece (what
        the first shape's warm-up peaks at sizes the pool)."""
        now, detail = phases.current()
        match now:
            case Phase.CAPTURE_WHOLE:  # inline in the shape's one graph
                return detail.run(self, box)
            case Phase.EAGER:  # a runner's fallback
                return self.call_fn(*box)
            case Phase.WARMUP:  # the runner's warm-up of a shape: eager, the size seen
                if self.static_state is not None and self.static_state() is None:
                    detail.call.static = False  # a split op on host state: no whole capture
                size = self._size(box)  # before run_boxed empties the box
                out = run_boxed(self.fn, box)
                self.seen.add(size)  # warmed up once it ran: one that raised is not
                return out
        return self._per_size(tuple(box))

    @staticmethod
    def _size(args) -> int | None:
        """The token count of the compiled graph's call, else (a graph without a dynamic
        size) its first tensor's rows."""
        size = phases.current_size()
        if size is None:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            size = tensors[0].shape[0] if tensors and tensors[0].dim() else None
        return size

    def _per_size(self, args):
        owner, size = self.owner, self._size(args)
        if size in self.uncapturable:
            owner.ran_eagerly(self.uncapturable[size], kind="uncapturable")
            return self.call_fn(*args)
        if size not in owner.capture_sizes or size in self.eager_sizes:
            if self.static_state is None:  # split ops run eagerly by design: not counted
                owner.ran_outside(size)
            return self.call_fn(*args)
        entry = self.entries.get(size)
        if (why := self._aliased_write(args, entry)) is not None:
            owner.ran_eagerly(f"{why} at size {size}: static copies of them would part "
                              "them, so a write through one would miss the other",
                              kind="aliased")
            return self.call_fn(*args)
        if entry is None:
            if size not in self.seen:  # warm-up: lazy init and JIT outside any capture
                out = self.call_fn(*args)
                self.seen.add(size)  # only once it ran: a raising warm-up warmed nothing
                return out
            if self.static_state is not None and self.static_state() is None:
                self.eager_sizes.add(size)
                return self.call_fn(*args)
            return self._capture(size, args)
        if self.static_state is not None and not self._state_current(entry):
            return self.call_fn(*args)  # the graph would read the captured state's buffers
        return self._replay(size, entry, args)

    def _state_current(self, entry: PieceEntry) -> bool:
        """Whether the state the split op reads now is the one ``entry`` captured: alive
        (a state that is gone, while the op reads none now, is not: its graph would read
        freed buffers) and the same object."""
        captured = entry.state()
        return captured is not None and self.static_state() is captured

    def _aliased_write(self, args, entry: PieceEntry | None) -> str | None:
        """Why the piece cannot run from static copies of ``args``: a tensor input it would
        copy (``entry``'s copies, else what a capture would copy) shares memory (an
        overlapping slice, a transpose) with another input, and it writes one of the two."""
        if not self.writes:
            return None
        tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        copied = {i for i, a in tensors.items() if not self._in_place(i, a)} \
            if entry is None else tensors.keys() - entry.foreign.keys() - entry.shared.keys()
        for w in self.writes & tensors.keys():
            for i, a in tensors.items():
                if i != w and (i in copied or w in copied) and overlap(tensors[w], a):
                    return f"inputs {min(i, w)} and {max(i, w)} of a piece share memory " \
                        "and it writes one"
        return None

    def _in_place(self, i: int, a: torch.Tensor) -> bool:
        """Whether a capture now reads argument ``i`` in place: the caller's (a parameter,
        a held tensor that stays put) or an earlier piece's static output."""
        return self._foreign(i, a) or a.data_ptr() in self.owner.static_ptrs

    def _moved(self, i: int, a: torch.Tensor) -> None:
        """A held argument read in place at some size is another tensor now: one move
        more, counted once whatever the sizes that see it."""
        if not isinstance(a, torch.nn.Parameter) and self.seen_at.get(i) != a.data_ptr():
            self.seen_at[i] = a.data_ptr()
            self.moves[i] = self.moves.get(i, 0) + 1

    def _foreign(self, i: int, a: torch.Tensor) -> bool:
        return isinstance(a, torch.nn.Parameter) or (i in self.held
                                                     and self.moves.get(i, 0) < 2)

    def _copy(self, a: torch.Tensor) -> torch.Tensor:
        """A static copy of the caller's ``a``. A compiled piece (Inductor's) checks that
        its inputs have the sizes and strides it was traced with, so its copy keeps the
        caller's layout (an expanded mask, a column slice) where a clone would be dense."""
        copy = a.clone()
        if not self.opaque or copy.stride() == a.stride():
            return copy
        same = torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
        if _overlaps(_distinct(same)):  # beyond expanded dims (unfold): no copy refreshes it
            return copy
        _distinct(same).copy_(_distinct(a))
        return same

    def _replay(self, size: int, entry: PieceEntry, args):
        owner, copied, host = self.owner, [], None
        for i, (buf, a) in enumerate(zip(entry.static, args, strict=True)):
            if isinstance(buf, torch.Tensor):
                if buf.shape != a.shape:  # e.g. more requests than captured: no replay
                    owner.ran_eagerly(f"input {i} of a piece is {tuple(a.shape)} at size "
                                      f"{size}, captured as {tuple(buf.shape)}")
                    return self.call_fn(*args)
                if i in entry.foreign:  # the caller's, read in place
                    if a.data_ptr() != entry.foreign[i]:
                        self._moved(i, a)
                        return self._recapture(size, args)
                    continue
                if i in entry.shared:  # an earlier piece's, read in place: never written
                    if a.data_ptr() == entry.shared[i]:
                        continue
                    if a.data_ptr() in owner.static_ptrs:  # that piece captured again
                        return self._recapture(size, args)
                    owner.ran_eagerly(f"input {i} of a piece at size {size} is not the "
                                      "static output of the piece before it that its "
                                      "capture read in place")
                    return self.call_fn(*args)
                if buf is a or buf.data_ptr() == a.data_ptr():
                    continue
                if i in entry.viewed and a.stride() != buf.stride():
                    owner.ran_eagerly(f"input {i} of a piece at size {size}, of which it "
                                      f"returns a view, has strides {a.stride()}, captured "
                                      f"as {buf.stride()}")
                    return self.call_fn(*args)
                if i in entry.expanded:
                    if a.stride() != buf.stride():
                        owner.ran_eagerly(f"input {i} of a piece at size {size} has strides "
                                          f"{a.stride()}, captured expanded as "
                                          f"{buf.stride()}")
                        return self.call_fn(*args)
                    _distinct(buf).copy_(_distinct(a))
                else:
                    buf.copy_(a)
                copied.append(i)
            elif host is None and not same_value(buf, a):  # baked: captured again below
                host = i  # once every tensor fits (another shape runs eagerly instead)
        if host is not None:
            if self.host.changed(host, args[host], size):
                return self._recapture(size, args)
            owner.ran_eagerly(self.host.why(host, entry.static, args), kind="host value")
            return self.call_fn(*args)
        self.host.replayed(size)
        entry.graph.replay()
        for i in copied:
            # An expanded input: eager could not have written it (a write the analysis
            # could not tell from one of a copy: a conversion without example values).
            if i in self.writes and not repeats_memory(args[i]):
                args[i].copy_(entry.static[i])
        if not entry.aliases:
            return entry.outputs
        return _rebased(entry, args)

    def _recapture(self, size: int, args):
        entry = self.entries.pop(size)
        flat = entry.outputs if isinstance(entry.outputs, (tuple, list)) else (entry.outputs,)
        self.owner.static_ptrs -= {o.data_ptr() for o in flat if isinstance(o, torch.Tensor)}
        self.owner.stats["recaptures"] += 1
        return self._capture(size, args)

    def _capture(self, size: int, args):
        pool = self.owner.pool_for(args)
        # Read in place: parameters and buffers (the caller's) and earlier pieces' static
        # outputs (graphcap's); any other tensor from a static copy of its own.
        foreign = {i: a.data_ptr() for i, a in enumerate(args)
                   if isinstance(a, torch.Tensor) and self._foreign(i, a)}
        shared = {i: a.data_ptr() for i, a in enumerate(args) if i not in foreign
                  and isinstance(a, torch.Tensor) and a.data_ptr() in self.owner.static_ptrs}
        static = [a if i in foreign or i in shared or not isinstance(a, torch.Tensor)
                  else self._copy(a) for i, a in enumerate(args)]
        graph = pool.graph()
        captured = OneOpPiece(self.fn, self.writes) if self.opaque and graph.emulated \
            else self.call_fn
        try:
            outputs = graph.capture(captured, *static)
        except CaptureError as exc:
            if phases.current()[0] is not None:  # a runner's capture: the runner's error
                raise
            # torch.compile on its own: a piece that cannot be captured (a host value
            # copied to the device in its code, a host read, ...) runs eagerly at this
            # size from now on, said once; the compiled model works as it did eagerly.
            self.uncapturable[size] = (f"a piece of size {size} cannot be captured "
                                       f"({str(exc).splitlines()[0]})")
            return self._per_size(args)
        self.owner.stats["split_captures" if self.static_state else "captures"] += 1
        flat = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
        aliases = _views_of_copies(flat, args, static)
        if any(static[i].stride() != args[i].stride() for i, _ in aliases.values()):
            self.uncapturable[size] = (f"a piece of size {size} returns a view of an input "
                                       "that is not dense (its copy's layout differs)")
            return self._per_size(args)
        self.owner.static_ptrs |= {o.data_ptr() for k, o in enumerate(flat)
                                   if isinstance(o, torch.Tensor) and k not in aliases}
        # Weakly: a user's loop preparing new metadata per call must not keep the first
        # one (and its workspace) alive; once it is gone the split runs eagerly.
        state = weakref.ref(self.static_state()) if self.static_state is not None else None
        self.entries[size] = PieceEntry(graph, static, outputs, captured, foreign, shared,
                                        aliases, state)
        return self._per_size(args)


def _expanded(t: torch.Tensor) -> bool:
    return any(stride == 0 and n > 1 for n, stride in zip(t.shape, t.stride(), strict=True))


def _distinct(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each expanded dim (stride 0) narrowed to its one distinct element."""
    for dim, (n, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        if stride == 0 and n > 1:
            t = t.narrow(dim, 0, 1)
    return t


def _overlaps(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` share memory: each dim's stride, smallest first,
    must pass the furthest offset the smaller ones reach."""
    reach = 0
    for n, stride in sorted(((n, s) for n, s in zip(t.shape, t.stride(), strict=True)
                             if n > 1), key=lambda d: d[1]):
        if stride <= reach:
            return True
        reach += (n - 1) * stride
    return False


def _views_of_copies(flat, args, static) -> dict[int, tuple[int, int]]:
    """The outputs in ``flat`` that are views of an argument's static copy: output index ->
    (argument index, the view's offset from the copy's)."""
    copies = {storage_key(s): (i, s) for i, s in enumerate(static)
              if isinstance(s, torch.Tensor) and s is not args[i]}
    out = {}
    for k, o in enumerate(flat):
        if isinstance(o, torch.Tensor) and storage_key(o) in copies:
            i, s = copies[storage_key(o)]
            if o.dtype == s.dtype:  # a view of another dtype stays the copy's (its values)
                out[k] = (i, o.storage_offset() - s.storage_offset())
    return out


def _rebased(entry: PieceEntry, args):
    """``entry``'s outputs, each view of a copied argument made the same view of the
    caller's tensor."""
    outputs = entry.outputs
    flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    for k, (i, offset) in entry.aliases.items():
        o, a = flat[k], args[i]
        flat[k] = a.as_strided(o.shape, o.stride(), a.storage_offset() + offset)
    return type(outputs)(flat) if isinstance(outputs, (tuple, list)) else flat[0]


def run_boxed(fn, box: list):
    """``fn`` on the arguments in ``box``, which it empties first. An FX graph runs node
    by node (``torch.fx.Interpreter``), each value dropped after its last use, arguments
    included; any other callable (an Inductor piece) gets the arguments as a tuple, held
    for the call."""
    if not isinstance(fn, torch.fx.GraphModule):
        args = tuple(box)
        box.clear()
        return fn(*args)
    env = dict(zip((n for n in fn.graph.nodes if n.op == "placeholder"), box, strict=True))
    box.clear()
    interpreter = _Interpreter(fn)
    interpreter.extra_traceback = False  # the piece's own errors, as its code raises them
    return interpreter.run(initial_env=env)


class _Interpreter(torch.fx.Interpreter):
    """A piece node by node: an error says the model's line the node was traced from
    (the stack holds graphcap's frames, not the model's)."""

    def run_node(self, n):
        running = RUNNING_NODE.set(n)  # a refused host read names its line
        try:
            return super().run_node(n)
        except Exception as exc:
            site = traced_site(n)
            if site is not None and not (isinstance(exc, CaptureError) and exc.site == site):
                exc.graphcap_site = site  # CUDA's refusal, translated later, names it too
                exc.add_note(f"graphcap: at {site} (the model's line this op was traced from)")
            raise
        finally:
            RUNNING_NODE.reset(running)

