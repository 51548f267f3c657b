"""A stateful property: requests admitted, stepped and finished in any order, the decode
batch moving up and down the buckets and lengths crossing page boundaries; after every
step the decode runner (full) gives the logits of eager steps on a cache of its own, and
no two requests ever share a page. On the emulator in CI, on CUDA graphs on the GPU."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import graphcap
from graphcap.engine.eager import decode_step, prefill
from graphcap.inputs import DecodeInputs
from graphcap.kv import NULL_PAGE, PagedKVCache
from graphcap.models import PRESETS, Decoder
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
SLOTS, MAX_LEN = 4, 24
torch.manual_seed(0)
MODEL = Decoder(PRESETS["tiny"]).to(DEVICE).eval()


def new_cache() -> PagedKVCache:
    a = MODEL.args
    return PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=SLOTS,
                        max_len=MAX_LEN, page_size=4, pages=10, device=DEVICE)


class Decoding(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.graphed, self.eager = new_cache(), new_cache()
        self.graphed.k.fill_(float("nan"))  # pages nobody owns: never read
        self.graphed.v.fill_(float("nan"))
        self.runner = graphcap.capture(MODEL, "full", buckets=[1, 2, 4],
                                       inputs=DecodeInputs(self.graphed))
        self.live: dict[int, dict] = {}

    @precondition(lambda self: len(self.live) < SLOTS)
    @rule(prompt=st.lists(st.integers(0, 255), min_size=1, max_size=9),
          room=st.integers(1, 14))
    def admit(self, prompt, room):
        slot = min(set(range(SLOTS)) - set(self.live))
        total = len(prompt) + room
        if total > MAX_LEN or -(-total // 4) > self.graphed.free_pages:
            return  # CacheFull is tested elsewhere
        for cache in (self.graphed, self.eager):
            cache.admit(slot, total)
        ids = torch.tensor(prompt, device=DEVICE)
        got = prefill(MODEL, self.graphed, ids, [len(prompt)], [slot])
        want = prefill(MODEL, self.eager, ids, [len(prompt)], [slot])
        torch.testing.assert_close(got, want)
        self.live[slot] = {"length": len(prompt), "last": int(want.argmax()),
                           "capacity": total}

    @precondition(lambda self: any(r["length"] < r["capacity"]
                                   for r in self.live.values()))
    @rule()
    def step(self):
        rows = sorted(s for s, r in self.live.items() if r["length"] < r["capacity"])
        tokens = torch.tensor([self.live[s]["last"] for s in rows], device=DEVICE)
        positions = [self.live[s]["length"] for s in rows]
        got = self.runner(tokens, positions=positions, slots=rows)
        want = decode_step(MODEL, self.eager, tokens, torch.tensor(positions, device=DEVICE),
                           rows)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for s, token in zip(rows, want.argmax(-1).tolist(), strict=True):
            self.live[s]["length"] += 1
            self.live[s]["last"] = token

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data):
        slot = data.draw(st.sampled_from(sorted(self.live)))
        for cache in (self.graphed, self.eager):
            cache.release(slot)
        del self.live[slot]

    @invariant()
    def pages_are_owned_once(self):
        owned = [p for pages in self.graphed.owned().values() for p in pages]
        assert len(owned) == len(set(owned)) and NULL_PAGE not in owned
        assert self.graphed.free_pages + len(owned) == self.graphed.pages


Decoding.TestCase.settings = settings(max_examples=10, stateful_step_count=25,
                                      deadline=None)
TestDecoding = Decoding.TestCase
