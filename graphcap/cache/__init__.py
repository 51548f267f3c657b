"""The kinds of input over the paged cache: decode steps through a runner
(:class:`DecodeInputs`) and prefill into the cache through one
(:class:`CachePrefillInputs`). The cache itself is :mod:`graphcap.kv` (its names are
importable from here too)."""

from graphcap.cache.inputs import DecodeInputs
from graphcap.cache.prefill import CachePrefillInputs
from graphcap.kv import NULL_PAGE, CacheBatch, PagedKVCache

__all__ = ["NULL_PAGE", "CacheBatch", "CachePrefillInputs", "DecodeInputs", "PagedKVCache"]
