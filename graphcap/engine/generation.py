"""``graphcap.generate``: generate tokens for a list of prompts on graphs.

The decode batch is kept full: up to ``max_batch`` requests decode together, and a
finished request's slot takes the next waiting prompt. The prompts admitted together are
prefilled into the cache in calls of at most ``prefill_tokens`` tokens, each replaying a
prefill graph (:class:`~graphcap.inputs.CachePrefillInputs`); each decode step replays the
graph of the smallest batch bucket that holds the live requests
(:class:`~graphcap.inputs.DecodeInputs`), and each token is drawn by ``graphcap::sample``
from per-request parameters on the device (greedy, or seeded temperature / top-k /
top-p: the same tokens in every strategy).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from graphcap.api import STRATEGIES, model_dtype
from graphcap.core.checks import positive_int
from graphcap.engine.arguments import check_prompts, sampling_of, stop_tokens_of
from graphcap.engine.engine import Engine, Request
from graphcap.errors import UnsupportedModel
from graphcap.kv.paged import PagedKVCache
from graphcap.progress import progress as progress_bar


@dataclass
class Generation:
    """The new tokens of each prompt (a stop token that ended one included), in the
    order of the prompts, and what it took."""

    tokens: list[list[int]]
    report: dict = field(default_factory=dict)


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def cache_shape(model) -> CacheShape:
    """The cache a model generates with, from what it declares (docs/models.md,
    "Generate with your model"): ``graphcap_kv`` = (layers, kv heads, head dim) of the
    keys and values its attention layers keep, ``vocab_size``, and ``max_position``
    where it has one. graphcap's reference decoders and ``graphcap.hf.PrefillLM`` declare
    them; a model that does not is refused, naming what is missing."""
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
    return CacheShape(layers, heads, head_dim, positive_int(vocab, f"{name}.vocab_size"),
                      positive_int(max_position, f"{name}.max_position")
                      if max_position else 2**31)


LONG_RUN = 2048  # tokens to generate from which generate() shows a progress bar


def generate(model, prompts, max_new_tokens: int, *, strategy: str = "full",
             max_batch: int = 8, stop_tokens=(), sampling=None, page_size: int = 16,
             prefill_tokens: int = 512, progress: bool | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` tokens for each of ``prompts`` (lists of token
    ids) with ``model``, one of graphcap's reference decoders (``graphcap.models``) or a
    stock transformers model wrapped in ``graphcap.hf.PrefillLM``: ``strategy`` (any of
    :data:`graphcap.api.STRATEGIES`) captures the prefill and decode calls; ``max_batch``
    requests decode together; a request ends at one of ``stop_tokens`` or at its
    ``max_new_tokens``; ``sampling`` is one :class:`Sampling` per prompt, or one for all
    (each prompt then draws with its own seed, derived from that one and its index);
    ``prefill_tokens`` bounds the prefill graphs (prompts admitted together are prefilled
    in calls of at most that many tokens; a longer prompt prefills eagerly, counted in
    the report's ``prefill_fallbacks``). ``progress``: a bar of the tokens generated
    (``None``: on runs of at least ``LONG_RUN`` tokens).

        out = graphcap.generate(model, [[1, 5, 9], [1, 7]], max_new_tokens=32)
        out.tokens            # [[...], [...]]
        out.report            # steps, replays, fallbacks, graph pool bytes
    """
    args = cache_shape(model)
    prompts = check_prompts(prompts, args.vocab_size)
    params = sampling_of(sampling, len(prompts))
    max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
    stops = stop_tokens_of(stop_tokens, args.vocab_size)
    device = next(model.parameters()).device
    longest = max(map(len, prompts)) + max_new_tokens
    if longest > args.max_position:
        raise ValueError(f"a prompt of {longest - max_new_tokens} tokens plus "
                         f"{max_new_tokens} new ones passes the model's max_position "
                         f"{args.max_position}")
    max_batch = positive_int(max_batch, "max_batch")
    prefill_tokens = positive_int(prefill_tokens, "prefill_tokens")
    if strategy not in STRATEGIES:
        raise ValueError(f"generate(strategy={strategy!r}): unknown strategy, choose one of "
                         f"{sorted(STRATEGIES)}")
    max_batch = min(max_batch, len(prompts))
    cache = PagedKVCache(args.layers, args.kv_heads, args.head_dim, max_requests=max_batch,
                         max_len=longest, page_size=page_size, dtype=model_dtype(model),
                         device=device)
    engine = Engine(model, cache, strategy, max_batch, prefill_tokens)
    waiting = deque(Request(i, p, params[i]) for i, p in enumerate(prompts))
    out: list[list[int] | None] = [None] * len(prompts)
    total = len(prompts) * max_new_tokens
    show = progress if progress is not None else total >= LONG_RUN
    bar = progress_bar(total, "generating") if show else \
        contextlib.nullcontext(lambda label="": None)

    def emit(drawn: list[tuple[int, int]], step) -> None:
        for slot, token in drawn:
            request = engine.live[slot]
            request.new.append(token)
            step()
            if token in stops or len(request.new) == max_new_tokens:
                out[engine.release(slot).index] = request.new

    with bar as step:
        while waiting or engine.live:
            admitted = []
            for slot in range(max_batch):
                if slot not in engine.live and waiting:
                    engine.admit(slot, waiting.popleft(), max_new_tokens)
                    admitted.append(slot)
            emit(engine.prefill(admitted), step)
            if engine.live:
                emit(engine.step(), step)  # drawn in the graph
    return Generation(out, engine.report(max_batch))
