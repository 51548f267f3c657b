"""Tokens of requests at positions over a paged K/V cache: :class:`PagedInputs`, the one
kind of input of decode steps, verify steps, prefill and extend into the cache.

Every row is a token of a request (a request slot of the cache) at a position; its K/V
go to that place in the request's pages. How many tokens each request brings sets the
call and how attention runs:

- ``tokens_per_request=k`` (1: a decode step; ``1 + k`` proposals: a verify step):
  ``runner(tokens, positions=[...], slots=[...])``, ``k`` tokens per request in order,
  ``positions[r]`` the first one's (host ints: the tokens of request ``r`` cached before
  it). Every token attends over its request's pages up to itself (the decode attention
  backend, a row per token), so the graph needs no per-request metadata and buckets
  count tokens.
- ``tokens_per_request=None`` (prefill, extend): ``runner(input_ids, positions,
  seq_lens=[...], slots=[...])``, requests packed along dim 0 in request slots of the
  prefill attention backend's per-shape metadata. A prompt from position 0 attends among
  its new tokens (``attention``); with ``extend=True`` a request may continue one
  already cached (``starts=[...]``, its first position) and every token attends over its
  pages as a decode row does, so one graph serves fresh prompts and continuations.

Each shape has one state (:class:`PagedState`): its view of the cache
(:class:`~graphcap.kv.CacheBatch`: each token's place, pages and length, computed on the
device from its staged position and request slot, inside the graph), the decode attention
backend's plan (rewritten on the host before each replay) and, for requests of any
length, the prefill metadata. Padded rows have no request slot (``-1``): they write only
the null page and come out zero. The cache counts a call's tokens as written once it has
run; one that raised running keeps each request's tokens before the call's only
(:meth:`PagedInputs.abandon`): no later call reads a place nobody or a failed call wrote.

:class:`~graphcap.inputs.DecodeInputs` and :class:`~graphcap.inputs.CachePrefillInputs`
are this kind with the decode and prefill calls' arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from graphcap.core import checks
from graphcap.core.context import forward_context
from graphcap.core.inputs import Batch, Inputs, call_copies, check_packing
from graphcap.core.pinned import HOST_BUFFERS, HostRows
from graphcap.errors import UnsupportedModel
from graphcap.inputs.accept import greedy_accept, sampled_accept
from graphcap.inputs.paged_calls import check_options, check_requests, check_steps, default_ladder
from graphcap.kv.batch import CacheBatch
from graphcap.kv.paged import PagedKVCache
from graphcap.opsdb.attention import DecodeBackend, check_serves, get_backend
from graphcap.opsdb.places import CACHE_PLACES
from graphcap.opsdb.sample import SAMPLE


def recompute(kv: CacheBatch, token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """``kv``'s places (and, where it reads pages, rows and lengths) recomputed in place
    from the tokens' request slots and positions, in one ``graphcap::cache_places``
    launch: what a graph does to the shape's static state on every replay."""
    CACHE_PLACES(token_slots, positions, kv.cache.block_table, kv.cache.page_size,
                 kv.cache_loc, kv.block_table, kv.seq_lens)


@dataclass
class PagedState:
    """One shape's state: its view of the cache (with the decode attention plan) and, for
    requests of any length, the prefill attention metadata (else None)."""

    kv: CacheBatch
    meta: Any = None

    @property
    def tokens(self) -> int:
        return self.kv.cache_loc.shape[0]

    def context(self):
        return forward_context(attention=self.meta, kv=self.kv)


class PagedInputs(Inputs):
    """Tokens of requests over ``cache``: ``tokens_per_request`` each (None: any, with the
    prefill ``attention`` backend and ``slots`` request slots per shape; ``extend``:
    continuing cached requests); ``output_rows`` (None: the model's) 'tokens' or
    'requests'; ``sample``: draw each request's next token in the graph (one token per
    request); ``accept="greedy"`` or ``"sampled"``: a verify step (``tokens_per_request=1
    + k``) returns each request's accepted proposals and next token, ``[requests, 2]``,
    computed in the graph (:mod:`graphcap.inputs.accept`; "sampled" takes ``sampling=``
    per request as ``sample`` does; the cache then counts every token of the step as
    written: :meth:`~graphcap.kv.PagedKVCache.rewind` keeps the accepted ones);
    ``hidden`` (with ``accept``): also each request's hidden state at its last accepted
    token, ``(accepted, hidden)``; in a prefill, the hidden states of the rows the logits
    are of, ``(logits, hidden)`` (a model that declares ``graphcap_hidden``: its forward
    takes ``hidden=True``); ``decode_attention``: the backend of attention over
    the pages (a name for ``get_backend(kind="decode")``, a backend, or None: the
    default); ``check_inputs``: token ids checked against the model's vocabulary (one
    host sync a call), and for requests of any length the positions given against their
    starts (a second)."""

    def __init__(self, cache: PagedKVCache, tokens_per_request: int | None = 1, *,
                 attention=None, slots: int | None = None, output_rows: str | None = None,
                 extend: bool = False, sample: bool = False, accept: str | None = None,
                 hidden: bool = False, decode_attention=None, check_inputs: bool = False,
                 name: str = "the model"):
        super().__init__(cache.device)
        self.cache = cache
        self.extend, self.sample, self.accept = extend, sample, accept
        self.draws = sample or accept == "sampled"  # takes sampling= per request
        self.hidden = hidden
        self.step = check_options(tokens_per_request, attention=attention, slots=slots,
                                  output_rows=output_rows, extend=extend, sample=sample,
                                  accept=accept, hidden=hidden)
        self.most_tokens = self.step and self.step * cache.max_requests  # distinct slots
        self.kind = "decode" if self.step is not None else "prefill"
        if isinstance(attention, str):  # a prefill attention backend by its name
            attention = get_backend(attention, cache.device)
        self.attention, self.slots, self.name = attention, slots, name
        self.pages = decode_attention if isinstance(decode_attention, DecodeBackend) \
            else get_backend(decode_attention, kind="decode", cache=cache)
        self.output_rows = output_rows  # None: the model's (bind)
        self.per_request = output_rows == "requests"
        self.check_inputs = check_inputs
        self.vocab_size: int | None = None  # with check_inputs: token ids' bound (bind)
        self.max_position: int | None = None  # positions' bound, where the model has one
        self.last_rows: torch.Tensor | None = None  # per_request: each request's last row
        # Prefill: whether graphcap attention ran in the captured forward (None: nothing
        # captured) and, with nothing captured, in a call.
        self.attends: bool | None = None
        self.called = False
        self.places: torch.Tensor | None = None  # positions and request slots [2, tokens]
        self.host_places: HostRows | None = None  # steps' (paged_calls.staged_places)

    def bind(self, model) -> None:
        # The backend its layers attend with computes their options, before anything is
        # built: a decode step and an extend attend over the pages, a prefill among its
        # new tokens.
        options = getattr(model, "graphcap_attention_options", ())
        whose = f"{type(model).__name__}'s layers"
        if self.step is None and not self.extend:
            check_serves(self.attention, options, device=self.device, whose=whose)
        else:
            check_serves(self.pages, options, cache=self.cache, whose=whose)
        rows = self.output_rows or getattr(model, "output_rows", "tokens")
        if rows not in ("tokens", "requests"):
            raise UnsupportedModel(f"{type(model).__name__}.output_rows is {rows!r}: "
                                   "use 'tokens' or 'requests' (one row per request)")
        self.per_request = rows == "requests"  # a verify step asks it for every row
        if self.hidden and not getattr(model, "graphcap_hidden", False):
            raise UnsupportedModel(
                f"hidden=True reads the hidden states of {type(model).__name__}, which "
                "does not declare graphcap_hidden (a forward taking hidden=True and "
                "returning (logits, hidden)); graphcap's reference decoders do")
        self.row_unit = ("one token per request (drawn in the graph)" if self.sample else
                         "a request's accepted proposals and next token" if self.accept
                         else "one row per request (its last token)" if self.per_request
                         else "one row per token")
        max_position = getattr(model, "max_position", None)
        self.max_position = checks.as_int(max_position, "max_position") \
            if max_position else None
        if self.check_inputs:
            vocab = getattr(model, "vocab_size", None)
            if vocab is None:
                raise UnsupportedModel(
                    f"check_inputs=True checks token ids against the model's vocab_size, "
                    f"which {type(model).__name__} does not have: set model.vocab_size")
            self.vocab_size = checks.as_int(vocab, "vocab_size")

    # -- a call ----------------------------------------------------------------------
    def check(self, args: tuple, kwargs: dict) -> Batch:
        batch = (check_steps if self.step else check_requests)(self, args, kwargs)
        if self.check_inputs:  # one host sync: the tokens live on the device
            checks.check_token_ids(batch.args[0], self.vocab_size)
        return batch

    def commit(self, batch: Batch) -> None:
        """The cache counts each request's tokens up to its last one as written (what
        follows in its pages is stale); a step's may be rewound to its first token."""
        self.cache.wrote(batch.host, self.tokens_each or 1)

    @property
    def tokens_each(self) -> int | None:
        """The tokens a call writes a request (None: its length, a prefill's)."""
        return self.step

    def abandon(self, batch: Batch) -> None:
        """A call that raised running may have written part of its K/V (some layers):
        each request keeps only its tokens before the call's, which it may have rewritten."""
        counts = [n for n in batch.lens if n] if self.tokens_each is None else \
            [self.tokens_each] * len(batch.host)
        self.cache.unwrite([(s, end - n) for (s, end), n in zip(batch.host, counts,
                                                                 strict=True)])

    def describe(self, batch: Batch) -> str:
        head = f"{batch.tokens} requests" if self.step == 1 else \
            f"{batch.tokens} tokens, requests {batch.lens}"
        return f"{head}, (slot, length) {batch.host}"

    # -- static buffers and each shape's state ---------------------------------------
    def allocate(self, max_tokens: int, batch: Batch | None) -> None:
        ids = torch.zeros(max_tokens, dtype=torch.long, device=self.device)
        # Each token's position and request slot (-1: none), side by side: a step stages
        # both, pads included, in one copy from the next of its host buffers.
        places = torch.zeros(2, max_tokens, dtype=torch.long, device=self.device)
        places[1].fill_(-1)
        self.buffers = [ids, places[0], places[1]]
        self.places = places
        if self.step is not None:
            self.host_places = HostRows(HOST_BUFFERS, (2, max_tokens), torch.long,
                                        self.device)
        if self.draws:  # temperature, top_k, top_p, seed per row (pads: greedy)
            self.buffers += [torch.zeros(max_tokens, dtype=dtype, device=self.device)
                             for dtype in (torch.float32, torch.long, torch.float32,
                                           torch.long)]
        # The row of each request's last token: requests of `step` tokens, fixed rows;
        # requests of any length, a buffer the prefill metadata writes.
        self.last_rows = self._last_rows(max_tokens) if self.step else \
            torch.zeros(self.slots, dtype=torch.long, device=self.device)

    def _last_rows(self, tokens: int) -> torch.Tensor:
        """The rows a model of one row per request gives logits of: each request's last
        token's, or, in a verify step (which reads them all), every token's."""
        if self.accept:
            return torch.arange(tokens, device=self.device)
        k = self.step
        return torch.arange(tokens // k, device=self.device) * k + k - 1

    def reset(self) -> None:
        super().reset()
        self.attends = None
        self.places = self.host_places = None

    def prepare(self, bucket: int) -> PagedState:
        meta = None
        if self.step is None:
            meta = self.attention.metadata(bucket, self.slots, self.device).update([bucket])
            if self.per_request:
                meta.last_token_rows(out=self.last_rows)
        _, positions, token_slots = (b[:bucket] for b in self.buffers[:3])
        state = PagedState(self._cache_batch(token_slots, positions, bucket), meta)
        if state.kv.plan is not None and state.kv.plan.on_host:  # pads only, until a call
            state.kv.plan.update([], [])
        return state

    def _cache_batch(self, token_slots, positions, count: int) -> CacheBatch:
        """A forward's view of the cache; with attention over the pages, a plan of its
        decode attention backend for ``count`` rows."""
        if self.step is None and not self.extend:
            return CacheBatch.prefill(self.cache, token_slots, positions)
        kv = CacheBatch.paged(self.cache, token_slots, positions)
        kv.plan = self.pages.metadata(self.cache, count)
        kv.decode = self.step == 1
        return kv

    def derive(self, state: PagedState) -> None:
        """Each token's place in the cache, pages and length, from the staged positions and
        request slots, into the shape's buffers (inside the graph: no host work per replay)."""
        if state.meta is not None:
            state.meta.derive()  # the prefill metadata's device buffers
            if self.per_request:
                state.meta.last_token_rows(out=self.last_rows)
        _, positions, token_slots = (b[:state.tokens] for b in self.buffers[:3])
        recompute(state.kv, token_slots, positions)

    def forward(self, model, bucket: int, state: PagedState):
        ids, positions, _, *params = (b[:bucket] for b in self.buffers)
        return self._run(model, state, ids, positions, params,
                         self.last_rows if self.step is None else
                         self.last_rows[:bucket if self.accept else bucket // self.step])

    def _run(self, model, state: PagedState, ids, positions, params, last):
        """The model under the state's context: each row's logits, or with ``sample`` the
        token drawn from them (``graphcap::sample``, the counter the position it takes),
        or with ``accept`` each request's acceptance (and with ``hidden`` its hidden state
        at its last accepted token); then every layer of the cache must have written its
        K/V."""
        state.kv.written.clear()
        with state.context():
            more = {"hidden": True} if self.hidden else {}
            out = model(ids, positions, last, **more) if self.per_request else \
                model(ids, positions, **more)
            h = None
            if self.hidden:
                out, h = out
            if self.sample:
                out = SAMPLE(out, *params, positions + 1)
            elif self.accept == "sampled":
                out = sampled_accept(out, ids, self.step, *params, positions)
            elif self.accept:
                out = greedy_accept(out, ids, self.step)
        state.kv.check_written(model)
        if h is not None and not self.accept:  # a prefill: the logits' rows
            return out, h
        if h is not None:  # each request's row of its last accepted token
            rows = out.shape[0]
            h = h[:rows * self.step].view(rows, self.step, h.shape[-1])
            return out, h.gather(1, out[:, :1, None].expand(-1, 1, h.shape[-1]))[:, 0]
        return out

    def stage(self, batch: Batch, bucket: int, state: PagedState) -> None:
        self._stage_tokens(batch, bucket)
        if state.meta is not None:  # routed: they fit the shape
            state.meta.update(batch.lens, derive=False, checked=True)
        self._plan(state, batch)  # outside the graph, from the host values

    def _stage_tokens(self, batch: Batch, bucket: int) -> None:
        """The call's tokens, positions and request slots into the buffers; pads have no
        request slot. A step staged in one of ``host_places`` copies its positions and
        request slots, pads included, in one copy."""
        staged = batch.staged
        if staged is not None and self.places is not None and not self.draws and \
                staged.shape == self.places.shape:
            rows, padding = self.rows_of(batch.tokens, bucket)
            rows[0].copy_(batch.args[0], non_blocking=True)  # the token ids
            if padding:
                padding[0].zero_()
            self.places.copy_(staged, non_blocking=True)
            self.host_places.copied()
            return
        self.copy_in(batch, bucket)
        if self.host_places is not None:
            self.host_places.copied()
        _, padding = self.rows_of(batch.tokens, bucket)  # the views copy_in made
        if padding:
            padding[2].fill_(-1)

    def _plan(self, state: PagedState, batch: Batch) -> None:
        """The decode attention plan of ``state`` for ``batch``, where it plans on the host
        (the default reads only the device: no host values gathered per call)."""
        if state.kv.plan is not None and state.kv.plan.on_host:
            state.kv.plan.update(*self._planned(batch))

    def _planned(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's position and request slot, on the host (staged with the call)."""
        return batch.args[1], batch.args[2]

    def context(self, state: PagedState):
        return state.context()

    def rows(self, bucket: int) -> int:
        if not (self.per_request or self.accept):  # accept: a row per request
            return bucket
        return self.slots if self.step is None else bucket // self.step

    def out_rows(self, batch: Batch) -> int:
        return len(batch.lens) if self.per_request or self.accept else batch.tokens

    def fits(self, batch: Batch) -> str | None:
        if self.step is None and len(batch.lens) > self.slots:
            return "too_many_requests"
        return None

    def limits(self) -> str:
        return f", {self.slots if self.step is None else self.cache.max_requests} request slots"

    def default_buckets(self, max_tokens: int | None = None) -> list[int]:
        return default_ladder(self.step, self.slots, self.cache, max_tokens)

    def eager_ids(self, batch: Batch) -> torch.Tensor:
        """The token ids an eager run passes the model: a fallback (buffers allocated: the
        runner captured) an int64 copy, as a replay reads its buffer (a forward that writes
        them writes neither the caller's, and int32 ones give what a replay gives); the
        eager strategy the call's own."""
        ids = batch.args[0]
        return call_copies((ids,), torch.long)[0] if self.buffers else ids

    def eager(self, model, batch: Batch):
        _, positions, token_slots, *params = batch.args
        ids = self.eager_ids(batch)
        positions, token_slots, *params = [t.to(self.device, non_blocking=True)
                                           for t in (positions, token_slots, *params)]
        if self.host_places is not None:  # the copies of the call's host buffer issued
            self.host_places.copied()
        meta, last = None, None
        if self.step is None:
            meta = self.attention.prepare(batch.lens, self.device)
            last = meta.last_token_rows() if self.per_request else None
        else:
            last = self._last_rows(batch.tokens) if self.per_request else None
        state = PagedState(self._cache_batch(token_slots, positions, batch.tokens), meta)
        self._plan(state, batch)

        def run():
            out = self._run(model, state, ids, positions, params, last)
            if meta is not None and self.attends is None:  # nothing captured: this tells
                self.called |= meta.attended
                if not meta.attended:
                    check_packing(self.name, self.attention.name, batch.lens)
            return out
        return run

    def captured(self, states: list) -> None:
        if self.step is None:
            self.attends = any(state.meta.attended for state in states)

    def report(self) -> dict:
        out = {"cache": repr(self.cache)}
        if self.step is None:  # the backend the captured forward called (None: none)
            out["attention"] = self.attention.name if self.attends or self.called else None
        if self.pages.name != "graphcap":
            out["decode_attention"] = self.pages.name
        return out
