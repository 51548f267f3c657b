"""``assert_replay_equivalent``: captured output equals eager, for every generated batch and
for sequences of calls, under each strategy."""

from __future__ import annotations

import time
from collections import Counter

import torch
from torch.utils._pytree import tree_flatten

import graphcap
from graphcap.api import GRAPHED, _device_of, model_dtype
from graphcap.testing.strategies import full_batch, prefill_batches


def _default_tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 3e-2}.get(dtype, 0.0)


def _close(got, want, label: str, atol: float, worst: list) -> None:
    """Each tensor of a (nested) output against eager's, which has the same structure."""
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec, (f"{label}: captured output is {got_spec}, eager's "
                                   f"{want_spec}")
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(g, torch.Tensor) and g.numel() and w.shape == g.shape:
            worst[0] = max(worst[0], (g.double() - w.double()).abs().max().item())
        torch.testing.assert_close(g, w, atol=atol, rtol=atol,
                                   msg=lambda m: f"{label}: captured output differs: {m}")


def _embedding_rows(model) -> int:
    """The rows of the model's first embedding table (its vocabulary), else 2 (ids 1)."""
    table = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return table.num_embeddings if table is not None else 2


def assert_replay_equivalent(model_or_factory, strategies=GRAPHED, batches=None, *,
                             max_tokens: int = 64, max_requests: int = 4,
                             buckets=None, attention: str | None = None,
                             vocab: int | None = None, examples: int = 20,
                             sequences: int = 5, atol: float | None = None,
                             compiler: str = "eager") -> dict:
    """Check a prefill model (``forward(input_ids, positions)``) under each strategy:
    every generated batch, and every call of random call sequences (fallbacks included),
    equals the same model run eagerly with the same attention backend. Returns by
    strategy the runner's report (its ``attention``: the backend the model's forward
    called, None if none; its ``fallbacks``: those of every runner the check made, the
    call sequences' included) plus ``max_error`` and ``build_wall_s``; raises AssertionError
    with the shrunk failing batch.

    ``batches``: a hypothesis strategy of ``(input_ids, positions, seq_lens)`` (default
    :func:`prefill_batches`, token ids below ``vocab``: the model's ``vocab_size``, else
    its first embedding table's rows; with it, :func:`full_batch` is checked after the
    ``examples`` drawn). ``attention``: the backend (default: the best one allowed
    under every strategy asked for). ``compiler``: tc_piecewise's piece compiler
    (``"eager"`` or ``"inductor"``)."""
    model = model_or_factory() if not isinstance(model_or_factory, torch.nn.Module) \
        else model_or_factory
    strategies = (strategies,) if isinstance(strategies, str) else tuple(strategies)
    device = _device_of(model)
    dtype = model_dtype(model) or torch.float32
    tol = atol if atol is not None else _default_tolerance(dtype)
    if attention is None:
        from graphcap.opsdb.attention import get_backend

        attention = get_backend(None, device, strategy="full", dtype=dtype).name
    vocab = vocab or getattr(model, "vocab_size", None) or getattr(
        getattr(model, "args", None), "vocab_size", None) or _embedding_rows(model)
    top = max(buckets) if buckets else max_tokens
    # Sequences also draw batches past the largest bucket and the slots: fallbacks.
    # A model with a row per request (last-token logits) takes no empty requests.
    min_len = 1 if getattr(model, "output_rows", "tokens") == "requests" else 0
    wide = prefill_batches(2 * top, max_requests + 2, vocab, device=device, min_len=min_len)
    # With the default batches, the fullest one is checked first, whatever is drawn.
    full = None if batches else full_batch(top, max_requests, vocab, device=device,
                                           min_len=min_len)
    batches = batches or prefill_batches(top, max_requests, vocab, device=device,
                                         min_len=min_len)
    kwargs = dict(buckets=buckets, max_tokens=None if buckets else max_tokens,
                  max_requests=max_requests, attention=attention)
    truth = graphcap.capture(model, "eager", **kwargs)
    reports = {}
    for strategy in strategies:
        opts = dict(kwargs, compiler=compiler) if strategy == "tc_piecewise" else kwargs
        reports[strategy] = _check_strategy(model, strategy, opts, truth, batches, wide,
                                            full, tol, examples, sequences, attention)
    return reports


def _check_strategy(model, strategy, kwargs, truth, batches, wide, full, tol, examples,
                    sequences, attention) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    start = time.perf_counter()
    runner = graphcap.capture(model, strategy, **kwargs)
    build_s = time.perf_counter() - start
    label = f"{strategy}/{attention}"
    worst = [0.0]
    fallbacks = Counter()  # the sequences' runners', beside the batches' runner's
    # One failure, shrunk: several distinct ones would come as an ExceptionGroup.
    quiet = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                 report_multiple_bugs=False)

    def check(batch):
        ids, pos, lens = batch
        _close(runner(ids, pos, seq_lens=lens), truth(ids, pos, seq_lens=lens),
               f"{label} {lens}", tol, worst)

    @settings(max_examples=examples, **quiet)
    @given(batch=batches)
    def one_batch(batch):
        check(batch)

    @settings(max_examples=sequences, **quiet)
    @given(calls=st.lists(st.one_of(batches, wide), min_size=2, max_size=6))
    def call_sequence(calls):
        # A fresh runner per sequence: a failure depends on this sequence alone.
        fresh = graphcap.capture(model, strategy, **kwargs)
        for i, (ids, pos, lens) in enumerate(calls):
            _close(fresh(ids, pos, seq_lens=lens), truth(ids, pos, seq_lens=lens),
                   f"{label} call {i} of {[c[2] for c in calls]}", tol, worst)
        stats = fresh.stats
        fallbacks.update(stats.fallbacks)
        assert stats.calls == sum(stats.replays.values()) + sum(
            stats.fallbacks.values()) + stats.failed, (
            f"{label}: a call neither replayed, fell back nor failed")

    one_batch()  # a failure drawn here comes shrunk
    if full is not None:
        check(full)
    call_sequence()
    # "attention": the backend the model's forward called (None: it called none).
    report = runner.report()
    report["fallbacks"] = dict(Counter(report["fallbacks"]) + fallbacks)
    return {**report, "max_error": worst[0], "build_wall_s": round(build_s, 3)}
