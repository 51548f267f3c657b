"""Speculative decoding in the engine: a proposer guesses each request's next ``k``
tokens, one verify step of the target checks them all (the decode runner's kind of input
with ``1 + k`` tokens per request and acceptance in the graph:
:class:`~graphcap.inputs.PagedInputs` ``accept=``), and each request gains its accepted
proposals plus one token of the target's own, as many as ``k + 1`` a step.

Greedy requests accept a proposal while it equals the target's argmax (token for token
plain greedy decoding); sampled ones by rejection sampling against the request's
:class:`~graphcap.Sampling`, so the tokens are distributed as plain sampling's whatever
is proposed. The cache is rewound to the accepted tokens
after each step: the K/V of refused proposals are never read, and the next step writes
over them.

A proposer is any object with ``k`` (proposals per step) and ``propose(tokens)``: ``k``
token ids after a request's ``tokens`` so far (prompt and generated), e.g.
:class:`~graphcap.engine.proposers.NgramProposer`; or, proposing for all requests at
once, ``propose_batch(slots, histories)`` (their request slots and tokens so far), with
``bind(max_batch, max_len, vocab, progress=)`` called once when the ``LLM`` is built
(where it captures graphs of its own), as :class:`~graphcap.engine.draft.DraftModel`. A
proposer with ``hidden = True`` reads the target's hidden states:
``propose_batch(slots, histories, hidden)``, ``hidden`` [requests, hidden size] on the
device, each request's at its last accepted token of the step before (at first, its
prompt's last token's, from the prefill), as :class:`~graphcap.engine.heads.HeadProposer`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from graphcap.core.checks import positive_int, staged
from graphcap.engine.arguments import token_ids
from graphcap.inputs.paged import PagedInputs
from graphcap.opsdb.sample import GREEDY_BELOW


def check_proposer(proposer) -> int:
    """The proposer's ``k``; ValueError naming what a proposer needs where it lacks it."""
    k = getattr(proposer, "k", None)
    proposes = any(callable(getattr(proposer, name, None))
                   for name in ("propose", "propose_batch"))
    if not proposes or k is None:
        raise ValueError(f"speculative={proposer!r}: a proposer needs k (proposals per "
                         "step) and propose(tokens) -> k token ids, as "
                         "graphcap.engine.proposers.NgramProposer(k=4) has (or "
                         "propose_batch(slots, histories), as graphcap.engine.draft"
                         ".DraftModel)")
    if getattr(proposer, "hidden", False) is True:  # reads the target's hidden states
        if not callable(getattr(proposer, "propose_batch", None)):
            raise ValueError(f"speculative={proposer!r} reads hidden states (hidden = "
                             "True): it needs propose_batch(slots, histories, hidden), as "
                             "graphcap.engine.heads.HeadProposer has")
        positive_int(getattr(proposer, "hidden_size", None), "the proposer's hidden_size "
                     "(the target's hidden width, which it reads)")
    return positive_int(k, "the proposer's k")


def proposer_max_len(proposer, default: int) -> int:
    """``default``, at most what a proposer with positions of its own to cache (a
    ``max_position``, as a DraftModel's model has) can serve: its max_position less its
    ``k``, which a verify step writes past a request's last token."""
    bound = getattr(proposer, "max_position", None)
    return default if bound is None else min(default, bound - proposer.k)


def max_len_bound(proposer, max_position: int, room: int) -> tuple[int, str]:
    """The largest max_len an LLM of a model of ``max_position`` may be built with (a
    proposer's ``k``, ``room``, past it), and whose positions bound it: the model's, or a
    draft's where fewer (:func:`proposer_max_len`)."""
    bound = max_position - room
    drafted = proposer_max_len(proposer, bound)
    return (drafted, "the draft's") if drafted < bound else (bound, "the model's")


def graph_calls(reports) -> dict:
    """``replays`` and ``fallbacks`` summed over every runner report found in
    ``reports`` (dicts, nested: a proposer's report holds its runners')."""
    total = {"replays": 0, "fallbacks": 0}

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("replays"), dict) and isinstance(node.get("fallbacks"),
                                                                    dict):
                for key in total:
                    total[key] += sum(node[key].values())
                return
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(reports)
    return total


@dataclass
class Counts:
    """What speculation did: verify steps, the requests' rows they verified (a request in
    a step), proposals made and accepted, and seconds in the proposer (draft), in the
    verify step up to its tokens on the host (verify) and in the bookkeeping after it
    (host). Accepted means the target verified it: a request that ends inside a step
    (``max_new_tokens``, a stop) keeps fewer tokens than it accepted there."""

    steps: int = 0
    rows: int = 0
    proposals: int = 0
    accepted: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    host_s: float = 0.0

    def report(self) -> dict:
        return {"verify_steps": self.steps, "verified_rows": self.rows,
                "proposals": self.proposals,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.proposals if self.proposals else 0.0,
                # tokens a request's verify step gives: its accepted proposals plus one
                "mean_acceptance_length": self.accepted / self.rows + 1 if self.rows
                else 0.0,
                "draft_s": self.draft_s, "verify_s": self.verify_s, "host_s": self.host_s}


class Verifier:
    """The verify graphs of a model over ``cache``, one bucket per decode bucket, twice:
    greedy acceptance (``runner``: a step of greedy requests only) and sampled
    (``sampled``: any other; its acceptance ranks every row's vocabulary, for top-k and
    top-p, which a greedy step need not pay); the proposer (its proposals checked against
    ``vocab``); for a proposer that reads hidden states, each request slot's from its
    last verify step; and the counts."""

    def __init__(self, capture, proposer, cache, buckets: list[int], vocab: int,
                 decode_attention=None, progress=None):
        self.proposer, self.k = proposer, check_proposer(proposer)
        self.cache, self.vocab, self.counts = cache, vocab, Counts()
        self.bound = callable(getattr(proposer, "bind", None))  # graphs of its own
        if self.bound:
            proposer.bind(cache.max_requests, cache.max_len, vocab, progress=progress)
        self.reads_hidden = getattr(proposer, "hidden", False) is True
        try:
            self.runner, self.sampled = (
                capture(buckets=[b * (1 + self.k) for b in buckets],
                        inputs=PagedInputs(cache, 1 + self.k, accept=accept,
                                           hidden=self.reads_hidden,
                                           decode_attention=decode_attention))
                for accept in ("greedy", "sampled"))
        except BaseException:
            self.unbind()
            raise
        self.hidden: torch.Tensor | None = None  # [request slots, hidden size]
        self.owner: dict[int, object] = {}  # slot -> the request its hidden row is of

    def unbind(self) -> None:
        """Hand the proposer back (its graphs freed) where this verifier bound it."""
        if self.bound and callable(getattr(self.proposer, "unbind", None)):
            self.proposer.unbind()

    def step(self, requests: dict) -> dict[int, list[int]]:
        """One verify step of ``requests`` (request slot -> :class:`Request`, each with a
        token drawn and not yet cached): the tokens each gains, its accepted proposals
        then the target's next; each request's cached length counts its last token and
        the accepted proposals."""
        start = time.perf_counter()
        slots = sorted(requests)
        live = [requests[s] for s in slots]
        histories = [r.prompt + r.new for r in live]
        if self.reads_hidden:  # the slots' rows of the hidden states, read and written
            index = torch.tensor(slots, device=self.cache.device)
            given = list(self.proposer.propose_batch(slots, histories,
                                                     self._hidden_of(slots, live, index)))
        elif callable(getattr(self.proposer, "propose_batch", None)):
            given = list(self.proposer.propose_batch(slots, histories))
        else:
            given = [self.proposer.propose(t) for t in histories]
        if len(given) != len(slots):
            raise ValueError(f"the proposer {type(self.proposer).__name__} gave "
                             f"{len(given)} proposals for {len(slots)} requests")
        proposals = [self._checked(p) for p in given]
        drafted = time.perf_counter()
        device = self.cache.device  # pinned and copied without a host wait
        tokens = staged([t for r, p in zip(live, proposals, strict=True)
                         for t in [r.last, *p]], torch.long, device).to(device,
                                                                         non_blocking=True)
        positions = [r.length for r in live]
        if all(r.sampling.temperature <= GREEDY_BELOW for r in live):
            out = self.runner(tokens, positions=positions, slots=slots)
        else:
            out = self.sampled(tokens, positions=positions, slots=slots,
                               sampling=[r.sampling for r in live])
        if self.reads_hidden:
            out, hidden = out
            self.hidden[index] = hidden.to(self.hidden.dtype)  # the head's dtype
        out = out.tolist()
        verified = time.perf_counter()
        gained = {}
        for slot, request, proposed, (n, following) in zip(slots, live, proposals, out,
                                                             strict=True):
            request.length += 1 + n
            self.cache.rewind(slot, request.length)
            gained[slot] = proposed[:n] + [following]
            self.counts.accepted += n
        self.counts.steps += 1
        self.counts.rows += len(slots)
        self.counts.proposals += self.k * len(slots)
        self.counts.draft_s += drafted - start
        self.counts.verify_s += verified - drafted
        self.counts.host_s += time.perf_counter() - verified
        return gained

    def start(self, slots: list[int], live: list, hidden: torch.Tensor) -> None:
        """The hidden states of the prompts' last tokens (the prefill's), where a draft
        head starts from for the requests in ``slots``."""
        index = torch.tensor(slots, device=hidden.device)
        width = self._buffer().shape[1]
        if hidden.shape[-1] != width:
            raise ValueError(f"the proposer's hidden_size is {width}, but the target's "
                             f"hidden states are {hidden.shape[-1]} wide: give the "
                             "proposer the target's hidden width")
        self.hidden[index] = hidden.to(self.hidden.dtype)  # a head of its own dtype
        for slot, request in zip(slots, live, strict=True):
            self.owner[slot] = request

    def _buffer(self) -> torch.Tensor:
        if self.hidden is None:  # the proposer's width and dtype
            size = getattr(self.proposer, "hidden_size", None)
            self.hidden = torch.zeros(self.cache.max_requests, positive_int(
                size, "the proposer's hidden_size"), device=self.cache.device,
                dtype=getattr(self.proposer, "dtype", torch.float32))
        return self.hidden

    def _hidden_of(self, slots: list[int], live: list, index: torch.Tensor
                   ) -> torch.Tensor:
        """The hidden rows of ``slots``, a slot's zeroed where its request is new to it
        (no prefill or verify step gave it one)."""
        self._buffer()
        for slot, request in zip(slots, live, strict=True):
            if self.owner.get(slot) is not request:
                self.owner[slot] = request
                self.hidden[slot].zero_()
        return self.hidden[index]

    def _checked(self, proposal) -> list[int]:
        try:  # ints, numpy or tensor ints; a tensor or array of them
            proposed = token_ids(proposal)
        except TypeError:
            proposed = None
        if proposed is None or len(proposed) != self.k:
            raise ValueError(f"the proposer {type(self.proposer).__name__} gave "
                             f"{proposal!r}: propose(tokens) must give k = {self.k} ints")
        if any(not 0 <= t < self.vocab for t in proposed):
            raise ValueError(f"the proposer {type(self.proposer).__name__} proposed "
                             f"{proposed!r}: token ids must be in [0, {self.vocab})")
        return proposed


__all__ = ["Counts", "Verifier", "check_proposer", "graph_calls", "max_len_bound"]
