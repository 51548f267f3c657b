"""Prefill into a paged cache through a runner: :class:`CachePrefillInputs`, prefill's
kind of input whose forward also writes every token's K/V to its request's pages.

    runner = graphcap.capture(model, "full", max_tokens=2048,
                              inputs=CachePrefillInputs(cache, attention, slots=4))
    logits = runner(input_ids, positions, seq_lens=[700, 300], slots=[2, 0])

Beside prefill's token and position buffers, a buffer of each token's request slot is
staged with the call (padded tokens: none, so they write only the null page); each
shape's graph computes the tokens' cache slots from it on the device. Each request's
prompt starts at position 0 and must fit what its slot was admitted for.
"""

from __future__ import annotations

import torch

from graphcap.cache.batch import CacheBatch
from graphcap.cache.paged import PagedKVCache
from graphcap.core.batch import staged
from graphcap.core.context import forward_context
from graphcap.core.inputs import Batch, PrefillInputs
from graphcap.errors import BadBatch


class CachePrefillInputs(PrefillInputs):
    kind = "prefill"

    def __init__(self, cache: PagedKVCache, attention, slots: int,
                 output_rows: str = "tokens", name: str = "the model"):
        super().__init__(cache.device, attention, slots, output_rows, name=name)
        self.cache = cache
        self._kv: dict[int, CacheBatch] = {}  # per bucket

    def check(self, args: tuple, kwargs: dict) -> Batch:
        if "slots" not in kwargs:
            raise BadBatch("a prefill into the cache is called as runner(input_ids, "
                           "positions, seq_lens=[...], slots=[...]): slots are the requests' "
                           "cache slots, admitted first")
        rest = {k: v for k, v in kwargs.items() if k != "slots"}
        batch = super().check(args, rest)
        slots = self.cache.requests(kwargs["slots"], len(batch.lens))
        self.cache.check_prompts(slots, batch.lens)
        per_token = [s for s, n in zip(slots, batch.lens, strict=True) for _ in range(n)]
        rows = staged(per_token, torch.long, self.device)  # pinned: no host sync
        return Batch((*batch.args, rows), batch.tokens, batch.lens)

    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        super().allocate(max_tokens, batch)
        self.buffers.append(torch.full((max_tokens,), -1, dtype=torch.long,
                                       device=self.device))

    def reset(self) -> None:
        super().reset()
        self._kv.clear()

    def prepare(self, bucket: int):
        meta = super().prepare(bucket)
        ids, positions, rows = (b[:bucket] for b in self.buffers)
        self._kv[bucket] = CacheBatch.prefill(self.cache, rows, positions)
        return meta

    def derive(self, meta) -> None:
        super().derive(meta)
        kv = self._kv[meta.num_tokens]
        _, positions, rows = (b[:meta.num_tokens] for b in self.buffers)
        kv.slots.copy_(self.cache.slots(rows, positions))

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
        self._wrote(batch)

    def _wrote(self, batch: Batch) -> None:
        """The cache counts each request's prompt as written (its slot: the request slot
        of its last token; an empty request writes nothing)."""
        rows, end = batch.args[2], 0
        for n in batch.lens:
            end += n
            if n:
                self.cache.wrote_prompt(int(rows[end - 1]), n)

    def context(self, meta):
        return forward_context(attention=meta, kv=self._kv[meta.num_tokens])

    def eager(self, model, batch: Batch):
        ids, positions, rows = batch.args
        meta = self.attention.prepare(batch.lens, self.device)
        kv = CacheBatch.prefill(self.cache, rows.to(self.device, non_blocking=True),
                                positions)
        args = (ids, positions, meta.last_token_rows()) if self.per_request else (ids,
                                                                                  positions)

        def run():
            with forward_context(attention=meta, kv=kv):
                out = model(*args)
            kv.check_written(model)
            self._wrote(batch)
            return out
        return run
