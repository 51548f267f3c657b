"""Decode steps through a runner: :class:`DecodeInputs`, the kind of input of one token per
request over a paged cache.

    runner = graphcap.capture(model, "full", buckets=[1, 2, 3, 4, 6, 8],
                              inputs=DecodeInputs(cache))
    logits = runner(tokens, positions=[17, 5], slots=[0, 3])   # [2, vocab]

Buckets are batch sizes (default: the decode batch ladder to the cache's request slots,
1, 2, 3, 4, 6, 8, ...). Row ``b`` is token ``tokens[b]`` (a device tensor) at position
``positions[b]`` (host ints: the request's cached tokens before it) of the request in
slot ``slots[b]``. Each shape's graph computes, from the static buffers of tokens,
positions and request slots, each row's place in the cache, pages and length on the device
(:class:`~graphcap.kv.CacheBatch`), writes the rows' K/V and attends over the cache;
padded rows have no request slot (``-1``): they write only the null page and come out
zero. A replay stages two copies: the token ids (pad rows zeroed), and every row's
position and request slot, pads included, in one copy from a round of pinned host buffers
(with ``sample=True`` the call's rows of those and of the sampling parameters, one copy
each, pad rows filled).

The cache counts a row's token as written once the step has run (a step that raised
counts nothing, so no later step reads a place it did not write). With
``check_inputs=True`` the token ids are checked against the model's ``vocab_size``
before anything launches (one host sync a step: they live on the device); positions are
always checked against the model's ``max_position``, where it has one.

With ``sample=True`` the graph also draws each row's next token (``graphcap::sample``)
from per-row parameters staged with the step, ``runner(tokens, positions=[...],
slots=[...], sampling=[graphcap.Sampling(...), ...])`` returns the tokens ``[B]``, and
the parameters change between calls without a recapture.

``attention`` names the decode attention backend (``get_backend(kind="decode")``): None,
``graphcap::decode_attention`` with its kernel chosen per device, or ``"flashinfer"``.
It is :class:`~graphcap.inputs.paged.PagedInputs` with one token per request.
"""

from __future__ import annotations

from graphcap.inputs.paged import PagedInputs
from graphcap.kv.paged import PagedKVCache
from graphcap.opsdb.attention import DECODE_BACKENDS


class DecodeInputs(PagedInputs):
    """Decode steps: one token per request over ``cache``."""

    def __init__(self, cache: PagedKVCache, sample: bool = False,
                 attention: str | None = None, check_inputs: bool = False):
        if attention is not None and attention not in DECODE_BACKENDS:
            raise ValueError(f"attention={attention!r}: None (graphcap::decode_attention, "
                             f"its kernel chosen per device) or one of "
                             f"{sorted(set(DECODE_BACKENDS) - {'graphcap'})}")
        super().__init__(cache, 1, sample=sample, decode_attention=attention,
                         check_inputs=check_inputs)
