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
what its slot holds), its positions ``starts[r] .. starts[r] + seq_lens[r] - 1``. Every
token then attends over its request's pages up to itself (``graphcap::decode_attention``
with a row per token, its pages and length computed in the graph like a decode step's),
so one graph serves fresh prompts and continuations alike, under every strategy.
"""

from __future__ import annotations

import torch

from graphcap.core.checks import as_int, staged
from graphcap.core.context import forward_context
from graphcap.core.inputs import Batch
from graphcap.errors import BadBatch
from graphcap.inputs.prefill import PrefillInputs
from graphcap.kv.batch import CacheBatch
from graphcap.kv.paged import PagedKVCache


class CachePrefillInputs(PrefillInputs):
    kind = "prefill"

    def __init__(self, cache: PagedKVCache, attention, slots: int,
                 output_rows: str = "tokens", name: str = "the model", extend: bool = False):
        super().__init__(cache.device, attention, slots, output_rows, name=name)
        self.cache, self.extend = cache, extend
        self._kv: dict[int, CacheBatch] = {}  # per bucket

    def check(self, args: tuple, kwargs: dict) -> Batch:
        if "slots" not in kwargs:
            raise BadBatch("a prefill into the cache is called as runner(input_ids, "
                           "positions, seq_lens=[...], slots=[...]): slots are the requests' "
                           "cache slots, admitted first")
        if "starts" in kwargs and not self.extend:
            raise BadBatch("starts= continues requests already in the cache, which needs "
                           "CachePrefillInputs(..., extend=True); without it each prompt "
                           "starts at position 0")
        rest = {k: v for k, v in kwargs.items() if k not in ("slots", "starts")}
        batch = super().check(args, rest)
        slots = self.cache.requests(kwargs["slots"], len(batch.lens))
        starts = self._starts(kwargs.get("starts"), slots, batch.lens)
        per_token = [s for s, n in zip(slots, batch.lens, strict=True) for _ in range(n)]
        rows = staged(per_token, torch.long, self.device)  # pinned: no host sync
        ends = [(s, b + n) for s, b, n in zip(slots, starts, batch.lens, strict=True) if n]
        return Batch((*batch.args, rows), batch.tokens, batch.lens, host=ends)

    def _starts(self, given, slots: list[int], lens: list[int]) -> list[int]:
        """Each request's first position, checked against its slot's tokens (``BadBatch``)."""
        if given is None:
            starts = [0] * len(slots)
        else:
            starts = [as_int(b, "starts", BadBatch) for b in given]
            if len(starts) != len(slots):
                raise BadBatch(f"starts has {len(starts)} entries for {len(slots)} requests")
        for slot, start in zip(slots, starts, strict=True):
            written = self.cache.written(slot)
            if not 0 <= start <= written:
                raise BadBatch(f"starts: request slot {slot} starts at {start}, but its "
                               f"pages hold {written} tokens; a request continues at most "
                               "from its last written token")
        self.cache.check_prompts(slots, [b + n for b, n in zip(starts, lens, strict=True)])
        return starts

    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        super().allocate(max_tokens, batch)
        self.buffers.append(torch.full((max_tokens,), -1, dtype=torch.long,
                                       device=self.device))

    def reset(self) -> None:
        super().reset()
        self._kv.clear()

    def _cache_batch(self, rows, positions) -> CacheBatch:
        if self.extend:
            return CacheBatch.paged(self.cache, rows, positions)
        return CacheBatch.prefill(self.cache, rows, positions)

    def prepare(self, bucket: int):
        meta = super().prepare(bucket)
        ids, positions, rows = (b[:bucket] for b in self.buffers)
        self._kv[bucket] = self._cache_batch(rows, positions)
        return meta

    def derive(self, meta) -> None:
        super().derive(meta)
        kv = self._kv[meta.num_tokens]
        _, positions, rows = (b[:meta.num_tokens] for b in self.buffers)
        kv.refresh(self._cache_batch(rows, positions))

    def forward(self, model, bucket: int, meta):
        ids, positions, _ = (b[:bucket] for b in self.buffers)
        args = [ids, positions] + ([self.last_rows] if self.per_request else [])
        kv = self._kv[bucket]
        kv.written.clear()
        with forward_context(attention=meta, kv=kv):
            out = model(*args)
        kv.check_written(model)
        return out

    def stage(self, batch: Batch, bucket: int, meta) -> None:
        super().stage(batch, bucket, meta)
        if batch.tokens < bucket:
            self.buffers[2][batch.tokens:bucket].fill_(-1)  # pads: no request slot

    def commit(self, batch: Batch) -> None:
        """The cache counts each request's tokens up to its last one as written (what
        follows in its pages is stale)."""
        self.cache.wrote(batch.host)

    def describe(self, batch: Batch) -> str:
        return f"{super().describe(batch)}, (slot, length) {batch.host}"

    def context(self, meta):
        return forward_context(attention=meta, kv=self._kv[meta.num_tokens])

    def eager(self, model, batch: Batch):
        ids, positions, rows = batch.args
        meta = self.attention.prepare(batch.lens, self.device)
        kv = self._cache_batch(rows.to(self.device, non_blocking=True), positions)
        args = (ids, positions, meta.last_token_rows()) if self.per_request else (ids,
                                                                                  positions)

        def run():
            with forward_context(attention=meta, kv=kv):
                out = model(*args)
            kv.check_written(model)
            return out
        return run
