"""``TPGroup``: the ranks a model is split across, on torch.distributed.

Two process groups over the same ranks: ``data`` carries the model's collectives on the
world's backend (NCCL on GPUs, gloo on CPU), ``control`` (gloo, on the host) carries
graphcap's own agreement between the ranks, so that a rank that disagrees or stays away
ends in an error on every rank after at most ``timeout_s``, never in a collective that
waits for ever.

Example (every rank runs it, after ``torch.distributed.init_process_group``)::

    tp = TPGroup(timeout_s=5)
    model = build_model("llama3-8b", device="cuda", dtype=torch.bfloat16, tp=tp)
    runner = graphcap.capture(model, "full")      # warms tp up, agrees on every call
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections import Counter
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from graphcap.errors import CaptureError, GraphcapError

_GROUPS: dict[str, TPGroup] = {}
_NUMBERS = itertools.count()
_KEY_BYTES = 256  # what agree() compares: a key's UTF-8 bytes, long ones hashed


class TPGroup:
    """Every rank of the world as one tensor-parallel group.

    ``name`` is how ops find the group (``graphcap::all_reduce(x, tp.name)``); every
    rank makes its groups in the same order, so a name means the same group on every
    rank. ``collectives`` counts the collectives this rank ran, by op name: eager calls,
    the graph emulator's replays and CUDA graph replays alike. ``timeout_s`` bounds how
    long :meth:`agree` waits for the other ranks.
    """

    def __init__(self, timeout_s: float = 5.0):
        if not (dist.is_available() and dist.is_initialized()):
            raise GraphcapError(
                "TPGroup needs torch.distributed: call torch.distributed."
                "init_process_group(...) on every rank first (torchrun sets its "
                "environment; one process per GPU)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) \
                or not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s!r}: give a positive number of seconds")
        self.timeout_s = float(timeout_s)
        ranks = list(range(dist.get_world_size()))
        self.data = dist.new_group(ranks)
        self.control = dist.new_group(ranks, backend="gloo",
                                      timeout=timedelta(seconds=self.timeout_s))
        self.rank = dist.get_rank(self.data)
        self.size = dist.get_world_size(self.data)
        self.name = f"tp{next(_NUMBERS)}"
        self.collectives: Counter = Counter()
        self._warm = False
        _GROUPS[self.name] = self

    def __repr__(self) -> str:
        return f"TPGroup({self.name}: rank {self.rank} of {self.size})"

    @property
    def device(self) -> torch.device:
        """Where the data group's collectives run: this rank's GPU under NCCL, else the
        CPU."""
        if "nccl" in str(dist.get_backend(self.data)).lower():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def warm_up(self) -> None:
        """Run one collective on each group, once: NCCL makes a communicator on its first
        use, which cannot happen inside a CUDA graph capture."""
        if self._warm:
            return
        probe = torch.ones(1, device=self.device)
        dist.all_reduce(probe, group=self.data)
        if probe.is_cuda:
            torch.cuda.synchronize(probe.device)
        self.agree("warm-up", "the group's warm-up")
        self._warm = True

    def agree(self, key: str, what: str) -> None:
        """Return once every rank passed the same ``key`` for ``what``; else raise
        :class:`CaptureError` on every rank naming each rank's key, or, when a rank does
        not come within ``timeout_s``, on the ranks that came. A runner of a split model
        calls it before a capture (the shape list) and before each call (its route)."""
        mine = _encode(key)
        keys = [torch.empty_like(mine) for _ in range(self.size)]
        try:
            work = dist.all_gather(keys, mine, group=self.control, async_op=True)
            work.wait(timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:  # gloo's timeout, or a rank that went away
            raise CaptureError(
                f"TP group {self.name}: a rank did not come to {what} within "
                f"{self.timeout_s:g} s (rank {self.rank} was at {key!r}): every rank must "
                "make the same calls of a split model, in the same order. The group is out "
                "of step now: restart the ranks") from exc
        if any(not torch.equal(k, mine) for k in keys):
            seen = ", ".join(f"rank {r}: {_decode(k)}" for r, k in enumerate(keys))
            raise CaptureError(
                f"TP group {self.name}: the ranks disagree ({seen}) on {what}: every rank "
                "must make the same calls with inputs of the same shapes, so that each "
                "replays the same graph or runs the same batch eagerly")


def group_named(name: str) -> TPGroup:
    """The :class:`TPGroup` of this process called ``name``."""
    try:
        return _GROUPS[name]
    except KeyError:
        raise GraphcapError(
            f"no TP group named {name!r} in this process (it has {sorted(_GROUPS)}): make "
            "a graphcap.dist.TPGroup() on every rank and pass its name") from None


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


def _encode(key: str) -> torch.Tensor:
    raw = key.encode()
    if len(raw) > _KEY_BYTES:
        digest = hashlib.sha256(raw).hexdigest()[:16].encode()
        raw = raw[:_KEY_BYTES - len(digest) - 3] + b"..." + digest
    out = torch.zeros(_KEY_BYTES, dtype=torch.uint8)
    out[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return out


def _decode(encoded: torch.Tensor) -> str:
    return bytes(encoded.tolist()).rstrip(b"\0").decode(errors="replace")
