"""``graphcap.generate``: generate tokens for a list of prompts on graphs, one shot: it
builds a :class:`~graphcap.engine.llm.LLM` for the call.

The decode batch is kept full: up to ``max_batch`` requests decode together, and a
finished request's slot takes the next waiting prompt. The prompts admitted together are
prefilled into the cache in calls of at most ``prefill_tokens`` tokens, each replaying a
prefill graph (:class:`~graphcap.inputs.CachePrefillInputs`); each decode step replays the
graph of the smallest batch bucket that holds the live requests
(:class:`~graphcap.inputs.DecodeInputs`), and each token is drawn on the device after it
from per-request parameters (:func:`graphcap.inputs.sampling.pick`: greedy, or seeded
temperature / top-k / top-p: the same tokens in every strategy).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from graphcap.core.checks import boolean, positive_int
from graphcap.engine.arguments import check_prompts, sampling_of, stop_tokens_of
from graphcap.engine.engine import cache_shape
from graphcap.engine.llm import LLM
from graphcap.engine.loading import resolve
from graphcap.engine.speculative import check_proposer
from graphcap.progress import progress as progress_bar
from graphcap.tp.group import entry


@dataclass
class Generation:
    """The new tokens of each prompt (a stop token that ended one included), in the
    order of the prompts, and what it took."""

    tokens: list[list[int]]
    report: dict = field(default_factory=dict)


LONG_RUN = 2048  # tokens to generate from which generate() shows a progress bar


def generate(model, prompts, max_new_tokens: int, *, strategy: str = "full",
             max_batch: int = 8, stop_tokens=(), sampling=None, page_size: int = 16,
             prefill_tokens: int = 512, progress: bool | None = None,
             speculative=None) -> Generation:
    """Generate up to ``max_new_tokens`` tokens for each of ``prompts`` (lists of token
    ids) with ``model`` (any model :class:`~graphcap.engine.llm.LLM` takes), on an
    ``LLM`` built for this call (its graphs captured for it): ``strategy`` (any of
    :data:`graphcap.api.STRATEGIES`) captures the prefill and decode calls; ``max_batch``
    requests decode together; a request ends at one of ``stop_tokens`` or at its
    ``max_new_tokens``; ``sampling`` is one :class:`Sampling` per prompt, or one for all
    (each prompt then draws with its own seed, derived from that one and its index);
    ``prefill_tokens`` bounds the prefill graphs (prompts admitted together are prefilled
    in calls of at most that many tokens; a longer prompt in chunks of that many, on
    graphs). Only ``stop_tokens`` end a request early (not the model's end-of-sequence
    id unless given). ``progress``: a bar of the tokens generated (``None``: on runs of at
    least ``LONG_RUN`` tokens). ``speculative``: a proposer (``k`` and
    ``propose(tokens)``) whose proposals verify graphs check (``LLM``'s). Build an ``LLM``
    once to generate many times. A transformers model passed as it is is wrapped for the
    call (``graphcap.hf.PrefillLM``) and goes back as it came, unless a wrapper of it
    lives.

        out = graphcap.generate(model, [[1, 5, 9], [1, 7]], max_new_tokens=32)
        out.tokens            # [[...], [...]]
        out.report            # steps, replays, fallbacks, graph pool bytes
    """
    given = model
    model, _ = resolve(model)  # wrapped once, here: the LLM below takes it as it is
    # A transformers model wrapped for this call alone goes back as it came, to be called
    # or to generate() on its own again.
    wrapped = model is not given and getattr(model, "first_wrapper", False)
    try:
        return _generate(model, prompts, max_new_tokens, strategy, max_batch, stop_tokens,
                         sampling, page_size, prefill_tokens, progress, speculative)
    finally:
        if wrapped:
            model.release()


def _generate(model, prompts, max_new_tokens, strategy, max_batch, stop_tokens, sampling,
              page_size, prefill_tokens, progress, speculative) -> Generation:
    with entry(model, "generate()") as key:  # a split model's ranks refuse together
        shape = cache_shape(model)
        prompts = check_prompts(prompts, shape.vocab_size)
        params = sampling_of(sampling, len(prompts))
        max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
        stops = stop_tokens_of(stop_tokens, shape.vocab_size)
        longest = max(map(len, prompts)) + max_new_tokens
        ahead = check_proposer(speculative) if speculative is not None else 0
        if longest + ahead > shape.max_position:
            k = f" and the {ahead} proposals a verify step writes past them" if ahead else ""
            raise ValueError(f"a prompt of {longest - max_new_tokens} tokens plus "
                             f"{max_new_tokens} new ones{k} pass the model's max_position "
                             f"{shape.max_position}: generate fewer tokens, or from a "
                             "shorter prompt")
        if progress is not None:
            boolean(progress, "progress")
        max_batch = positive_int(max_batch, "max_batch")
        prefill_tokens = positive_int(prefill_tokens, "prefill_tokens")
        if key is not None:  # a split model's: the LLM built for the call alike
            key.append(repr((strategy, max_batch, page_size, prefill_tokens, ahead,
                             [len(p) for p in prompts], max_new_tokens)))
    llm = LLM(model, strategy=strategy, max_batch=min(max_batch, len(prompts)),
              max_len=longest, prefill_tokens=prefill_tokens, page_size=page_size,
              progress=False, stop_at_eos=False,
              long_prompts=max(map(len, prompts)) > prefill_tokens,
              speculative=speculative)
    total = len(prompts) * max_new_tokens
    show = progress if progress is not None else total >= LONG_RUN
    bar = progress_bar(total, "generating") if show else \
        contextlib.nullcontext(lambda label="": None)
    tokens: list[list[int]] = [[] for _ in prompts]
    try:
        with bar as step:
            for delta in llm.stream(prompts, max_new_tokens, sampling=params,
                                    stop=sorted(stops)):
                tokens[delta.index] += delta.tokens
                for _ in delta.tokens:  # a verify step's delta may bring several
                    step()
        return Generation(tokens, llm.engine.report())  # with a proposer, its counts too
    finally:  # a draft model or head goes back, its graphs and cache freed: reusable
        if llm.engine.verifier is not None:
            llm.engine.verifier.unbind()
