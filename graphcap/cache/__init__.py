"""K/V caches for decode: :class:`PagedKVCache`, what one forward reads of it
(:class:`CacheBatch`), decode steps through a runner (:class:`DecodeInputs`) and prefill
into the cache through one (:class:`CachePrefillInputs`)."""

from graphcap.cache.batch import CacheBatch
from graphcap.cache.inputs import DecodeInputs
from graphcap.cache.paged import NULL_PAGE, PagedKVCache
from graphcap.cache.prefill import CachePrefillInputs

__all__ = ["NULL_PAGE", "CacheBatch", "CachePrefillInputs", "DecodeInputs", "PagedKVCache"]
