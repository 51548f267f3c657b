"""A draft model as a proposer (:class:`DraftModel`): any model ``LLM`` can serve, sharing
the target's token ids, with its own paged cache and its own graphs, captured when the
``LLM`` is built.

Each step, for every request, the draft's cache is first brought to the request's tokens
but its last one: what it already holds is kept up to the first token that differs (the
target refused a proposal there: the cache is rewound), the rest is caught up by decode
steps (at most one token a request after a step, where every proposal was accepted) or,
for a request the draft has not seen, a prefill of its tokens (chunks on the prefill and
extend graphs). Then ``k`` greedy decode steps of all the requests together, each fed
the tokens the step before chose, on the device: under ``full`` one replay of a graph of
all ``k`` (:class:`~graphcap.inputs.draft_steps.DraftStepsInputs`), under the other
strategies ``k`` replays of the draft's decode graph; one host sync a step, to read the
``k`` proposals. A request that reuses a slot keeps the K/V of the tokens it shares from
the start with what the slot held where at most ``k + 1`` of its tokens follow them;
with more it is prefilled anew.

Greedy proposals are deterministic, so rejection sampling against them keeps sampled
tokens distributed as plain sampling's (:mod:`graphcap.inputs.accept`); a draft that is
the target itself proposes what plain greedy decoding chooses.
"""

from __future__ import annotations

import torch

from graphcap.api import capture, model_dtype
from graphcap.core.buckets import decode_ladder
from graphcap.core.checks import positive_int
from graphcap.engine.arguments import check_strategy
from graphcap.engine.engine import Engine, Request, cache_shape
from graphcap.engine.loading import resolve
from graphcap.inputs.draft_steps import DraftStepsInputs
from graphcap.inputs.sampling import Sampling
from graphcap.kv.paged import PagedKVCache


class DraftModel:
    """``model`` (one of graphcap's reference decoders, a ``graphcap.hf.PrefillLM``, a
    stock transformers causal LM, as ``LLM`` takes) proposing ``k`` tokens a step; its
    graphs are captured under ``strategy`` when an ``LLM`` built with
    ``speculative=DraftModel(...)`` binds it (:meth:`bind`); ``prefill_tokens`` bounds
    its prefill graphs."""

    def __init__(self, model, k: int, *, strategy: str = "full", prefill_tokens: int = 512,
                 page_size: int = 16):
        self.model, _ = resolve(model)
        self.shape = cache_shape(self.model)
        self.k = positive_int(k, "k")
        if self.k > self.shape.max_position - 2:  # no LLM max_len (2 at least) fits
            raise ValueError(f"k = {self.k} leaves no room under the draft model's "
                             f"max_position {self.shape.max_position} (it caches a "
                             "request's tokens, 2 at least, and the k proposals past "
                             "them): give the DraftModel k at most "
                             f"{self.shape.max_position - 2}")
        self.strategy = check_strategy(strategy, "the DraftModel's strategy")
        self.page_size = positive_int(page_size, "the DraftModel's page_size")
        self.prefill_tokens = positive_int(prefill_tokens, "prefill_tokens")
        self.engine: Engine | None = None
        self.stepper = None  # the k steps in one graph, where the strategy keeps them
        self.held: dict[int, list[int]] = {}  # slot -> the tokens whose K/V it caches
        self.steps = self.caught_up = self.prefilled = 0

    @property
    def max_position(self) -> int:
        """The draft model's positions: an LLM's default max_len leaves its k room in them."""
        return self.shape.max_position

    def bind(self, max_batch: int, max_len: int, vocab: int, *, progress=None) -> None:
        """Capture the draft's graphs for ``max_batch`` requests of up to ``max_len``
        tokens each (their proposals included) of a target of ``vocab`` token ids."""
        if self.engine is not None:
            raise ValueError("this DraftModel already serves an LLM: make one per LLM")
        if self.shape.vocab_size != vocab:
            raise ValueError(f"the draft model has {self.shape.vocab_size} token ids, the "
                             f"target {vocab}: a draft shares the target's tokenizer")
        if max_len > self.shape.max_position:  # max_len: the LLM's, plus its k proposals
            raise ValueError(f"the draft model reaches position {self.shape.max_position}, "
                             f"the target's requests {max_len} (max_len plus the k = "
                             f"{self.k} proposals a verify step writes past it): give the "
                             f"LLM max_len at most {self.shape.max_position - self.k} "
                             "(generate(): a shorter prompt or fewer new tokens)")
        s = self.shape
        device = next(self.model.parameters()).device
        # Every page kept, windowed layers or not: a slot is admitted once for max_len
        # (its pages held throughout), and is rewound, to any token it shares with the
        # target's, or to 0 for a new request.
        try:
            self.cache = PagedKVCache(s.layers, s.kv_heads, s.head_dim,
                                      max_requests=max_batch, max_len=max_len,
                                      page_size=self.page_size,
                                      dtype=model_dtype(self.model), device=device)
            self.engine = Engine(self.model, self.cache, self.strategy, max_batch,
                                 min(self.prefill_tokens, max_len), chunked=True,
                                 progress=progress)
            if self.strategy in DraftStepsInputs.strategies:
                self.stepper = capture(self.model, self.strategy,
                                       buckets=decode_ladder(max_batch), progress=progress,
                                       inputs=DraftStepsInputs(self.cache, self.k))
        except BaseException:
            self.unbind()
            raise

    def unbind(self) -> None:
        """Free the draft's graphs and cache (an LLM that failed to build after binding
        it): it may serve another LLM."""
        self.engine = self.cache = self.stepper = None
        self.held = {}

    def propose_batch(self, slots: list[int], histories: list[list[int]]
                      ) -> list[list[int]]:
        """``k`` greedy tokens after each request's ``histories`` (its tokens so far), the
        requests in request slots ``slots``."""
        if self.engine is None:
            raise ValueError("a DraftModel proposes once an LLM has bound it: "
                             "LLM(model, speculative=DraftModel(draft, k))")
        for slot, tokens in zip(slots, histories, strict=True):
            self._sync(slot, tokens[:-1])
        self._catch_up(slots, histories)
        device = self.cache.device
        last = torch.tensor([t[-1] for t in histories], device=device)
        start = [len(t) - 1 for t in histories]
        if self.stepper is not None:
            proposals = self.stepper(last, positions=start, slots=slots).tolist()
        else:
            chosen = []
            for i in range(self.k):  # each a replay; the next input stays on the device
                logits = self.engine.decoder(last, positions=[p + i for p in start],
                                             slots=slots)
                last = logits.argmax(dim=-1)
                chosen.append(last)
            proposals = torch.stack(chosen, dim=1).tolist()
        for slot, tokens, proposed in zip(slots, histories, proposals, strict=True):
            self.held[slot] = tokens + proposed[:-1]  # the inputs of the k steps, cached
        self.steps += 1
        return proposals

    def propose(self, tokens):
        raise TypeError("DraftModel proposes for all requests at once (propose_batch), "
                        "with their request slots: give it to LLM(..., speculative=...)")

    def _sync(self, slot: int, want: list[int]) -> None:
        """The slot's cache kept up to the first token where it and ``want`` differ; a
        slot new to the draft, or more than ``k + 1`` tokens behind ``want`` there (a new
        request sharing a few first tokens with the last), prefilled anew."""
        held = self.held.get(slot)
        if held is None:
            if self.cache.capacity(slot):  # admitted by a call that raised before its prefill
                self.cache.release(slot)
            self.cache.admit(slot, self.cache.max_len)
            held = []
        same = 0
        for a, b in zip(held, want, strict=False):
            if a != b:
                break
            same += 1
        # held first: interrupted between the two, it claims fewer tokens than the cache
        # has written (rewritten by the next catch-up), never more
        if want and (same == 0 or len(want) - same > self.k + 1):
            self.held[slot] = []  # nothing kept, also if the prefill raises part-way
            self.cache.rewind(slot, 0)
            self._prefill(slot, want)
            return
        self.held[slot] = want[:same]
        self.cache.rewind(slot, same)

    def _prefill(self, slot: int, tokens: list[int]) -> None:
        self.engine.live[slot] = Request(0, tokens, Sampling(), length=len(tokens))
        try:
            self.engine.prefill([slot])
        finally:
            del self.engine.live[slot]
        self.held[slot] = list(tokens)
        self.prefilled += 1

    def _catch_up(self, slots: list[int], histories: list[list[int]]) -> None:
        """Decode steps of the tokens each slot lacks before its last, a token of every
        slot that lacks one per step."""
        while True:
            behind = [(s, t) for s, t in zip(slots, histories, strict=True)
                      if len(self.held[s]) < len(t) - 1]
            if not behind:
                return
            ids = torch.tensor([t[len(self.held[s])] for s, t in behind],
                               device=self.cache.device)
            self.engine.decoder(ids, positions=[len(self.held[s]) for s, _ in behind],
                                slots=[s for s, _ in behind])
            for s, t in behind:
                self.held[s].append(t[len(self.held[s])])
            self.caught_up += 1

    def report(self) -> dict:
        """Draft steps (each one replay of the ``k``-step graph, or ``k`` decode replays),
        catch-up decode calls, prefills, and the draft's runners' reports."""
        runners = self.engine.runners() if self.engine is not None else {}
        if self.stepper is not None:
            runners = {**runners, "steps": self.stepper}
        return {"draft_steps": self.steps, "catch_up_calls": self.caught_up,
                "prefills": self.prefilled,
                "runners": {name: r.report() for name, r in runners.items()}}


__all__ = ["DraftModel"]
