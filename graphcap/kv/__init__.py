"""The paged K/V cache as data: :class:`PagedKVCache` (pages, their owners, what each
request slot wrote) and :class:`CacheBatch` (what one forward reads of it). Ops read
these; nothing here imports above :mod:`graphcap.core`."""

from graphcap.kv.batch import CacheBatch
from graphcap.kv.paged import NULL_PAGE, PagedKVCache, longest_window

__all__ = ["NULL_PAGE", "CacheBatch", "PagedKVCache", "longest_window"]
