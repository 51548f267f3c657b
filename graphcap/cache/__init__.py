"""K/V caches for decode: :class:`PagedKVCache`."""

from graphcap.cache.paged import NULL_PAGE, PagedKVCache

__all__ = ["NULL_PAGE", "PagedKVCache"]
