"""Deprecated: ``graphcap.dist`` was split in two. Import :class:`TPGroup` (and
``release_all``, ``group_named``, ``check_finished``) from :mod:`graphcap.tp`, and
``shard_model``, ``shard_args``, ``shard_tensor`` from :mod:`graphcap.models`."""

import warnings

from graphcap.models.shard import shard_args, shard_model, shard_tensor
from graphcap.tp import TPGroup, check_finished, group_named, release_all

warnings.warn("graphcap.dist is deprecated: import TPGroup from graphcap.tp and "
              "shard_model from graphcap.models", DeprecationWarning, stacklevel=2)

__all__ = ["TPGroup", "check_finished", "group_named", "release_all", "shard_args",
           "shard_model", "shard_tensor"]
