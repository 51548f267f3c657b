"""``graphcap.packed``: a model of packed requests called eagerly, outside a runner."""

from __future__ import annotations

import contextlib

import torch

from graphcap.core.checks import host_lengths
from graphcap.core.context import forward_context
from graphcap.core.inputs import check_packing
from graphcap.kv.batch import CacheBatch
from graphcap.opsdb.attention import get_backend


@contextlib.contextmanager
def packed(seq_lens, device, attention: str | None = None, dtype: torch.dtype | None = None,
           kv=None, options=()):
    """Call a model of packed requests eagerly, outside a runner: prepares the attention
    metadata of requests of these lengths (host values) and makes it the forward context,
    which ``graphcap::attention`` reads. ``attention``: the backend (default: the best on
    ``device`` for q/k/v of ``dtype``; without ``dtype``, the best that runs every dtype,
    as the forward's is not known here; computing the variant ``options`` the model's
    layers use, :mod:`.variant`); ``kv``: a :class:`graphcap.kv.CacheBatch` the
    forward writes its K/V to (prefill into a paged cache). Yields the metadata
    (``meta.last_token_rows()``: the row of each request's last token). Leaving the
    block, a call of several requests whose forward ran no graphcap attention raises
    :class:`~graphcap.errors.UnsupportedModel`: its attention could not see where the
    requests begin and end.

        with graphcap.packed([5, 3], device="cpu"):
            logits = model(input_ids, positions)      # 8 tokens: two requests
    """
    device = torch.device(device)
    lens = host_lengths(seq_lens)
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (torch.bfloat16, ...), got {dtype!r}")
    if kv is not None and not isinstance(kv, CacheBatch):
        raise TypeError(f"kv must be a graphcap.kv.CacheBatch (a cache's writes for these "
                        f"requests) or None, got {type(kv).__name__}")
    if isinstance(options, (str, bytes)) or not hasattr(options, "__iter__"):
        raise TypeError(f"options must be a list of the variant options the model's layers "
                        f"use ('window', 'softcap', 'sinks'), got {options!r}")
    if attention is None and dtype is None:
        dtype = torch.float32  # the backends that run float32 run every dtype
    meta = get_backend(attention, device, dtype=dtype, options=options).prepare(lens, device)
    with forward_context(attention=meta, kv=kv):
        yield meta
    if not meta.attended:
        check_packing(f"the model called under graphcap.packed({lens})", meta.backend.name,
                      lens)
