"""Deprecated: ``graphcap.cache`` was split by floor. The paged cache is
:mod:`graphcap.kv` (``PagedKVCache``, ``CacheBatch``, ``NULL_PAGE``), the kinds of input
over it :mod:`graphcap.inputs` (``DecodeInputs``, ``CachePrefillInputs``), the eager
steps and ``generate`` :mod:`graphcap.engine`."""

import warnings

from graphcap.inputs import CachePrefillInputs, DecodeInputs
from graphcap.kv import NULL_PAGE, CacheBatch, PagedKVCache

warnings.warn("graphcap.cache is deprecated: import PagedKVCache from graphcap.kv, "
              "DecodeInputs and CachePrefillInputs from graphcap.inputs, decode_step and "
              "prefill from graphcap.engine", DeprecationWarning, stacklevel=2)

__all__ = ["NULL_PAGE", "CacheBatch", "CachePrefillInputs", "DecodeInputs", "PagedKVCache"]
