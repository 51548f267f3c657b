"""``graphcap.LLM``: a model's decode and prefill graphs captured once, then any number of
``generate`` and ``stream`` calls on them, text in and text out with a tokenizer.

    llm = graphcap.LLM(model, tokenizer, max_batch=8, max_len=2048)
    for done in llm.generate(["The capital of France is"], max_new_tokens=32):
        print(done.text, done.finish_reason)

The step loop keeps the GPU busy: while the requests in flight stay the same, each
decode step is launched on the tokens the step before drew, on the device, before the
host reads them; the host then reads the earlier step's tokens (waiting for that step
only) and decides what ends. A request that ended there still rode the step already
launched; that token is dropped, so no request's tokens change. A prompt longer than
``prefill_tokens`` prefills one chunk between two decode steps of the others (on the
prefill graphs, then the extend graphs). When a request ends, or one joins, the loop
waits for the step in flight, releases and admits, and starts again.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from graphcap.api import model_dtype
from graphcap.core.checks import boolean, positive_int
from graphcap.engine.arguments import (
    check_encodes,
    check_length,
    check_options,
    check_prompts,
    ends_on,
    eos_of,
    max_len_of,
    sampling_of,
    stops_of,
    warn_unapplied_defaults,
)
from graphcap.engine.detokenize import CONTEXT, Detokenizer, cut, text_of
from graphcap.engine.engine import Engine, Request, cache_shape, llm_cache
from graphcap.engine.loading import resolve
from graphcap.engine.speculative import check_proposer, graph_calls, max_len_bound, proposer_max_len
from graphcap.errors import BadBatch, GraphcapError, clear_frames
from graphcap.tp.group import entry

DEFAULT_MAX_LEN = 4096  # tokens per request when neither max_len nor the model bounds it


@dataclass
class Completion:
    """One prompt's result: its new tokens (a stop token that ended it included), their
    text where a tokenizer is known (what they add to the prompt's text, up to a stop
    string that ended it), and why it ended: ``"stop"`` (a stop token),
    ``"stop_string"`` or ``"length"``."""

    index: int
    tokens: list[int]
    text: str | None = None
    finish_reason: str = "length"


@dataclass
class Delta:
    """What ``LLM.stream`` yields: new tokens of prompt ``index`` (a decode step's one; a
    verify step's accepted proposals and next token, without a tokenizer) and their
    text, and, on its last delta, why it ended (else None)."""

    index: int
    tokens: list[int]
    text: str | None = None
    finish_reason: str | None = None


class LLM:
    """``model``: one of graphcap's reference decoders, a ``graphcap.hf.PrefillLM``, a
    stock transformers causal LM (wrapped for you: ``PrefillLM(model, logits="last")``),
    the path of a local Hugging Face checkpoint directory (loaded with its tokenizer;
    nothing is downloaded), or a model of one's own that declares what it caches
    (docs/models.md, "Generate with your model"). ``strategy`` captures the graphs (any of
    :data:`graphcap.api.STRATEGIES`); ``max_batch`` requests decode together, each of up
    to ``max_len`` tokens (prompt and new ones; default the model's ``max_position``, or a
    draft's if fewer, less a proposer's ``k``, at most 4096); ``prefill_tokens`` bounds a
    prefill graph (a longer prompt prefills in chunks of it; none past ``max_batch``
    prompts of ``max_len``, which no call passes); ``attention``: the prefill attention
    backend, ``decode_attention`` the decode one (:class:`~graphcap.engine.engine.Engine`);
    ``progress`` shows the captures; ``stop_at_eos``: the model's and the tokenizer's
    end-of-sequence ids end every request; ``long_prompts``: prompts longer than
    ``prefill_tokens`` prefill in chunks on graphs (extend graphs, captured here too;
    False: eagerly, in one call); ``speculative``: a proposer (``k`` and
    ``propose(tokens)``, e.g. ``graphcap.engine.proposers.NgramProposer(k=4)``): each step
    verifies its ``k`` proposals per request on verify graphs and gains the accepted ones
    plus one, the tokens distributed as without it (:mod:`graphcap.engine.speculative`).
    Every graph is captured here; later calls capture nothing."""

    def __init__(self, model, tokenizer=None, *, strategy: str = "full", max_batch: int = 8,
                 max_len: int | None = None, prefill_tokens: int = 512,
                 attention: str | None = None, decode_attention: str | None = None,
                 page_size: int = 16, progress=True,
                 stop_at_eos: bool = True, long_prompts: bool = True, speculative=None):
        given, handling = model, sys.exc_info()[1]  # the caller's: not the build's
        try:  # a split model's ranks refuse together, else agree on the LLM they build
            with entry(given, "the build of an LLM", warm=True) as key:
                check_options(strategy, tokenizer, stop_at_eos, long_prompts, progress)
                # The sizes too, before a checkpoint is loaded or a model wrapped for them.
                max_batch = positive_int(max_batch, "max_batch")
                prefill_tokens = positive_int(prefill_tokens, "prefill_tokens")
                page_size = positive_int(page_size, "page_size")
                max_len = max_len if max_len is None else positive_int(max_len, "max_len")
                model, tokenizer = resolve(model, tokenizer)
                self.model, self.tokenizer, self.strategy = model, tokenizer, strategy
                self.shape = cache_shape(model)
                # End every request, as transformers' generate does (unless stop_at_eos=False).
                self.eos = eos_of(model, tokenizer) if stop_at_eos else set()
                warn_unapplied_defaults(model)
                self.max_batch = max_batch
                # A verify step writes k proposals past a request's last token: room for them.
                self.room = check_proposer(speculative) if speculative is not None else 0
                self.max_len = max_len_of(max_len, self.shape.max_position, self.room,
                                          proposer_max_len(speculative, DEFAULT_MAX_LEN))
                self.bound = max_len_bound(speculative, self.shape.max_position, self.room)
                self.cache = llm_cache(self.shape, max_batch, self.max_len, self.room, page_size,
                                       model_dtype(model), next(model.parameters()).device)
                if key is not None:
                    key.append(repr((strategy, max_batch, self.max_len, prefill_tokens,
                                     page_size, attention, decode_attention, self.room)))
            self._serving: dict[str, object] = {}  # "call": the call being served
            # A call prefills at most max_batch prompts of max_len - 1 tokens (a request
            # draws one at least): no graph past that, no extend graph unless one is longer.
            prefill_tokens = min(prefill_tokens, max_batch * (longest := self.max_len - 1))
            self.engine = Engine(model, self.cache, strategy, self.max_batch, prefill_tokens,
                                 chunked=long_prompts and longest > prefill_tokens,
                                 attention=attention, decode_attention=decode_attention,
                                 progress=progress or None, speculative=speculative,
                                 vocab=self.shape.vocab_size)
            self.engine.prefiller.config.tell_fallbacks = bool(long_prompts)  # eager: asked
        except BaseException as error:  # a transformers model wrapped here goes back as it came
            if model is not given and getattr(model, "first_wrapper", False):
                model.release()
            # The cache and graphs go now, not when the caller's except ends: a retry with
            # smaller sizes inside it finds the memory free. (The traceback keeps its lines,
            # its frames, and those of the errors it was raised from, lose their locals.)
            self.__dict__.clear()
            clear_frames(error, handling)
            raise

    # -- calls -----------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, *, sampling=None, stop=None,
                 speculate: bool = True) -> list[Completion]:
        """One :class:`Completion` per prompt, in order. ``prompts``: strings (with a
        tokenizer) or lists of token ids; ``sampling``: one ``graphcap.Sampling`` for all
        (each prompt then draws with its own seed) or one per prompt; ``stop``: token ids
        and, with a tokenizer, strings that end a request (the model's and the tokenizer's
        end-of-sequence ids do too, unless the LLM was built with ``stop_at_eos=False``);
        ``speculate=False``: plain decode steps even where the LLM has a proposer (its
        decode graphs are captured too)."""
        done: dict[int, Completion] = {}
        tokens: dict[int, list[int]] = {}
        # Text a step only to find stop strings: the completions' text is decoded once.
        deltas, strings, ids = self._stream(prompts, max_new_tokens, sampling, stop,
                                            speculate, texts=None)
        try:
            for delta in deltas:
                tokens.setdefault(delta.index, []).extend(delta.tokens)
                if delta.finish_reason is not None:
                    done[delta.index] = Completion(delta.index, tokens[delta.index],
                                                   None, delta.finish_reason)
        finally:  # a Ctrl-C between deltas: the stream lets go of the LLM now, not once
            deltas.close()  # the traceback holding it (the REPL's last one) is freed
        if self.tokenizer is not None:  # what the tokens add to the prompt's text
            for c in done.values():
                c.text = cut(text_of(self.tokenizer, ids[c.index][-CONTEXT:], c.tokens),
                             strings)[0]
        return [done[i] for i in range(len(done))]

    def stream(self, prompts, max_new_tokens: int = 64, *, sampling=None, stop=None,
               speculate: bool = True) -> Iterator[Delta]:
        """:meth:`generate`'s tokens as they are drawn: a :class:`Delta` per request per
        step (text deltas hold back a partial character and what may begin a stop
        string), the last one of each request saying why it ended. The arguments are
        checked here, before the first delta is asked for."""
        return self._stream(prompts, max_new_tokens, sampling, stop, speculate,
                            texts=True)[0]

    def _stream(self, prompts, max_new_tokens, sampling, stop, speculate: bool,
                texts: bool | None) -> tuple[Iterator[Delta], tuple[str, ...],
                                             list[list[int]]]:
        """:meth:`stream`, its deltas' text decoded each step only with ``texts`` (None:
        where there are stop strings to find), the stop strings and the prompts' ids. The
        arguments are checked here (a split model's ranks together), each read once."""
        with entry(self.model, "a stream of the LLM") as key:  # a split model's ranks
            ids = self._prompts(prompts)
            params = sampling_of(sampling, len(ids))
            max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
            stops, strings = self._stops(stop)
            check_length(ids, max_new_tokens, self.max_len, *self.bound)
            if key is not None:  # a split model's
                key.append(repr((ids, params, max_new_tokens, sorted(stops), strings,
                                 speculate)))
        texts = bool(strings) if texts is None else texts  # strings need a tokenizer
        requests = [Request(i, p, params[i]) for i, p in enumerate(ids)]
        return self._serve(requests, max_new_tokens, stops, strings,
                           boolean(speculate, "speculate"), texts), strings, ids

    def _serve(self, requests, max_new_tokens: int, stops: set[int],
               strings: tuple[str, ...], speculate: bool, text: bool) -> Iterator[Delta]:
        texts = {r.index: Detokenizer(self.tokenizer, strings, r.prompt[-CONTEXT:])
                 for r in requests} if text and self.tokenizer is not None else None
        call = object()  # the LLM is this call's once it claims it, in one step, inside
        try:             # the try: a Ctrl-C anywhere leaves it this call's to let go, or not
            try:
                if self._serving.setdefault("call", call) is not call:
                    raise GraphcapError("this LLM is serving another call (a stream not "
                                        "yet finished, or another thread's): one call at a "
                                        "time; finish or close the stream first")
                self.engine.clear()  # what a clean-up a Ctrl-C cut short left
                yield from self._loop(requests, max_new_tokens, stops, texts, speculate)
            finally:
                if self._serving.get("call") is call:  # not a refused call's
                    self.engine.clear()  # an error, or a stream left unfinished
                    del self._serving["call"]
        finally:  # again, where an error or a Ctrl-C cut the clean-up short
            if self._serving.get("call") is call:
                del self._serving["call"]

    def report(self) -> dict:
        """Per runner (decode, prefill, extend; verify and verify_sampled, speculation's
        greedy and sampled verify graphs): its ``runner.report()``; with a
        proposer, ``"speculative"``: verify steps, proposals, accepted ones, the mean
        acceptance length and the seconds in the proposer, the verify steps and the host
        (:class:`graphcap.engine.speculative.Counts`), and ``replays`` and ``fallbacks``
        over every runner of the speculative loop (the verify runners and the proposer's:
        a fallback is a step that ran eagerly)."""
        out = {name: runner.report() for name, runner in self.engine.runners().items()}
        verifier = self.engine.verifier
        if verifier is not None:
            spec = out["speculative"] = verifier.counts.report()
            if callable(getattr(verifier.proposer, "report", None)):
                spec["proposer"] = verifier.proposer.report()
            # every graph of the loop: the verify runners' and the proposer's own
            spec.update(graph_calls([out["verify"], out["verify_sampled"],
                                     spec.get("proposer", {})]))
        return out

    def __reduce_ex__(self, protocol):  # deepcopy and pickle (of an accelerated model)
        raise TypeError("an LLM holds its captured graphs and K/V cache: it is not copied "
                        "or pickled; build another LLM of the model (an accelerated "
                        "transformers model: graphcap.restore(model) first)")

    # -- the loop --------------------------------------------------------------------
    def _loop(self, requests, max_new: int, stops: set[int], texts, speculate: bool
              ) -> Iterator[Delta]:
        engine, waiting = self.engine, deque(requests)
        filling: dict[int, int] = {}  # long prompts' slots -> where their next chunk starts
        while waiting or engine.live:
            admitted = []
            for slot in range(self.max_batch):
                if slot not in engine.live and waiting:
                    request = waiting.popleft()
                    engine.admit(slot, request, max_new + self.room)
                    if engine.extender is not None and \
                            len(request.prompt) > engine.prefill_tokens:
                        filling[slot] = 0  # in chunks, between decode steps
                    else:
                        admitted.append(slot)
            yield from self._take(engine.prefill(admitted), max_new, stops, texts)
            slots = sorted(s for s in engine.live if s not in filling)
            if not slots:  # nothing decodes: a long prompt's chunks back to back
                while filling:
                    joined = self._fill(filling)
                    yield from self._take(joined, max_new, stops, texts)
                continue
            if engine.verifier is not None and speculate:  # a verify step, then a chunk
                yield from self._speculate(slots, filling, max_new, stops, texts)
                continue
            tokens = torch.tensor([engine.live[s].last for s in slots],
                                  device=self.cache.device)
            drawn = _Fetch(engine.launch(slots, tokens))
            while True:  # the same requests step on, each step launched before the read
                ending = any(len(engine.live[s].new) + 1 >= max_new for s in slots)
                ahead = None if ending else _Fetch(engine.launch(slots, drawn.device))
                joined = self._fill(filling) if filling else []  # a chunk every step
                read = list(zip(slots, drawn.tokens(), strict=True))
                ended = yield from self._take(read, max_new, stops, texts)
                if ahead is None:
                    yield from self._take(joined, max_new, stops, texts)
                    break
                if ended or joined:  # the requests in flight change: the step ahead's
                    # tokens are those of the requests still live, then the joined one's
                    read = zip(slots, ahead.tokens(), strict=True)
                    yield from self._take([(s, t) for s, t in read if s in engine.live],
                                          max_new, stops, texts)
                    yield from self._take(joined, max_new, stops, texts)
                    break
                drawn = ahead

    def _speculate(self, slots: list[int], filling: dict[int, int], max_new: int,
                   stops: set[int], texts) -> Iterator[Delta]:
        """One verify step of the requests in ``slots``; each request's gained tokens in
        order, up to one that ends it (the rest dropped): one delta a request, or with a
        tokenizer one a token (the text is cut by stop strings token by token); then a
        chunk of a long prompt."""
        engine = self.engine
        gained = engine.verifier.step({s: engine.live[s] for s in slots})
        for slot in slots:
            if self.tokenizer is None:  # no text to cut: the step's tokens in one delta
                yield self._gain(slot, gained[slot], max_new, stops)
                continue
            for token in gained[slot]:
                if slot not in engine.live:  # ended on an earlier token of this step
                    break
                yield from self._take([(slot, token)], max_new, stops, texts)
        if filling:
            yield from self._take(self._fill(filling), max_new, stops, texts)

    def _gain(self, slot: int, tokens: list[int], max_new: int, stops: set[int]) -> Delta:
        """A request's tokens of one verify step, up to one that ends it (the rest
        dropped), as one delta; the request released if it ended."""
        request = self.engine.live[slot]
        taken, reason = [], None
        for token in tokens:
            taken.append(token)
            reason = ends_on(token, len(request.new) + len(taken), stops, max_new)
            if reason is not None:
                break
        request.new.extend(taken)
        if reason is not None:
            self.engine.release(slot)
        return Delta(request.index, taken, None, reason)

    def _fill(self, filling: dict[int, int]) -> list[tuple[int, int]]:
        """One chunk of the first long prompt in ``filling``; once its last is in, its
        first new token (and it leaves ``filling``): ``(slot, token)`` pairs."""
        slot = next(iter(filling))
        filling[slot], logits = self.engine.chunk(slot, filling[slot])
        if logits is None:
            return []
        del filling[slot]
        request = self.engine.live[slot]
        return [(slot, self.engine.first_tokens([request], logits)[0])]

    def _take(self, drawn, max_new: int, stops: set[int], texts) -> Iterator[Delta]:
        """The drawn ``(slot, token)`` pairs into their requests, a delta each; a request
        that ends is released. Returns whether any ended."""
        ended = False
        for slot, token in drawn:
            request = self.engine.live[slot]
            request.new.append(token)
            reason = ends_on(token, len(request.new), stops, max_new)
            text = None
            if texts is not None:
                text, hit = texts[request.index].add([token], reason is not None)
                if hit and reason != "stop":  # a stop string ends it, at length or not
                    reason = "stop_string"
            if reason is not None:
                self.engine.release(slot)
                ended = True
            yield Delta(request.index, [token], text, reason)
        return ended

    def _prompts(self, prompts) -> list[list[int]]:
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                        and all(isinstance(p, str) for p in prompts)):
            check_encodes(self.tokenizer)
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            prompts = [self.tokenizer(t)["input_ids"] for t in texts]
            if (empty := next((i for i, p in enumerate(prompts) if not p), None)) is not None:
                raise BadBatch(f"prompt {empty} is text that tokenizes to no ids "
                               f"({texts[empty]!r}): give each prompt some text")
        elif isinstance(prompts, (list, tuple)) and any(isinstance(p, str) for p in prompts):
            text = next(i for i, p in enumerate(prompts) if isinstance(p, str))
            ids = next(i for i, p in enumerate(prompts) if not isinstance(p, str))
            raise BadBatch(f"the prompts mix text (prompt {text}) and token ids (prompt "
                           f"{ids}): give every prompt as text, or every one as token ids")
        return check_prompts(prompts, self.shape.vocab_size)

    def _stops(self, stop) -> tuple[set[int], tuple[str, ...]]:
        ids, strings = stops_of(stop, self.tokenizer is not None, self.shape.vocab_size)
        return ids | self.eos, strings


class _Fetch:
    """A launched step's tokens on their way to the host: the copy is queued right after
    the step, so reading them waits for that step only, not for one launched after it."""

    def __init__(self, device: torch.Tensor):
        self.device, self.done = device, None
        if device.device.type == "cuda":
            self.host = torch.empty(device.shape, dtype=device.dtype, pin_memory=True)
            self.host.copy_(device, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(device.device))  # the copy's GPU's

    def tokens(self) -> list[int]:
        if self.done is None:
            return self.device.tolist()
        self.done.synchronize()
        return self.host.tolist()
