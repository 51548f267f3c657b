"""Decode steps through a runner: :class:`DecodeInputs`, the kind of input of one token per
request over a paged cache.

    runner = graphcap.capture(model, "full", buckets=[1, 2, 3, 4, 6, 8],
                              inputs=DecodeInputs(cache))
    logits = runner(tokens, positions=[17, 5], slots=[0, 3])   # [2, vocab]

Buckets are batch sizes. Row ``b`` is token ``tokens[b]`` (a device tensor) at position
``positions[b]`` (host ints: the request's cached tokens before it) of the request in
slot ``slots[b]``. Each shape's graph computes, from the static buffers of tokens,
positions and request slots, each row's place in the cache, pages and length on the device
(:class:`~graphcap.kv.CacheBatch`), writes the rows' K/V and attends over the cache;
padded rows have no request slot (``-1``): they write only the null page and come out
zero. A replay stages three copies of at most the bucket's rows.

The cache counts a row's token as written once the step has run (a step that raised
counts nothing, so no later step reads a place it did not write). With
``check_inputs=True`` the token ids are checked against the model's ``vocab_size``
before anything launches (one host sync a step: they live on the device); positions are
always checked against the model's ``max_position``, where it has one.

With ``sample=True`` the graph also draws each row's next token (``graphcap::sample``)
from per-row parameters staged with the step, ``runner(tokens, positions=[...],
slots=[...], sampling=[graphcap.Sampling(...), ...])`` returns the tokens ``[B]``, and
the parameters change between calls without a recapture.
"""

from __future__ import annotations

import torch

from graphcap.core.checks import as_int, check_token_ids, staged
from graphcap.core.context import forward_context
from graphcap.core.inputs import Batch, Inputs
from graphcap.errors import BackendUnavailable, BadBatch, UnsupportedModel
from graphcap.inputs.sampling import Sampling, host_tensors
from graphcap.kv.batch import CacheBatch
from graphcap.kv.paged import PagedKVCache
from graphcap.opsdb.attention import flashinfer_decode
from graphcap.opsdb.sample import SAMPLE

_INTS = (torch.int32, torch.int64)


class DecodeInputs(Inputs):
    kind = "decode"
    row_unit = "one row per request (one token each)"

    def __init__(self, cache: PagedKVCache, sample: bool = False,
                 attention: str | None = None, check_inputs: bool = False):
        super().__init__(cache.device)
        if attention not in (None, "flashinfer"):
            raise ValueError(f"attention={attention!r}: None (graphcap::decode_attention, "
                             "its kernel chosen per device) or 'flashinfer'")
        if attention == "flashinfer" and flashinfer_decode.why_not(cache):
            raise BackendUnavailable(f"decode attention 'flashinfer' "
                                     f"{flashinfer_decode.why_not(cache)}")
        self.cache, self.sample, self.attention = cache, sample, attention
        # FlashInfer: a plan per row count, and what they share (the query heads and
        # scale a run saw, the workspace).
        self._plans: dict[int, flashinfer_decode.FlashInferDecode] = {}
        self._shared: dict = {}
        self.per_request = False  # the model takes each row's output row (bind)
        self.check_inputs = check_inputs
        self.vocab_size: int | None = None  # with check_inputs: token ids' bound (bind)
        self.max_position: int | None = None  # positions' bound, where the model has one
        # Each row's output row (a model of output_rows="requests": one row per request).
        self._last = torch.arange(cache.max_requests, device=self.device)
        if sample:
            self.row_unit = "one token per request (drawn in the graph)"

    def bind(self, model) -> None:
        rows = getattr(model, "output_rows", "tokens")
        if rows not in ("tokens", "requests"):
            raise UnsupportedModel(f"{type(model).__name__}.output_rows is {rows!r}: use "
                                   "'tokens' or 'requests' (one row per request)")
        self.per_request = rows == "requests"
        max_position = getattr(model, "max_position", None)
        self.max_position = as_int(max_position, "max_position") if max_position else None
        if self.check_inputs:
            vocab = getattr(model, "vocab_size", None)
            if vocab is None:
                raise UnsupportedModel(
                    f"check_inputs=True checks token ids against the model's vocab_size, "
                    f"which {type(model).__name__} does not have: set model.vocab_size")
            self.vocab_size = as_int(vocab, "vocab_size")

    # -- a call ----------------------------------------------------------------------
    def check(self, args: tuple, kwargs: dict) -> Batch:
        known = {"positions", "slots"} | ({"sampling"} if self.sample else set())
        unknown = sorted(set(kwargs) - known)
        if len(args) != 1 or unknown or "positions" not in kwargs or "slots" not in kwargs:
            raise BadBatch("a decode step is called as runner(tokens, positions=[...], "
                           "slots=[...]" + (", sampling=[...]" if self.sample else "")
                           + f"); got {len(args)} arguments and keywords {sorted(kwargs)}")
        tokens = args[0]
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 1 or \
                tokens.dtype not in _INTS or tokens.device != self.device:
            raise BadBatch(f"tokens must be a 1-D int64 (or int32) tensor on {self.device}, "
                           "one per request")
        rows = tokens.shape[0]
        positions = self._host_ints(kwargs["positions"], "positions", rows)
        if rows == 0:
            raise BadBatch("empty step: at least one request is needed")
        slots = self.cache.requests(kwargs["slots"], rows)
        params = self._sampling(kwargs.get("sampling"), rows) if self.sample else None
        self.cache.check_step(slots, positions)
        if self.max_position is not None and max(positions) >= self.max_position:
            raise BadBatch(f"positions {positions} reach past the model's max_position "
                           f"{self.max_position}")
        if self.check_inputs:  # one host sync: the tokens live on the device
            check_token_ids(tokens, self.vocab_size)
        host = staged([positions, slots], torch.long, self.device)  # no host sync to copy
        ends = [(slot, position + 1) for slot, position in zip(slots, positions, strict=True)]
        args = (tokens, host[0], host[1])
        if self.sample:
            args += host_tensors(params, self.device)
        return Batch(args, rows, host=ends)

    def commit(self, batch: Batch) -> None:
        """Each row's token is cached now, at its position (the request's tokens after it
        are stale)."""
        self.cache.wrote(batch.host)

    def describe(self, batch: Batch) -> str:
        return f"{batch.tokens} requests, (slot, length) {batch.host}"

    @staticmethod
    def _sampling(given, rows: int) -> list[Sampling]:
        params = [Sampling()] * rows if given is None else list(given)
        if len(params) != rows or not all(isinstance(p, Sampling) for p in params):
            raise BadBatch(f"sampling must be {rows} graphcap.Sampling (one per row) or "
                           f"None (greedy), got {given!r}")
        return params

    @staticmethod
    def _host_ints(values, name: str, rows: int) -> list[int]:
        if isinstance(values, torch.Tensor):
            if values.device.type != "cpu":
                raise BadBatch(f"{name} must be host ints (a list or a CPU tensor): the "
                               "runner validates them without reading the device")
            values = values.tolist()
        try:
            out = [int(v) for v in values]
        except (TypeError, ValueError):
            raise BadBatch(f"{name} must be a list of ints, got {values!r}") from None
        if any(isinstance(v, bool) or int(v) != v for v in values) or len(out) != rows:
            raise BadBatch(f"{name} must be {rows} ints (one per token), got {values!r}")
        return out

    # -- static buffers and each shape's state ---------------------------------------
    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        tokens = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        rows = torch.full((max_tokens,), -1, dtype=torch.long, device=self.device)
        self.buffers = [tokens, torch.zeros_like(tokens), rows]
        if self.sample:  # temperature, top_k, top_p, seed per row (pads: greedy)
            self.buffers += [torch.zeros(max_tokens, dtype=dtype, device=self.device)
                             for dtype in (torch.float32, torch.long, torch.float32,
                                           torch.long)]
        self._last = torch.arange(max_tokens, device=self.device)

    def prepare(self, bucket: int) -> CacheBatch:
        tokens, positions, rows = (b[:bucket] for b in self.buffers[:3])
        return self._paged(rows, positions, bucket)

    def _paged(self, rows, positions, count: int, host=None) -> CacheBatch:
        """The step's cache state; with FlashInfer the plan of ``count`` rows (one per
        row count, shared by the shape of that bucket and eager calls of that many rows:
        each replay plans again first), of ``host`` (positions and slots) when given,
        else of pads only."""
        kv = CacheBatch.paged(self.cache, rows, positions)
        if self.attention == "flashinfer":
            kv.plan = self._plans.get(count)
            if kv.plan is None:
                kv.plan = self._plans[count] = flashinfer_decode.FlashInferDecode(
                    self.cache, count, self._shared)
            kv.plan.plan(*(host if host is not None else ([], [])))
        return kv

    def derive(self, kv: CacheBatch) -> None:
        """Each row's place in the cache, pages and length, from the staged rows and positions,
        into the shape's buffers (inside the graph: no host work per replay)."""
        bucket = kv.cache_loc.shape[0]
        _, positions, rows = (b[:bucket] for b in self.buffers[:3])
        kv.refresh(CacheBatch.paged(self.cache, rows, positions))

    def forward(self, model, bucket: int, kv: CacheBatch):
        tokens, positions, _, *params = (b[:bucket] for b in self.buffers)
        kv.written.clear()
        with forward_context(kv=kv):
            out = self._call(model, tokens, positions, params)
        kv.check_written(model)
        return out

    def _call(self, model, tokens, positions, params):
        """The model's logits of each row, or with ``sample`` the token drawn from them
        (``graphcap::sample``, the counter the position the token takes)."""
        if self.per_request:  # one row per request: each row is its request's last token
            logits = model(tokens, positions, self._last[:tokens.shape[0]])
        else:
            logits = model(tokens, positions)
        if not self.sample:
            return logits
        return SAMPLE(logits, *params, positions + 1)

    def stage(self, batch: Batch, bucket: int, kv: CacheBatch) -> None:
        self.copy_in(batch, bucket)
        if batch.tokens < bucket:
            self.buffers[2][batch.tokens:bucket].fill_(-1)  # pads: no request slot
        if kv.plan is not None:  # outside the graph, from the host values
            kv.plan.plan(batch.args[1], batch.args[2])

    def context(self, kv: CacheBatch):
        return forward_context(kv=kv)

    def eager(self, model, batch: Batch):
        tokens, positions, rows, *params = batch.args
        positions, rows, *params = (t.to(self.device, non_blocking=True)
                                    for t in (positions, rows, *params))
        kv = self._paged(rows, positions, tokens.shape[0], batch.args[1:3])

        def run():
            with forward_context(kv=kv):
                out = self._call(model, tokens, positions, params)
            kv.check_written(model)
            return out
        return run

    def limits(self) -> str:
        return f", {self.cache.max_requests} request slots"

    def report(self) -> dict:
        return {"cache": repr(self.cache)}
