"""K/V caches for decode: :class:`PagedKVCache`, and what one forward reads of it,
:class:`CacheBatch`."""

from graphcap.cache.batch import CacheBatch
from graphcap.cache.paged import NULL_PAGE, PagedKVCache

__all__ = ["NULL_PAGE", "CacheBatch", "PagedKVCache"]
