"""Tensor parallelism on torch.distributed: :class:`TPGroup` (the ranks a model is split
across) and the splitting of graphcap's reference decoders (docs/tp.md)."""

from graphcap.dist.group import TPGroup, check_finished, group_named, release_all
from graphcap.dist.shard import shard_args, shard_model, shard_tensor

__all__ = ["TPGroup", "check_finished", "group_named", "release_all", "shard_args",
           "shard_model", "shard_tensor"]
