"""Tensor parallelism on torch.distributed: :class:`TPGroup`, the ranks a model is split
across (docs/tp.md). The splitting of graphcap's reference decoders is
:mod:`graphcap.models.shard`."""

from graphcap.tp.group import TPGroup, check_finished, group_named, release_all

__all__ = ["TPGroup", "check_finished", "group_named", "release_all"]
