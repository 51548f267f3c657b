"""Prefill into a paged cache through a runner: :class:`CachePrefillInputs`, prefill's
kind of input whose forward also writes every token's K/V to its request's pages.

    runner = graphcap.capture(model, "full", max_tokens=2048,
                              inputs=CachePrefillInputs(cache, attention, slots=4))
    logits = runner(input_ids, positions, seq_lens=[700, 300], slots=[2, 0])

Beside prefill's token and position buffers, a buffer of each token's request slot is
staged with the call (padded tokens: none, so they write only the null page); each
shape's graph computes the tokens' places in the cache from it on the device. Each request's
prompt starts at position 0 and must fit what its slot was admitted for; attention is
among the new tokens (the attention backend's kernel).

With ``extend=True`` a request may continue one already in the cache (chunked prefill of a
long prompt, or a prompt on a cached prefix): ``runner(..., slots=[...], starts=[...])``,
``starts[r]`` the tokens of request ``r`` already cached (its first position; at most
what its slot holds), its positions ``starts[r] .. starts[r] + seq_lens[r] - 1``. (The
graphs take every token's position from ``starts`` and ``seq_lens``, as the cache counts
what is written: positions given otherwise are not what runs; ``check_inputs=True``
refuses them.) Every
token then attends over its request's pages up to itself (``graphcap::decode_attention``
with a row per token, its pages and length computed in the graph like a decode step's),
so one graph serves fresh prompts and continuations alike, under every strategy.

It is :class:`~graphcap.inputs.paged.PagedInputs` with requests of any length.
"""

from __future__ import annotations

from graphcap.inputs.paged import PagedInputs
from graphcap.kv.paged import PagedKVCache


class CachePrefillInputs(PagedInputs):
    """Prefill (and with ``extend``, extend) into ``cache``: requests of any length in
    ``slots`` request slots per shape; ``output_rows`` (None: the model's) 'tokens' or
    'requests' (the model takes each request's last row and returns one row each);
    ``hidden``: ``(logits, hidden)``, the hidden states of the same rows (a draft head's
    start); ``check_inputs``: token ids checked against the vocabulary and the positions
    given against the requests' starts (two host syncs a call, one each)."""

    def __init__(self, cache: PagedKVCache, attention, slots: int,
                 output_rows: str | None = None, name: str = "the model", extend: bool = False,
                 hidden: bool = False, check_inputs: bool = False):
        super().__init__(cache, None, attention=attention, slots=slots,
                         output_rows=output_rows, extend=extend, name=name, hidden=hidden,
                         check_inputs=check_inputs)
