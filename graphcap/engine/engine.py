"""The engine under ``graphcap.generate`` and ``graphcap.LLM``: the decode graphs and the
prefill graphs of one model over one paged cache (:class:`Engine`), the requests it
serves (:class:`Request`), and the cache a model needs (:func:`cache_shape`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from graphcap.api import backend_for, capture
from graphcap.core.buckets import decode_ladder
from graphcap.core.checks import positive_int
from graphcap.engine.eager import last_token_logits
from graphcap.engine.speculative import Verifier
from graphcap.errors import CacheTooLarge, UnsupportedModel
from graphcap.inputs.cache_prefill import CachePrefillInputs
from graphcap.inputs.decode import DecodeInputs
from graphcap.inputs.sampling import Sampling, draw, pick
from graphcap.kv.paged import PagedKVCache
from graphcap.kv.sizing import size
from graphcap.opsdb.attention import DECODE_BACKENDS


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int
    window: int = 0  # every layer's attention windowed: the longest window, else 0


def cache_shape(model) -> CacheShape:
    """The cache a model generates with, from what it declares (docs/models.md,
    "Generate with your model"): ``graphcap_kv`` = (layers, kv heads, head dim) of the
    keys and values its attention layers keep, ``vocab_size``, ``max_position`` where it
    has one, and ``graphcap_kv_window`` where every layer's attention is windowed (the
    longest window: pages behind it are freed early). graphcap's reference decoders and
    ``graphcap.hf.PrefillLM`` declare them; a model that does not is refused, naming what
    is missing."""
    name = type(model).__name__
    kv, vocab = getattr(model, "graphcap_kv", None), getattr(model, "vocab_size", None)
    if kv is None or vocab is None:
        missing = [n for n, v in (("graphcap_kv", kv), ("vocab_size", vocab)) if v is None]
        raise UnsupportedModel(
            f"{name} cannot generate: it does not declare {' and '.join(missing)}. A model "
            "generates when its attention writes and reads graphcap's paged K/V cache "
            "(graphcap::cached_attention with each layer's index) and it declares "
            "graphcap_kv = (layers, kv heads, head dim) and vocab_size (docs/models.md, "
            "'Generate with your model'); graphcap's reference decoders and stock "
            "transformers models wrapped in graphcap.hf.PrefillLM do")
    try:
        layers, heads, head_dim = (positive_int(v, f"{name}.graphcap_kv") for v in kv)
    except (TypeError, ValueError):
        raise UnsupportedModel(f"{name}.graphcap_kv must be three positive ints (layers, kv "
                               f"heads, head dim), got {kv!r}") from None
    max_position = getattr(model, "max_position", None)
    window = getattr(model, "graphcap_kv_window", 0) or 0
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise UnsupportedModel(f"{name}.graphcap_kv_window must be an int >= 0 (the longest "
                               f"window when every layer's attention is windowed, else 0), "
                               f"got {window!r}")
    return CacheShape(layers, heads, head_dim, positive_int(vocab, f"{name}.vocab_size"),
                      positive_int(max_position, f"{name}.max_position")
                      if max_position else 2**31, window)


def llm_cache(shape: CacheShape, max_batch: int, max_len: int, room: int, page_size: int,
              dtype, device) -> PagedKVCache:
    """An LLM's paged cache: ``max_batch`` requests of ``max_len`` tokens and the ``room``
    past them a proposer's ``k`` proposals take. One the device cannot hold is refused
    (:class:`CacheTooLarge`) naming the ``max_len`` and ``max_batch`` that fit."""
    try:
        return PagedKVCache(shape.layers, shape.kv_heads, shape.head_dim,
                            max_requests=max_batch, max_len=max_len + room,
                            page_size=page_size, dtype=dtype, device=device,
                            window=shape.window)
    except CacheTooLarge as error:
        k = f" (and the proposer's k = {room} past each)" if room else ""
        raise CacheTooLarge(f"graphcap.LLM: {max_batch} requests (max_batch) of {max_len} "
                            f"tokens (max_len){k} need a K/V cache of {size(error.need)}; "
                            f"{_fits(error, max_batch, max_len, room, page_size, device)}: "
                            "build the LLM with a smaller max_len or max_batch (the graphs "
                            "take memory beside the cache too)", need=error.need,
                            free=error.free, pages=error.pages) from error


def _fits(error: CacheTooLarge, max_batch: int, max_len: int, room: int, page_size: int,
          device) -> str:
    """The max_len and the max_batch whose cache fits where ``error``'s did not."""
    if error.pages is None:
        return f"{device} could not allocate it"
    longest = error.pages // max_batch * page_size - room
    most = error.pages // -(-(max_len + room) // page_size)
    fits = [f"max_len={longest} at max_batch={max_batch}"] * (longest > 0) + \
        [f"max_batch={most} at max_len={max_len}"] * (most > 0)
    return f"{device} has {size(error.free)} free, room for " + (
        " or ".join(fits) or "not one request (free the device's memory first)")


@dataclass
class Request:
    """One prompt being generated: its place among the prompts, its tokens so far and
    how it draws them."""

    index: int
    prompt: list[int]
    sampling: Sampling
    new: list[int] = field(default_factory=list)  # the tokens drawn so far
    length: int = 0  # its tokens in the cache

    @property
    def last(self) -> int:
        return self.new[-1]


class Engine:
    """The decode graphs and the prefill graphs of one model over one cache, captured
    once when it is made: requests admitted into request slots, prefilled in groups,
    stepped together, released when done.

    ``chunked``: a prompt longer than ``prefill_tokens`` prefills in chunks of that many
    tokens on graphs (the first on the prefill graphs, the rest on extend graphs over
    its cached tokens, captured too); otherwise it prefills eagerly (counted in the
    prefill runner's fallbacks). ``attention`` names the prefill attention backend
    (None: the best here), ``decode_attention`` the decode one (None:
    ``graphcap::decode_attention``, its kernel chosen per device; ``"flashinfer"``);
    ``progress`` shows the captures; ``speculative``: a proposer (``k`` and
    ``propose(tokens)``), whose proposals verify graphs check, captured too
    (:mod:`graphcap.engine.speculative`; ``vocab``: the token ids proposals may be)."""

    def __init__(self, model, cache: PagedKVCache, strategy: str, max_batch: int,
                 prefill_tokens: int, *, chunked: bool = False, attention: str | None = None,
                 decode_attention: str | None = None, progress=None, speculative=None,
                 vocab: int | None = None):
        if decode_attention is not None and (not isinstance(decode_attention, str)
                                             or decode_attention not in DECODE_BACKENDS):
            raise ValueError(f"decode_attention={decode_attention!r}: None (graphcap's "
                             "kernel, chosen per device) or one of "
                             f"{sorted(set(DECODE_BACKENDS) - {'graphcap'})}")
        self.cache, self.max_batch, self.prefill_tokens = cache, max_batch, prefill_tokens
        self.device, self.rows_of = cache.device, getattr(model, "output_rows", "tokens")
        name = type(model).__name__
        # Refused before any capture: a backend without the options the layers use.
        backend = backend_for(model, attention, cache.device, strategy, cache.dtype)
        self.verifier = None  # speculative decoding's verify graphs
        try:
            # The decode graphs give logits, which each step's draw reads before the next
            # replay rewrites them (stream order): no copy.
            self.decoder = capture(model, strategy, buckets=decode_ladder(max_batch),
                                   inputs=DecodeInputs(cache, attention=decode_attention),
                                   copy_outputs=False, progress=progress)
            if speculative is not None:
                self.verifier = Verifier(functools.partial(capture, model, strategy,
                                                           progress=progress),
                                         speculative, cache, decode_ladder(max_batch),
                                         vocab or 2**63, decode_attention, progress)
            self._capture_prefill(model, strategy, prefill_tokens, chunked, backend,
                                  progress, name)
        except BaseException as error:  # the proposer may serve another LLM
            if self.verifier is not None:
                self.verifier.unbind()
            if isinstance(error, torch.OutOfMemoryError) and \
                    not isinstance(error, CacheTooLarge):  # a draft's cache: says its own
                error.add_note(f"graphcap: the paged K/V cache the graphs are captured over "
                               f"takes {size(cache.nbytes)} of {cache.device} "
                               f"({cache.max_requests} requests of {cache.max_len} tokens): "
                               "a smaller max_batch or max_len leaves the graphs more")
            raise
        self.live: dict[int, Request] = {}  # request slot -> its request
        self.steps = self.prefills = 0

    def _capture_prefill(self, model, strategy, prefill_tokens, chunked, backend,
                         progress, name) -> None:
        cache, max_batch = self.cache, self.max_batch
        ladder = decode_ladder(prefill_tokens)
        # A draft head starts from the hidden state of a prompt's last token.
        self.hidden = self.verifier is not None and self.verifier.reads_hidden
        self.prefiller = capture(model, strategy, buckets=ladder, progress=progress,
                                 inputs=CachePrefillInputs(cache, backend, max_batch,
                                                           self.rows_of, name=name,
                                                           hidden=self.hidden))
        self.extender = None  # chunks after a long prompt's first
        if chunked and cache.max_len > prefill_tokens:
            self.extender = capture(model, strategy, buckets=ladder, progress=progress,
                                    inputs=CachePrefillInputs(cache, backend, 1, self.rows_of,
                                                              name=name, extend=True,
                                                              hidden=self.hidden))

    def admit(self, slot: int, request: Request, max_new_tokens: int) -> None:
        # live first, then the cache: interrupted anywhere (a Ctrl-C), the slot is live or
        # free in both, or live alone, which release() frees
        request.length = len(request.prompt)
        self.live[slot] = request
        try:
            self.cache.admit(slot, len(request.prompt) + max_new_tokens)
        except BaseException:  # refused (CacheFull), or interrupted once it admitted
            self.release(slot)
            raise

    def release(self, slot: int) -> Request:
        """The slot's request, its cache pages freed (none: admitted live alone)."""
        request = self.live.pop(slot)
        if self.cache.capacity(slot):
            self.cache.release(slot)
        return request

    def clear(self) -> None:
        """Release every request, and every slot the cache holds with none (a release a
        Ctrl-C cut short)."""
        for slot in list(self.live):
            self.release(slot)
        for slot in self.cache.owned():
            self.cache.release(slot)

    def prefill(self, slots: list[int]) -> list[tuple[int, int]]:
        """The prompts of ``slots`` into the cache, on the prefill graphs, in calls of at
        most ``prefill_tokens`` tokens (with an extender, a longer prompt alone, in
        chunks); the first new token of each, drawn as the decode graphs draw: ``(slot,
        token)`` pairs."""
        drawn = []
        for group in _groups(slots, [self.live[s].length for s in slots],
                             self.prefill_tokens):
            requests = [self.live[s] for s in group]
            lens = [r.length for r in requests]
            if self.extender is not None and lens[0] > self.prefill_tokens:  # alone
                start, logits = 0, None
                while logits is None:
                    start, logits = self.chunk(group[0], start)
            else:
                ids = torch.tensor(sum((r.prompt for r in requests), []),
                                   device=self.device)
                positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
                logits = self._last_rows(self.prefiller(ids, positions, seq_lens=lens,
                                                        slots=group), lens, group)
                self.prefills += 1
            drawn += zip(group, self.first_tokens(requests, logits), strict=True)
        return drawn

    def chunk(self, slot: int, start: int) -> tuple[int, torch.Tensor | None]:
        """The ``prefill_tokens`` tokens of the prompt of ``slot`` from ``start`` into the
        cache: the first chunk on the prefill graphs, the next ones on the extend graphs
        over the tokens cached before them. Where the next chunk starts, and the last
        token's logits ``[1, vocab]`` once the prompt is in (else None)."""
        prompt = self.live[slot].prompt
        piece = prompt[start:start + self.prefill_tokens]
        ids = torch.tensor(piece, device=self.device)
        positions = torch.arange(start, start + len(piece), device=self.device)
        if start == 0:
            out = self.prefiller(ids, positions, seq_lens=[len(piece)], slots=[slot])
        else:
            out = self.extender(ids, positions, seq_lens=[len(piece)], slots=[slot],
                                starts=[start])
        self.prefills += 1
        end = start + len(piece)
        if end < len(prompt):
            return end, None
        return end, self._last_rows(out, [len(piece)], [slot])

    def _last_rows(self, out, lens: list[int], slots: list[int]) -> torch.Tensor:
        """Each request's last-token logits of a prefill call's ``out``; with a draft head,
        the hidden states of the same rows go to the verifier (its first step's start)."""
        if not self.hidden:
            return last_token_logits(out, lens, self.rows_of)
        logits, hidden = out
        self.verifier.start(slots, [self.live[s] for s in slots],
                            last_token_logits(hidden, lens, self.rows_of))
        return last_token_logits(logits, lens, self.rows_of)

    @staticmethod
    def first_tokens(requests: list[Request], logits: torch.Tensor) -> list[int]:
        """Each request's first new token from its prompt's last logits, drawn as the
        decode graphs draw (the counter: the position it takes)."""
        return draw(logits, [r.sampling for r in requests], [r.length for r in requests])

    def launch(self, slots: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the requests in ``slots`` (each at its length), ``tokens``
        their last tokens on the device; returns the tokens drawn, on the device, without
        waiting for them (each request's length counts the step)."""
        requests = [self.live[s] for s in slots]
        logits = self.decoder(tokens, positions=[r.length for r in requests], slots=slots)
        drawn = pick(logits, [r.sampling for r in requests], [r.length + 1 for r in requests])
        self.steps += 1
        for request in requests:
            request.length += 1
        return drawn

    def runners(self) -> dict:
        v = self.verifier
        return {name: runner for name, runner in (
            ("decode", self.decoder), ("prefill", self.prefiller), ("extend", self.extender),
            ("verify", v and v.runner), ("verify_sampled", v and v.sampled)) if runner}

    def report(self) -> dict:
        """Decode steps and prefill calls (a chunk of a long prompt each); per runner its
        replays and fallbacks per bucket; the graph pools' bytes; the ladders."""
        reports = {name: r.report() for name, r in self.runners().items()}
        decoded, prefilled = reports["decode"], reports["prefill"]
        extended = reports.get("extend", {})
        speculative = {}
        if self.verifier is not None:
            both = (reports["verify"], reports["verify_sampled"])
            speculative = {"verify_replays": _summed(r.get("replays", {}) for r in both),
                           "verify_fallbacks": _summed(r.get("fallbacks", {}) for r in both),
                           **self.verifier.counts.report()}
        return {**speculative, "decode_steps": self.steps, "prefills": self.prefills,
                "replays": dict(decoded.get("replays", {})),
                "fallbacks": dict(decoded.get("fallbacks", {})),
                "prefill_replays": dict(prefilled.get("replays", {})),
                "prefill_fallbacks": dict(prefilled.get("fallbacks", {})),
                "extend_replays": dict(extended.get("replays", {})),
                "graph_pool_bytes": sum(r.get("graph_pool_bytes") or 0
                                        for r in reports.values()),
                "buckets": decode_ladder(self.max_batch),
                "prefill_buckets": decode_ladder(self.prefill_tokens)}


def _summed(counts) -> dict:
    """Per-bucket counts of several runners, added."""
    total: dict = {}
    for per_bucket in counts:
        for bucket, n in per_bucket.items():
            total[bucket] = total.get(bucket, 0) + n
    return total


def _groups(slots: list[int], lens: list[int], budget: int) -> list[list[int]]:
    """The slots in calls of at most ``budget`` tokens, in order (a longer prompt alone)."""
    groups, tokens = [], 0
    for slot, n in zip(slots, lens, strict=True):
        if not groups or (groups[-1] and tokens + n > budget):
            groups.append([])
            tokens = 0
        groups[-1].append(slot)
        tokens += n
    return groups
