"""A stateful property over one paged cache shared by four runners (full): decode steps,
prefill chunks that extend or rewrite a request from any position it holds, verify
steps of three tokens rewound to any kept length, and draft steps (two greedy decode
steps in one replay); requests admitted into few pages and released in any order (their
pages reused, holding a released request's K/V), calls interrupted once staged, calls
refused before anything runs (a position skipped or past the slot's tokens, a free or
repeated slot), and a cache whose every layer is windowed (pages freed behind the
window). After every call each request's logits are those of a fresh prefill of the
tokens it holds, and the cache counts exactly those tokens: no request ever reads K/V it
did not write."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import graphcap
from graphcap.engine.eager import prefill
from graphcap.errors import BadBatch, CacheFull
from graphcap.inputs import CachePrefillInputs, DecodeInputs
from graphcap.inputs.draft_steps import DraftStepsInputs
from graphcap.inputs.paged import PagedInputs
from graphcap.kv import NULL_PAGE, PagedKVCache
from graphcap.models import PRESETS, Decoder
from graphcap.opsdb.attention import get_backend
from tests.inputs.test_trust_cache import Interrupted, InterruptOnce
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
SLOTS, MAX_LEN, VERIFY, DRAFT = 3, 24, 3, 2


class Steps(InterruptOnce, DecodeInputs):
    pass


class Chunks(InterruptOnce, CachePrefillInputs):
    pass


class Verify(InterruptOnce, PagedInputs):
    pass


class Draft(InterruptOnce, DraftStepsInputs):
    pass


@functools.cache
def world(window: int):
    """The model (every layer windowed to ``window``, or none) and, over one cache of 10
    pages of 4, its decode, extend, verify and draft-step runners, whose buckets pad
    every batch but the largest (pads write only the null page)."""
    torch.manual_seed(0)
    args = dataclasses.replace(PRESETS["tiny"], window=window)
    model = Decoder(args).to(DEVICE).eval()
    cache = PagedKVCache(args.layers, args.kv_heads, args.head_dim, max_requests=SLOTS,
                         max_len=MAX_LEN, page_size=4, pages=10, device=DEVICE,
                         window=model.graphcap_kv_window)
    backend = get_backend(None, torch.device(DEVICE), strategy="full")
    inputs = (Steps(cache), Chunks(cache, backend, slots=2, extend=True),
              Verify(cache, VERIFY), Draft(cache, DRAFT))
    runners = [graphcap.capture(model, "full", buckets=buckets, inputs=i)
               for i, buckets in zip(inputs, ([2, 4], [4, 8], [6], [1, 2]), strict=True)]
    return model, cache, inputs, runners


def truth(model, tokens: list[int]) -> torch.Tensor:
    """The logits of a fresh prefill of ``tokens``, at its last one."""
    a = model.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=1, max_len=MAX_LEN,
                         page_size=4, device=DEVICE, window=model.graphcap_kv_window)
    cache.admit(0, len(tokens))
    return prefill(model, cache, torch.tensor(tokens, device=DEVICE), [len(tokens)], [0])[0]


def ids(tokens) -> torch.Tensor:
    return torch.tensor(tokens, device=DEVICE)


class Requests(RuleBasedStateMachine):
    window = 0

    @initialize()
    def start(self):
        self.model, self.cache, self.inputs, self.runners = world(self.window)
        for slot in self.cache.owned():  # the pages keep what the last example wrote
            self.cache.release(slot)
        self.held: dict[int, list[int]] = {}  # request slot -> the tokens it holds
        self.room: dict[int, int] = {}  # request slot -> the tokens admitted for

    def check(self, out: torch.Tensor, slot: int) -> None:
        torch.testing.assert_close(out, truth(self.model, self.held[slot]), atol=1e-4,
                                   rtol=1e-4)

    def call(self, which: int, interrupt: bool, *args, **kwargs):
        """Runner ``which``'s call, or None where it was interrupted (once staged)."""
        self.inputs[which].armed = interrupt
        try:
            return self.runners[which](*args, **kwargs)
        except Interrupted:
            assert interrupt
            return None

    def open(self, need: int = 1) -> list[int]:
        """Slots holding a request with room for ``need`` more tokens."""
        return sorted(s for s, held in self.held.items() if len(held) + need <= self.room[s])

    @rule(slot=st.integers(0, SLOTS - 1), tokens=st.integers(1, MAX_LEN))
    def admit_or_release(self, slot, tokens):
        if slot in self.held:
            self.cache.release(slot)
            del self.held[slot], self.room[slot]
            return
        try:
            self.cache.admit(slot, tokens)
        except CacheFull:
            return
        self.held[slot], self.room[slot] = [], tokens

    @precondition(lambda self: self.open())
    @rule(data=st.data(), interrupt=st.sampled_from([False, False, True]))
    def chunks(self, data, interrupt):
        slots = data.draw(st.lists(st.sampled_from(self.open()), min_size=1, max_size=2,
                                   unique=True), label="slots")
        starts, chunks = [], []
        for slot in slots:  # from a position the request holds, its window's pages kept
            held, least = len(self.held[slot]), self.cache.least_kept(slot)
            start = data.draw(st.integers(least, held) if least <= held else st.just(held))
            size = data.draw(st.integers(int(len(slots) == 1), min(self.room[slot] - start, 9)))
            starts.append(start)
            chunks.append(data.draw(st.lists(st.integers(0, 255), min_size=size,
                                             max_size=size), label="chunk"))
        lens = [len(c) for c in chunks]
        if not sum(lens):
            return
        positions = torch.cat([torch.arange(b, b + n) for b, n in zip(starts, lens,
                                                                        strict=True)])
        out = self.call(1, interrupt, ids([t for c in chunks for t in c]),
                        positions.to(DEVICE), seq_lens=lens, slots=slots, starts=starts)
        row = 0
        for slot, start, chunk in zip(slots, starts, chunks, strict=True):
            if chunk:  # a call interrupted keeps the tokens before the chunk
                self.held[slot] = self.held[slot][:start] + ([] if out is None else chunk)
            row += len(chunk)
            if chunk and out is not None:
                self.check(out[row - 1], slot)

    @precondition(lambda self: any(self.held[s] for s in self.open()))
    @rule(data=st.data(), interrupt=st.sampled_from([False, False, True]))
    def step(self, data, interrupt):
        slots = data.draw(st.lists(st.sampled_from([s for s in self.open() if self.held[s]]),
                                   min_size=1, max_size=SLOTS, unique=True), label="slots")
        tokens = data.draw(st.lists(st.integers(0, 255), min_size=len(slots),
                                    max_size=len(slots)), label="tokens")
        out = self.call(0, interrupt, ids(tokens),
                        positions=[len(self.held[s]) for s in slots], slots=slots)
        if out is None:
            return
        for row, (slot, token) in enumerate(zip(slots, tokens, strict=True)):
            self.held[slot].append(token)
            self.check(out[row], slot)

    @precondition(lambda self: any(self.held[s] for s in self.open(VERIFY)))
    @rule(data=st.data(), interrupt=st.sampled_from([False, False, True]))
    def verify(self, data, interrupt):
        slots = data.draw(st.lists(st.sampled_from([s for s in self.open(VERIFY)
                                                    if self.held[s]]),
                                   min_size=1, max_size=2, unique=True), label="slots")
        tokens = data.draw(st.lists(st.integers(0, 255), min_size=VERIFY * len(slots),
                                    max_size=VERIFY * len(slots)), label="tokens")
        out = self.call(2, interrupt, ids(tokens),
                        positions=[len(self.held[s]) for s in slots], slots=slots)
        if out is None:
            return
        for r, slot in enumerate(slots):
            for j in range(VERIFY):
                self.held[slot].append(tokens[VERIFY * r + j])
                self.check(out[VERIFY * r + j], slot)
            first = len(self.held[slot]) - VERIFY + 1  # the step's first token, kept
            keep = data.draw(st.integers(max(first, self.cache.least_kept(slot)),
                                         len(self.held[slot])), label="kept")
            self.cache.rewind(slot, keep)
            del self.held[slot][keep:]

    @precondition(lambda self: any(self.held[s] for s in self.open(DRAFT)))
    @rule(data=st.data(), interrupt=st.sampled_from([False, False, True]))
    def draft(self, data, interrupt):
        slots = data.draw(st.lists(st.sampled_from([s for s in self.open(DRAFT)
                                                    if self.held[s]]),
                                   min_size=1, max_size=SLOTS, unique=True), label="slots")
        tokens = data.draw(st.lists(st.integers(0, 255), min_size=len(slots),
                                    max_size=len(slots)), label="tokens")
        out = self.call(3, interrupt, ids(tokens),
                        positions=[len(self.held[s]) for s in slots], slots=slots)
        if out is None:
            return
        for row, (slot, token) in enumerate(zip(slots, tokens, strict=True)):
            self.held[slot].append(token)  # then each step's greedy token, the last uncached
            for step in range(DRAFT):
                assert int(out[row, step]) == int(truth(self.model, self.held[slot]).argmax())
                if step < DRAFT - 1:
                    self.held[slot].append(int(out[row, step]))

    @precondition(lambda self: self.held)
    @rule(data=st.data(), which=st.sampled_from(["skip", "past", "free", "repeat"]),
          runner=st.sampled_from([0, 3]))
    def refused(self, data, which, runner):
        """A call refused before anything runs changes nothing (the invariant)."""
        slot = data.draw(st.sampled_from(sorted(self.held)))
        slots, positions = [slot], [len(self.held[slot])]
        if which == "skip":  # past the tokens written
            positions = [len(self.held[slot]) + 1]
        elif which == "past":  # past what the slot was admitted for
            positions = [self.room[slot]]
        elif which == "free":
            free = [s for s in range(SLOTS) if s not in self.held]
            if not free:
                return
            slots, positions = free[:1], [0]
        else:
            slots, positions = [slot, slot], positions * 2
        with pytest.raises(BadBatch):
            self.runners[runner](ids([1] * len(slots)), positions=positions, slots=slots)

    @invariant()
    def each_page_is_one_requests_and_each_request_holds_its_tokens(self):
        if not hasattr(self, "cache"):
            return
        owned = [p for pages in self.cache.owned().values() for p in pages if p != NULL_PAGE]
        assert len(owned) == len(set(owned))
        assert len(owned) + self.cache.free_pages == self.cache.pages
        for slot in range(SLOTS):
            assert self.cache.written(slot) == len(self.held.get(slot, [])), slot


@pytest.mark.parametrize("window", [0, 8], ids=["full-attention", "windowed"])
def test_requests_sharing_a_cache_read_only_the_tokens_they_hold(window):
    machine = type("Requests", (Requests,), {"window": window})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=15, stateful_step_count=25, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
