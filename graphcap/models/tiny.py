"""Deprecated: graphcap's reference decoder is :mod:`graphcap.models.decoder` (the
decoder behind every preset, ``tiny`` to ``llama3-8b``)."""

import warnings

from graphcap.models.decoder import MLP, Attention, Block, Decoder, ModelArgs, shard_args
from graphcap.opsdb.reference import rope_cache

warnings.warn("graphcap.models.tiny is deprecated: import from graphcap.models.decoder "
              "(or graphcap.models)", DeprecationWarning, stacklevel=2)

__all__ = ["MLP", "Attention", "Block", "Decoder", "ModelArgs", "rope_cache", "shard_args"]
