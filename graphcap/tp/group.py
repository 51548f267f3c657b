"""``TPGroup``: the ranks a model is split across, on torch.distributed.

Two process groups over the same ranks: ``data`` carries the model's collectives on the
world's backend (NCCL on GPUs, gloo on CPU), ``control`` (gloo, on the host) carries
graphcap's own agreement between the ranks. No rank waits for ever, and no rank goes on
alone:

- every call and every capture of a runner of a split model starts with an agreement
  (:meth:`TPGroup.agree`): every rank passes the same key (the route, the token count,
  each request's length), or every rank raises :class:`~graphcap.errors.RankError` naming
  each rank's key; a rank that refused its call (bad input) says so there, so the others
  raise too, and the group stays usable;
- the work between (:meth:`TPGroup.together`: warm-ups, captures, replays, eager runs)
  runs the ranks' collectives; a rank that raises there *closes* the group: it leaves the
  reason in the store of the world's rendezvous and drops its process groups, so a rank
  waiting in one of their collectives fails at once (gloo: the connection closes), and
  every later use of the group raises ``RankError`` naming the reason, on every rank;
- every wait has a bound: an agreement ``timeout_s``, a data collective
  ``collective_timeout_s`` (longer: ranks may compile at different speeds between two
  agreements). A rank that did not come in time closes the group the same way.

A closed group cannot be used again: restart the ranks (or make a new ``TPGroup`` on
every rank and build and capture the model again).

Example (every rank runs it, after ``torch.distributed.init_process_group``)::

    tp = TPGroup(timeout_s=5)
    model = build_model("llama3-8b", device="cuda", dtype=torch.bfloat16, tp=tp)
    runner = graphcap.capture(model, "full")      # warms tp up, agrees on every call
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import itertools
import math
import numbers
import sys
import time
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from graphcap import compat
from graphcap.errors import CaptureError, GraphcapError, RankError, clear_frames
from graphcap.tp import keys

_GROUPS: dict[str, TPGroup] = {}
_RELEASED: dict[str, str] = {}  # a released group's name -> why it closed
_NUMBERS = itertools.count()


def _seconds(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: give a positive number of seconds")
    return float(value)


class TPGroup:
    """Every rank of the world as one tensor-parallel group.

    ``name`` is how ops find the group (``graphcap::all_reduce(x, tp.name)``); every
    rank makes its groups in the same order, so a name means the same group on every
    rank. ``collectives`` counts the collectives this rank ran, by op name: eager calls,
    the graph emulator's replays and CUDA graph replays alike. ``timeout_s`` bounds how
    long :meth:`agree` waits for the other ranks, ``collective_timeout_s`` how long a
    collective of the model waits (gloo; NCCL's watchdog takes it as its timeout).
    ``closed``: why the group closed, or None while it is usable.
    """

    def __init__(self, timeout_s: float = 5.0, collective_timeout_s: float = 600.0):
        self.timeout_s = _seconds(timeout_s, "timeout_s")
        self.collective_timeout_s = _seconds(collective_timeout_s, "collective_timeout_s")
        if not (dist.is_available() and dist.is_initialized()):
            raise GraphcapError(
                "TPGroup needs torch.distributed: call torch.distributed."
                "init_process_group(...) on every rank first (torchrun sets its "
                "environment; one process per GPU)")
        self.data, self.control = _groups(self.timeout_s, self.collective_timeout_s)
        self.rank = dist.get_rank(self.data)
        self.size = dist.get_world_size(self.data)
        self.name = f"tp{next(_NUMBERS)}"
        self.collectives: Counter = Counter()
        self.closed: str | None = None
        self._store = compat.default_store()
        self._backend = str(dist.get_backend(self.data)).lower()
        self._warm = False
        _GROUPS[self.name] = self

    def __repr__(self) -> str:
        state = f", closed: {self.closed}" if self.closed else ""
        return f"TPGroup({self.name}: rank {self.rank} of {self.size}{state})"

    @property
    def device(self) -> torch.device:
        """Where the data group's collectives run: this rank's GPU under NCCL, else the
        CPU."""
        if "nccl" in self._backend:
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def warm_up(self) -> None:
        """Run one collective on each group, once: NCCL makes a communicator on its first
        use, which cannot happen inside a CUDA graph capture. The data collective also
        waits for ranks still loading their model (up to ``collective_timeout_s``)."""
        if self._warm:
            return
        self.meet("the group's warm-up", "warm-up")
        self.agree("warm-up", "the group's warm-up")
        self._warm = True

    def meet(self, what: str, op: str) -> None:
        """Return once every rank came to ``what``: one collective ``op`` on the data
        group, which waits up to ``collective_timeout_s`` (ranks still building or loading
        their model), where an agreement waits ``timeout_s``."""
        probe = torch.ones(1, device=self.device)
        with self.together(what):
            self.collective(lambda: dist.all_reduce(probe, group=self.data), op)
            if probe.is_cuda:
                torch.cuda.synchronize(probe.device)

    # -- agreement -------------------------------------------------------------------
    def agree(self, key: str, what: str, advice: str | None = None) -> None:
        """Return once every rank passed the same ``key`` for ``what``; else raise
        :class:`RankError` on every rank naming each rank's key and ``advice``, what to
        do (by default: make the same calls of a runner; the group stays usable). A rank
        that does not come within ``timeout_s``, or that closed the group, closes it here
        too, and ``RankError`` says why. What differs from rank to rank whatever the
        ranks do (each rank's own GPU, ``cuda:1``; an object's address) is not compared."""
        key = keys.rank_neutral(key)
        found, mine = self.gather(key, what), keys.decode(keys.encode(key))  # a long key: cut
        if any(k != mine for k in found):
            seen = ", ".join(f"rank {r}: {k}" for r, k in enumerate(found))
            changed = any(_CHANGED in k for k in found)  # a model changed on some ranks
            raise RankError(f"TP group {self.name}: the ranks disagree ({seen}) on {what}: "
                            f"{advice or (_CHANGES if changed else _SAME_CALLS)}")

    def agree_change(self, model: str, what: str) -> None:
        """A runner's call found this rank's model (``model``, its type) changed since capture
        (``what``): return once every rank's changed alike (each captures its share again), else
        :class:`RankError` on every rank naming each rank's change or, on a rank whose model did
        not change, its route (the group stays usable); each rank's GPU is not compared."""
        self.agree(f"{model}{_CHANGED}{what})", "a call of the runner")

    def gather(self, key: str, what: str) -> list[str]:
        """Every rank's ``key`` for ``what``, by rank (each rank passes one); a rank that
        does not come, or closed the group, as :meth:`agree`."""
        self._check_open(what)
        mine = keys.encode(key)
        found, start = [torch.empty_like(mine) for _ in range(self.size)], time.monotonic()
        handling = sys.exc_info()[1]  # the caller's: its frames are not ours to clear
        try:
            # Bounded by the control group's timeout: it ends before this returns, none pending.
            dist.all_gather(found, mine, group=self.control)
        except RuntimeError as exc:
            clear_frames(exc, handling)  # their locals hold the group open
            reasons = self._reasons()
            if reasons:
                message = (f"the group was closed ({reasons}) while rank {self.rank} was "
                           f"at {key!r} ({what})")
            else:
                message = (f"{_absent(start, self.timeout_s, what, exc)} (rank {self.rank} "
                           f"was at {key!r}): every rank must make the same calls of a split "
                           "model, in the same order")
            self._close(f"rank {self.rank}: {message}")
            raise RankError(f"TP group {self.name}: {message}. {_CLOSED}") from exc
        return [keys.decode(k) for k in found]

    @contextlib.contextmanager
    def entry(self, what: str, warm: bool = False):
        """The checks of ``what``, a public call of a split model (``generate()``,
        ``LLM.stream``, ``capture``) that every rank makes: a rank refusing it (any exception
        raised inside) says so, and the others raise ``RankError`` (ranks all refusing alike
        raise their own errors); else the ranks agree on a hash of the call's arguments, which
        the block appends to the list it gets (prompts of the same lengths per rank would
        otherwise pass every runner's agreement and each rank run another request's
        collectives). The group stays usable. ``warm``: warm the group up first (a capture: its
        collective waits for ranks still loading their model, longer than an agreement does)."""
        key: list[str] = []
        try:
            yield key
        except Exception as exc:  # any refusal: the others must hear of it
            if warm:
                self.warm_up()
            self.agree(f"refused ({type(exc).__name__}: {exc})", what, _SAME_ARGUMENTS)
            raise
        if warm:
            self.warm_up()
        self.agree(keys.digest(repr(key)), what, _SAME_ARGUMENTS)

    @contextlib.contextmanager
    def together(self, what: str):
        """The ranks' collectives of ``what`` (a warm-up, a capture, a replay, an eager
        run): when it raises on this rank, the group closes (see the module docstring)
        and the error goes on, with a note of what happened to the group."""
        self._check_open(what)
        handling = sys.exc_info()[1]  # the caller's: its frames are not ours to clear
        try:
            yield
        except BaseException as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            if not isinstance(exc, RankError):  # a peer's failure closed it already
                # A torch.distributed call's frames (its group argument) would hold the
                # data group open past its close: the others would wait to their timeout.
                clear_frames(exc, handling)
                self._close(f"rank {self.rank} raised {type(exc).__name__} in {what}"
                            + (f": {first}" if first else ""))
            exc.add_note(f"graphcap: TP group {self.name} is closed ({self.closed}). "
                         f"{_CLOSED}")
            raise

    def collective(self, run, op: str):
        """``run()``, a collective on the data group: a failure (a rank that closed the
        group, a timeout, a call torch refused: its backend's RuntimeError, or its own
        checks' ValueError or TypeError) raises ``RankError`` naming why, and closes the
        group here."""
        self._check_open(op)
        start, handling = time.monotonic(), sys.exc_info()[1]  # the caller's, not ours
        try:
            return run()
        except Exception as exc:  # noqa: BLE001  the others wait in it: none goes on alone
            # Their locals (and those of any error it was raised from) hold the group open.
            clear_frames(exc, handling)
            reasons = self._reasons()
            why = (f"the group was closed ({reasons})" if reasons else
                   _absent(start, self.collective_timeout_s, "it", exc))
            self._close(f"rank {self.rank}: {op} failed: {why}")
            raise RankError(f"TP group {self.name}: {op} failed on rank {self.rank}: {why}. "
                            f"{_CLOSED}") from exc

    # -- closing ---------------------------------------------------------------------
    def release(self, tell: bool = True) -> None:
        """Done with the group: destroy its process groups now, their gloo threads joined while
        the interpreter is whole (call it on every rank before ``destroy_process_group()``). Any
        later use raises ``RankError``; ``tell``: leave the reason for the other ranks too."""
        if self.closed is None and tell:
            self._close(f"rank {self.rank} released the group")
        self.closed = self.closed or "released"
        self._drop()
        _GROUPS.pop(self.name, None)
        _RELEASED[self.name] = self.closed  # what a later use of its name is told

    def _check_open(self, what: str) -> None:
        if self.closed is not None:
            raise RankError(f"TP group {self.name} is closed ({self.closed}), so {what} "
                            f"cannot run. {_CLOSED}")

    def _close(self, reason: str) -> None:
        """Leave ``reason`` for the other ranks, then drop both process groups: a rank
        waiting in one of their gloo collectives fails at once (its peer's connection
        closes) instead of at its timeout."""
        if self.closed is not None:
            return
        self.closed = reason
        try:
            self._store.set(self._key(self.rank), reason)
        except Exception:  # noqa: BLE001  the store is gone too: the groups still close
            pass
        self._drop()

    def _drop(self) -> None:
        """Destroy both process groups and drop this object's references to them: the
        C++ groups close their connections and join their threads (without the GIL)."""
        groups, self.data, self.control = (self.data, self.control), None, None
        for group in groups:
            if group is not None:
                with contextlib.suppress(Exception):  # destroyed already, with the world
                    dist.destroy_process_group(group)
        del groups
        gc.collect()  # the last references

    def _reasons(self) -> str:
        """What the ranks that closed the group left in the store ('' if none did)."""
        found = []
        for rank in range(self.size):
            key = self._key(rank)
            with contextlib.suppress(Exception):
                if self._store.check([key]):
                    found.append(self._store.get(key).decode(errors="replace"))
        return "; ".join(found)

    def _key(self, rank: int) -> str:
        return f"graphcap/{self.name}/closed/{rank}"


def _absent(start: float, bound: float, what: str, exc: BaseException) -> str:
    """Why a collective begun at ``start`` failed with ``exc``, no rank having left a
    reason: a rank that did not come within ``bound``; sooner, one whose process ended, or
    this rank's own call refused (torch's words tell which)."""
    if time.monotonic() - start < 0.9 * bound:
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return (f"a rank left the group (its process ended?) instead of coming to {what}, or "
                f"this rank's call was refused (torch.distributed: {said})")
    return f"a rank did not come to {what} within {bound:g} s"


def _groups(timeout_s: float, collective_s: float) -> tuple:
    """The data group (its collectives wait ``collective_s``) and the gloo group of the
    agreements (``timeout_s``) of every rank, each made waiting up to the longer for every
    rank: gloo meets them, NCCL makes the data group without meeting them (they come to the
    control group as far apart as they came to ``TPGroup()``); else ``RankError``."""
    ranks, patient, made = list(range(dist.get_world_size())), max(timeout_s, collective_s), []
    try:
        made.append(dist.new_group(ranks, timeout=timedelta(seconds=collective_s)))
        made.append(dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=patient)))
    except RuntimeError as exc:
        for group in made:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)
        raise RankError(f"a rank did not make its TPGroup within "
                        f"{patient if made else collective_s:g} s of rank {dist.get_rank()}: "
                        "every rank makes the same TPGroups, in the same order") from exc
    data, control = made
    if not compat.set_group_timeout(control, timeout_s) and patient != timeout_s:
        dist.destroy_process_group(control)  # a torch that cannot: made again, bounded
        control = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=timeout_s))
    return data, control


@atexit.register
def release_all() -> None:
    """:meth:`TPGroup.release` every group of this process; at exit, before the
    interpreter finalizes, for groups nobody released. A gloo thread that drops the last
    reference to a tensor of a collective needs the GIL, which it cannot take once
    finalization began: the process aborted ('terminate called without an active
    exception') when a group outlived ``destroy_process_group()`` and died only then."""
    for group in list(_GROUPS.values()):
        group.release(tell=False)  # the world's store may be gone with its host rank


_CHANGED = " changed since capture ("  # a rank's key naming its changed model


_CHANGES = ("a split model must change alike on every rank (each rank's share of the same "
            "new weights, in the same slots) or not at all: change the others' likewise, or "
            "undo the change, and call again on every rank (each captures its share again, "
            "unless on_change='error'), or call runner.recapture() on every rank")
_SAME_CALLS = ("every rank must make the same calls with inputs of the same shapes, so that "
               "each replays the same graph or runs the same batch eagerly")
_SAME_ARGUMENTS = ("every rank must make this call with the same arguments (each rank's hashed "
                   "above: for generate() and an LLM the prompts' token ids, not only lengths)")
_CLOSED = ("A closed group cannot be used again: restart the ranks (or make a new "
           "TPGroup on every rank, and build and capture the model again)")


def group_of(model) -> TPGroup | None:
    """The :class:`TPGroup` ``model`` is split across (its ``tp``), or None."""
    tp = getattr(model, "tp", None)
    return tp if isinstance(tp, TPGroup) else None


def entry(model, what: str, warm: bool = False):
    """:meth:`TPGroup.entry` of ``model``'s group where it is split, else a block that
    checks alone (its key None: nothing to agree on)."""
    tp = group_of(model)
    return tp.entry(what, warm) if tp is not None else contextlib.nullcontext()


def group_named(name: str) -> TPGroup:
    """The :class:`TPGroup` of this process called ``name``."""
    try:
        return _GROUPS[name]
    except KeyError:
        if name in _RELEASED:  # a split model called after its group's release
            raise RankError(f"TP group {name} is closed ({_RELEASED[name]}). {_CLOSED}") from None
        raise GraphcapError(
            f"no TP group named {name!r} in this process (it has {sorted(_GROUPS)}): make "
            "a graphcap.tp.TPGroup() on every rank and pass its name") from None


def check_finished(tree, where: str) -> None:
    """Refuse an asynchronous collective's result that nobody waited on (a functional
    collective's ``AsyncCollectiveTensor``) anywhere in ``tree``: it would finish
    outside the graph segment that launched it."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
    except ImportError:  # a torch without torch.distributed
        return
    for leaf in tree_flatten(tree)[0]:
        if isinstance(leaf, AsyncCollectiveTensor) and not leaf.completed:
            raise CaptureError(
                f"{where} got the result of an asynchronous collective that was not waited "
                "on: a collective must finish inside the graph segment that launched it. "
                "Wait first (torch.distributed._functional_collectives.wait_tensor) or use "
                "graphcap::all_reduce, which finishes where it runs")
