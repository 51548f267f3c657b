"""Tensor-parallel collectives as opsdb ops: ``graphcap::all_reduce`` (the sum over the
ranks of a :class:`graphcap.tp.TPGroup`) and ``graphcap::all_gather`` (the ranks' tensors
concatenated along a dim), both out of place.

The group is an argument by name, so Dynamo sees one opaque op (tc_piecewise), a CUDA
graph captures the collective (NCCL since 2.9; the group's ``warm_up`` first), and the
graph emulator re-runs it on every replay. Kernel ``torch``: torch.distributed on the
group's data backend (NCCL on GPUs, gloo on CPU). Every collective run counts in the
group's ``collectives``: eagerly, in the emulator, and in every replay of a CUDA graph
that captured it (not at the capture, which runs nothing). A collective that fails where
the host waits for it (gloo: a rank closed the group, or did not come in time) raises
``RankError`` (:meth:`graphcap.tp.TPGroup.collective`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from graphcap.core.cuda_graph import on_replay
from graphcap.opsdb import checks
from graphcap.opsdb.spec import register_op
from graphcap.tp.group import group_named


def _count(g, op: str) -> None:
    if not on_replay(lambda: g.collectives.update((op,))):
        g.collectives[op] += 1


def all_reduce(x: torch.Tensor, group: str) -> torch.Tensor:
    g = group_named(group)
    out = x.clone()
    g.collective(lambda: dist.all_reduce(out, group=g.data), "all_reduce")
    _count(g, "all_reduce")  # once it ran (a refused or failed one is not counted)
    return out


def all_gather(x: torch.Tensor, dim: int, group: str) -> torch.Tensor:
    g = group_named(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(g.size)]
    g.collective(lambda: dist.all_gather(parts, x, group=g.data), "all_gather")
    _count(g, "all_gather")
    return torch.cat(parts, dim=dim)


def _check_reduce(x, group):
    checks.tensor("all_reduce", "x", x)


def _check_gather(x, dim, group):
    checks.tensor("all_gather", "x", x)
    if not -x.dim() <= dim < x.dim():
        raise checks.OpInputError(f"all_gather: dim {dim} of a {x.dim()}-d tensor")


def _fake_gather(x, dim, group):
    shape = list(x.shape)
    shape[dim] *= group_named(group).size
    return x.new_empty(shape)


ALL_REDUCE = register_op(
    "graphcap::all_reduce", "(Tensor x, str group) -> Tensor",
    reference=all_reduce, fake=lambda x, group: torch.empty_like(x), check=_check_reduce,
    doc="the sum of x over the ranks of a TP group (out of place)",
)
ALL_GATHER = register_op(
    "graphcap::all_gather", "(Tensor x, int dim, str group) -> Tensor",
    reference=all_gather, fake=_fake_gather, check=_check_gather,
    doc="the ranks' x of a TP group concatenated along dim",
)
