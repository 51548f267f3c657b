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
import dataclasses
import operator
from collections import deque
from dataclasses import dataclass, field

import torch

from graphcap.api import STRATEGIES, capture, model_dtype
from graphcap.core.buckets import decode_ladder
from graphcap.core.checks import positive_int
from graphcap.engine.eager import last_token_logits
from graphcap.errors import BadBatch, UnsupportedModel
from graphcap.inputs.cache_prefill import CachePrefillInputs
from graphcap.inputs.decode import DecodeInputs
from graphcap.inputs.sampling import Sampling, draw
from graphcap.kv.paged import PagedKVCache
from graphcap.opsdb.attention import get_backend
from graphcap.progress import progress as progress_bar


@dataclass
class Generation:
    """The new tokens of each prompt (a stop token that ended one included), in the
    order of the prompts, and what it took."""

    tokens: list[list[int]]
    report: dict = field(default_factory=dict)


def _check_prompts(prompts, vocab: int) -> list[list[int]]:
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        head = ", ".join(map(str, prompts[:6])) + (", ..." if len(prompts) > 6 else "")
        raise ValueError(f"prompts is a list of token-id lists, one per prompt: for one "
                         f"prompt pass [[{head}]], not [{head}]")
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = p.tolist() if isinstance(p, torch.Tensor) and p.dim() == 1 else list(p)
        except TypeError:  # a number, or a 0-d tensor
            ids = None
        if not ids or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab
                          for t in ids):  # before anything launches (BadBatch: a ValueError)
            raise BadBatch(f"prompt {i} must be a non-empty list of token ids in "
                           f"[0, {vocab}), got {p!r}")
        out.append(ids)
    return out


def _token_id(value) -> int:
    """``value`` as an int; TypeError for a bool (no token id, though ``True == 1``)."""
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def _stop_tokens(stop_tokens, vocab: int) -> set[int]:
    if stop_tokens is None:
        return set()
    given = stop_tokens
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    elif isinstance(stop_tokens, int):
        stop_tokens = [stop_tokens]
    try:
        stops = {_token_id(t.item() if isinstance(t, torch.Tensor) else t)
                 for t in stop_tokens}
    except TypeError:
        raise ValueError(f"stop_tokens must be token ids (ints), got {given!r}") \
            from None
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError(f"stop_tokens {sorted(stops)} must lie in [0, {vocab})")
    return stops


def _sampling_of(sampling, count: int) -> list[Sampling]:
    """One Sampling per prompt. One given for all: each prompt draws with a seed of its
    own, derived from it and the prompt's index (the same prompt twice draws twice)."""
    if sampling is None:
        return [Sampling()] * count
    if isinstance(sampling, Sampling):
        return [dataclasses.replace(sampling, seed=(sampling.seed * 1000003 + i) % 2**63)
                for i in range(count)]
    try:
        sampling = list(sampling)
    except TypeError:
        raise ValueError(f"sampling must be a graphcap.Sampling (one for all prompts), a "
                         f"list of them (one per prompt) or None, got {sampling!r}") from None
    if len(sampling) != count:
        raise ValueError(f"sampling: one Sampling for every prompt, or one for all; got "
                         f"{len(sampling)} for {count} prompts")
    for i, s in enumerate(sampling):
        if not isinstance(s, Sampling):
            raise ValueError(f"sampling[{i}] must be a graphcap.Sampling, got {s!r}")
    return sampling


@dataclass(frozen=True)
class CacheShape:
    layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_position: int


def cache_shape(model) -> CacheShape:
    """The cache a model needs: a reference decoder's ``args``, or, for a stock
    transformers model under ``graphcap.hf.PrefillLM``, the keys and values its attention
    layers receive (``kv_shapes``, found when it was wrapped: MLA's keys have all query
    heads and a head dim no config field names alone)."""
    args = getattr(model, "args", None)
    if args is not None:  # a TP decoder caches its own key/value heads (local_args)
        local = getattr(model, "local_args", args)
        return CacheShape(args.layers, local.kv_heads, args.head_dim, args.vocab_size,
                          args.max_position)
    shapes = getattr(model, "kv_shapes", None)
    if getattr(model, "hf_model", None) is None or shapes is None:
        raise UnsupportedModel(
            f"graphcap.generate runs graphcap's reference decoders (graphcap.models) and "
            f"stock transformers models wrapped in graphcap.hf.PrefillLM; "
            f"{type(model).__name__} is neither")
    kind, found = type(model.hf_model).__name__, sorted(set(shapes.values()))
    if len(found) != 1:
        raise UnsupportedModel(
            f"{kind}: graphcap's paged K/V cache holds one [kv heads, head dim] for every "
            f"layer, and its attention layers with an int layer_idx give {found or 'none'}; "
            "generate with transformers (its own attention: hf_model.set_attn_implementation"
            "('sdpa'), then hf_model.generate())")
    (heads, head_dim), = found
    return CacheShape(max(shapes) + 1, heads, head_dim, model.vocab_size,
                      model.max_position or 2**31)


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
    prompts = _check_prompts(prompts, args.vocab_size)
    params = _sampling_of(sampling, len(prompts))
    max_new_tokens = positive_int(max_new_tokens, "max_new_tokens")
    stops = _stop_tokens(stop_tokens, args.vocab_size)
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
    runner = capture(model, strategy, buckets=decode_ladder(max_batch),
                     inputs=DecodeInputs(cache, sample=True))
    rows_of = getattr(model, "output_rows", "tokens")
    backend = get_backend(None, device, strategy=strategy, dtype=cache.dtype)
    prefiller = capture(model, strategy, buckets=decode_ladder(prefill_tokens),
                        inputs=CachePrefillInputs(cache, backend, max_batch, rows_of,
                                                  name=type(model).__name__))

    def prefill(slots: list[int]) -> list[int]:
        """The prompts of ``slots`` into the cache, on the prefill graphs; the first new
        token of each, drawn as the decode graphs draw."""
        lens = [live[s]["length"] for s in slots]
        ids = torch.tensor(sum((prompts[live[s]["index"]] for s in slots), []),
                           device=device)
        positions = torch.cat([torch.arange(n, device=device) for n in lens])
        logits = last_token_logits(prefiller(ids, positions, seq_lens=lens, slots=slots),
                                   lens, rows_of)
        return draw(logits, [params[live[s]["index"]] for s in slots], lens)
    waiting = deque(range(len(prompts)))
    live: dict[int, dict] = {}  # request slot -> its request's index, tokens, length
    out: list[list[int] | None] = [None] * len(prompts)
    steps = prefills = 0
    total = len(prompts) * max_new_tokens
    show = progress if progress is not None else total >= LONG_RUN
    bar = progress_bar(total, "generating") if show else \
        contextlib.nullcontext(lambda label="": None)

    def emit(slot: int, token: int, step) -> None:
        state = live[slot]
        state["new"].append(token)
        state["last"] = token
        step()
        if token in stops or len(state["new"]) == max_new_tokens:
            out[state["index"]] = state["new"]
            cache.release(slot)
            del live[slot]

    with bar as step:
        while waiting or live:
            admitted = []
            for slot in range(max_batch):
                if slot not in live and waiting:
                    i = waiting.popleft()
                    cache.admit(slot, len(prompts[i]) + max_new_tokens)
                    live[slot] = {"index": i, "new": [], "length": len(prompts[i])}
                    admitted.append(slot)
            for group in _groups(admitted, [live[s]["length"] for s in admitted],
                                 prefill_tokens):
                drawn = prefill(group)
                prefills += 1
                for slot, token in zip(group, drawn, strict=True):
                    emit(slot, token, step)
            if not live:
                continue
            rows = sorted(live)
            positions = [live[s]["length"] for s in rows]
            tokens = torch.tensor([live[s]["last"] for s in rows], device=device)
            drawn = runner(tokens, positions=positions, slots=rows,  # drawn in the graph
                           sampling=[params[live[s]["index"]] for s in rows]).tolist()
            steps += 1
            for slot, token in zip(rows, drawn, strict=True):
                live[slot]["length"] += 1
                emit(slot, token, step)
    report, prefilled = runner.report(), prefiller.report()
    return Generation(out, {"decode_steps": steps, "prefills": prefills,
                            "replays": dict(report.get("replays", {})),
                            "fallbacks": dict(report.get("fallbacks", {})),
                            "prefill_replays": dict(prefilled.get("replays", {})),
                            "prefill_fallbacks": dict(prefilled.get("fallbacks", {})),
                            "graph_pool_bytes": (report.get("graph_pool_bytes") or 0)
                            + (prefilled.get("graph_pool_bytes") or 0),
                            "buckets": decode_ladder(max_batch),
                            "prefill_buckets": decode_ladder(prefill_tokens)})
