"""K/V caches for decode: :class:`PagedKVCache`, what one forward reads of it
(:class:`CacheBatch`), and decode steps through a runner (:class:`DecodeInputs`)."""

from graphcap.cache.batch import CacheBatch
from graphcap.cache.inputs import DecodeInputs
from graphcap.cache.paged import NULL_PAGE, PagedKVCache

__all__ = ["NULL_PAGE", "CacheBatch", "DecodeInputs", "PagedKVCache"]
