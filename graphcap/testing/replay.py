"""``assert_replay_equivalent``: captured output equals eager, for every generated batch and
for sequences of calls, under each strategy."""

from __future__ import annotations

import copy
import time
import warnings
from collections import Counter

import torch
from torch.utils._pytree import tree_flatten

import graphcap
from graphcap.api import GRAPHED, _device_of, backend_for, model_dtype
from graphcap.testing.strategies import bucket_batches, full_batch, prefill_batches


def _default_tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-2,
            torch.bfloat16: 3e-2}.get(dtype, 0.0)


def _close(got, want, label: str, atol: float | None, worst: list, base: float = 0.0
           ) -> None:
    """Each tensor of a (nested) output against eager's, which has the same structure:
    floats within ``atol`` (NaN where eager has NaN), integers and booleans exactly (a
    token id within a float tolerance of eager's is another token)."""
    got_leaves, got_spec = tree_flatten(got)
    want_leaves, want_spec = tree_flatten(want)
    assert got_spec == want_spec, (f"{label}: captured output is {got_spec}, eager's "
                                   f"{want_spec}")
    for g, w in zip(got_leaves, want_leaves, strict=True):
        if isinstance(g, torch.Tensor) and g.numel() and w.shape == g.shape:
            diff = (g.double() - w.double()).abs()
            diff = diff[~diff.isnan()]  # NaN on both sides: equal (on one: assert_close)
            if diff.numel():
                worst[0] = max(worst[0], diff.max().item())
        tol = _tolerance(g, atol, base)
        torch.testing.assert_close(g, w, atol=tol, rtol=tol, equal_nan=True,
                                   msg=lambda m: f"{label}: captured output differs: {m}")


def _tolerance(t, atol: float | None, base: float) -> float:
    """How far a value of ``t`` may be from eager's: integers, booleans and non-tensors
    exactly; floats within the caller's ``atol``, else the looser of the model dtype's
    (``base``) and ``t``'s own (a bfloat16 output of a float32 model rounds a 1e-6
    difference to an ulp)."""
    if not (isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())):
        return 0.0
    return atol if atol is not None else max(base, _default_tolerance(t.dtype))


def _buffers(model) -> dict:
    """The model's buffers by name, as they are now (copies)."""
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def _same_writes(model, reference, before: tuple, label: str, atol, base: float) -> None:
    """What the call wrote into the model's buffers against what eager's wrote into the
    reference's (a cache a forward fills, which its outputs need not read): wherever
    either call changed a buffer, both hold the same after it, as outputs compare.
    Elements neither changed may differ (a capture's warm-up wrote the model's)."""
    mine, eager = dict(model.named_buffers()), dict(reference.named_buffers())
    for name, old in before[0].items():
        new, ref, ref_old = mine.get(name), eager.get(name), before[1].get(name)
        if new is None or ref is None or ref_old is None or not (
                new.shape == old.shape == ref.shape == ref_old.shape) or \
                new.dtype != ref.dtype:
            continue  # replaced or reshaped by Python code: the outputs show its effect
        changed = _changed(new, old) | _changed(ref, ref_old)
        if not changed.any():
            continue
        tol = _tolerance(new, atol, base)
        try:
            torch.testing.assert_close(
                new[changed], ref[changed], atol=tol, rtol=tol, equal_nan=True,
                msg=lambda m, name=name: (
                    f"{label}: the forward writes its buffer {name!r}, and the captured "
                    f"call left other values in it than eager's ({m})"))
        except AssertionError:
            # Eager's from the captured one's: hypothesis calls the batch again to shrink
            # it, which must see the same write differ, not a write of what is there.
            with torch.no_grad():
                ref.copy_(new)
            raise


def _changed(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Where ``new`` differs from ``old`` (NaN where both are NaN: unchanged)."""
    if not new.is_floating_point():
        return new != old
    return (new != old) & ~(new.isnan() & old.isnan())


def eager_copy(model):
    """The reference: a copy of the model as it was before any capture, so that what a
    capture's warm-up leaves in it (a scale calibrated on the warm-up's dummy batch, a
    counter) is not shared by eager. None where the model cannot be copied, or where a
    copy would not be the same model (the check then runs eager on the model itself)."""
    from torch.nn.modules.lazy import LazyModuleMixin

    try:
        lazy = [n for n, m in model.named_modules() if isinstance(m, LazyModuleMixin)
                and m.has_uninitialized_params()]
        if lazy:  # a copy's first forward would draw other weights than the model's
            raise TypeError(f"its lazy module {lazy[0] or 'itself'} has no weights yet")
        return copy.deepcopy(model)
    except Exception as exc:  # a process group, a lock: not copyable
        warnings.warn(f"assert_replay_equivalent: {type(model).__name__} cannot be copied "
                      f"({type(exc).__name__}: {exc}); eager runs on the captured model "
                      "itself, and state its captures leave in it goes unchecked",
                      stacklevel=3)
        return None


def _flaky(exc, label: str) -> AssertionError:
    """A mismatch hypothesis saw once and not again on the same batch, as an
    AssertionError that says so (not a hypothesis error from the model's forward)."""
    inner = [e for e in getattr(exc, "exceptions", ()) if isinstance(e, AssertionError)]
    first = str(inner[0] if inner else exc).strip().splitlines()[0]
    return AssertionError(
        f"{label}: replays differ from eager on some calls only, not again on the same "
        f"batch ({first}): the forward keeps state that changes from call to call (a "
        "counter, a cache) or is nondeterministic (random ops, dropout: call "
        "model.eval())")


def _embedding_rows(model) -> int:
    """The rows of the model's first embedding table (its vocabulary), else 2 (ids 1)."""
    table = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return table.num_embeddings if table is not None else 2


def assert_replay_equivalent(model_or_factory, strategies=GRAPHED, batches=None, *,
                             max_tokens: int = 64, max_requests: int = 4,
                             buckets=None, attention: str | None = None,
                             vocab: int | None = None, examples: int = 20,
                             sequences: int = 5, atol: float | None = None,
                             compiler: str = "eager", reference=None) -> dict:
    """Check a prefill model (``forward(input_ids, positions)``) under each strategy:
    every generated batch, and every call of random call sequences (fallbacks included),
    equals the same model run eagerly with the same attention backend: a copy of the
    model taken before any capture (so that state a capture's warm-up leaves in the
    model is not shared by the reference), floats within ``atol`` absolute and relative
    (``rtol=atol``; default: the looser of the model's dtype's tolerance and each
    output's), NaN as NaN, integer
    and boolean outputs exactly; a forward that writes its inputs fails too. Returns by
    strategy the runner's report (its ``attention``: the backend the model's forward
    called, None if none; its ``fallbacks``: those of every runner the check made, the
    call sequences' included; ``unreplayed``: buckets no call replayed) plus
    ``max_error`` and ``build_wall_s``; raises AssertionError with the shrunk failing
    batch, and where no call replayed a graph at all.

    ``batches``: a hypothesis strategy of ``(input_ids, positions, seq_lens)`` (default
    :func:`prefill_batches`, token ids below ``vocab``: the model's ``vocab_size``, else
    its first embedding table's rows; with it, :func:`full_batch` and each bucket's
    :func:`bucket_batches` are checked after the ``examples`` drawn, so that every
    bucket replays, padded and full). ``attention``: the backend (default: the best one allowed
    under every strategy asked for, computing the model's ``graphcap_attention_options``).
    ``compiler``: tc_piecewise's piece compiler
    (``"eager"`` or ``"inductor"``). ``reference``: the model eager runs (default: the
    copy, :func:`eager_copy`), for checks of one model called strategy by strategy (the
    same copy for each: ``graphcap check``)."""
    model = model_or_factory() if not isinstance(model_or_factory, torch.nn.Module) \
        else model_or_factory
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"assert_replay_equivalent: model_or_factory returned a "
                        f"{type(model).__name__}, not a torch.nn.Module: give the model, or "
                        "a function of no arguments that returns it")
    strategies = (strategies,) if isinstance(strategies, str) else tuple(strategies)
    if not strategies or "eager" in strategies:
        raise ValueError(f"strategies={strategies!r}: name one or more of {list(GRAPHED)} "
                         "(eager is the reference every strategy is checked against)")
    pristine = reference if reference is not None else eager_copy(model)  # before capture
    device = _device_of(model)
    dtype = model_dtype(model) or torch.float32
    tol = (atol, _default_tolerance(dtype))  # the caller's (or None), the model dtype's
    if attention is None:  # one the model's layers run on: computing their options
        attention = backend_for(model, None, device, strategy="full", dtype=dtype).name
    vocab = vocab or getattr(model, "vocab_size", None) or getattr(
        getattr(model, "args", None), "vocab_size", None) or _embedding_rows(model)
    top = max(buckets) if buckets else max_tokens
    # Sequences also draw batches past the largest bucket and the slots: fallbacks.
    # A model with a row per request (last-token logits) takes no empty requests.
    min_len = 1 if getattr(model, "output_rows", "tokens") == "requests" else 0
    # No request past the model's positions; the largest bucket filled by the batches
    # drawn (not by batches= of the caller's).
    max_len = request_room(model, top if batches is None else None, max_requests)

    # More requests than slots only for a model that runs graphcap attention: one that
    # runs none takes one request a call (max_requests=1), eagerly too.
    def wide(extra):
        return prefill_batches(2 * top, max_requests + extra, vocab, device=device,
                               min_len=min_len, max_len=max_len)
    # With the default batches, the fullest one, and a most padded and a full batch of
    # every bucket, are checked after those drawn, whatever is drawn.
    full = None
    if batches is None:
        full = full_batch(top, max_requests, vocab, device=device, min_len=min_len,
                          max_len=max_len)
        batches = prefill_batches(top, max_requests, vocab, device=device, min_len=min_len,
                                  max_len=max_len)
    kwargs = dict(buckets=buckets, max_tokens=None if buckets else max_tokens,
                  max_requests=max_requests, attention=attention)
    reports = {}
    # One reference for every strategy: a second copy of the model at most.
    truth = graphcap.capture(pristine if pristine is not None else model, "eager", **kwargs)
    # The buffers the forward writes are compared too, where eager runs on another model.
    models = (model, pristine) if pristine is not None and pristine is not model else None
    for strategy in strategies:
        opts = dict(kwargs, compiler=compiler) if strategy == "tc_piecewise" else kwargs
        reports[strategy] = _check_strategy(
            model, strategy, opts, truth, batches, wide, full, tol, examples, sequences,
            attention, dict(vocab=vocab, device=device, min_len=min_len, max_len=max_len),
            models)
    return reports


def request_room(model, max_tokens: int | None, max_requests: int,
                 names: tuple[str, str] = ("max_tokens", "max_requests")) -> int | None:
    """The most tokens a drawn request may take: the model's ``max_position`` (None where
    it has none), whose positions a longer request would pass; a ValueError where
    ``max_requests`` requests that long cannot fill ``max_tokens`` (None: none to fill),
    naming the two as ``names`` says."""
    positions = getattr(model, "max_position", None)
    if not isinstance(positions, int) or isinstance(positions, bool) or positions < 1:
        return None
    if max_tokens is not None and max_requests * positions < max_tokens:
        tokens, requests = names
        raise ValueError(
            f"{tokens} {max_tokens} is filled only by requests longer than "
            f"{type(model).__name__}'s max_position {positions} with {requests} "
            f"{max_requests}: give {requests} of at least {-(-max_tokens // positions)}, "
            f"or {tokens} of at most {max_requests * positions}")
    return positions


def _quiet(runner):
    """``runner``, its fallbacks counted and not told: the check draws them on purpose
    (past the largest bucket, past the slots, padded more than twice over), and reports
    them; a warning for each runner it makes would only interleave with its results."""
    runner.config.tell_fallbacks = False
    return runner


def _check_strategy(model, strategy, kwargs, truth, batches, wide, full, tol, examples,
                    sequences, attention, draw, models) -> dict:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from hypothesis.errors import Flaky

    start = time.perf_counter()
    runner = _quiet(graphcap.capture(model, strategy, **kwargs))
    build_s = time.perf_counter() - start
    label = f"{strategy}/{attention}"
    worst = [0.0]
    fallbacks = Counter()  # the sequences' runners', beside the batches' runner's
    # One failure, shrunk: several distinct ones would come as an ExceptionGroup.
    quiet = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                 report_multiple_bugs=False)

    def call(run, ids, pos, lens, label):
        """The runner's call and eager's, each on its own copy of the inputs (a forward
        that writes them, which eager does and a replay does not, is a difference too);
        the label says how the runner ran the batch."""
        before = Counter(run.stats.replays)
        ids_r, pos_r, ids_e, pos_e = ids.clone(), pos.clone(), ids.clone(), pos.clone()
        state = models and (_buffers(models[0]), _buffers(models[1]))
        got = run(ids_r, pos_r, seq_lens=lens)
        replayed = list(Counter(run.stats.replays) - before)
        label += (f", replayed the {replayed[0]}-token graph" if replayed
                  else ", ran eagerly as a fallback")
        _close(got, truth(ids_e, pos_e, seq_lens=lens), label, tol[0], worst, tol[1])
        if state:
            _same_writes(*models, state, label, tol[0], tol[1])
        for name, mine, eager in (("input_ids", ids_r, ids_e), ("positions", pos_r, pos_e)):
            assert torch.equal(mine, eager), (
                f"{label}: the forward writes its {name} in place, which eager does and a "
                "replay does not (graphcap never writes a caller's inputs): compute on a "
                "copy instead")

    def check(batch):
        ids, pos, lens = batch
        call(runner, ids, pos, lens, f"{label} {lens}")

    @settings(max_examples=examples, **quiet)
    @given(batch=batches)
    def one_batch(batch):
        check(batch)

    attends = runner.report()["attention"] is not None
    replays = Counter()  # the sequences' runners'

    def sequence(calls):
        # A fresh runner per sequence: a failure depends on this sequence alone.
        fresh = _quiet(graphcap.capture(model, strategy, **kwargs))
        for i, (ids, pos, lens) in enumerate(calls):
            call(fresh, ids, pos, lens, f"{label} call {i} of {[c[2] for c in calls]}")
        stats = fresh.stats
        fallbacks.update(stats.fallbacks)
        replays.update(stats.replays)
        assert stats.calls == sum(stats.replays.values()) + sum(
            stats.fallbacks.values()) + stats.failed, (
            f"{label}: a call neither replayed, fell back nor failed")

    call_sequence = settings(max_examples=sequences, **quiet)(given(calls=st.lists(
        st.one_of(batches, wide(2 if attends else 0)), min_size=2, max_size=6))(sequence))

    try:
        one_batch()  # a failure drawn here comes shrunk
        if full is not None:  # the fullest batch, then each bucket's
            ladder = runner.config.buckets
            for batch in [full, *bucket_batches(
                    ladder, kwargs["max_requests"], draw["vocab"], device=draw["device"],
                    min_len=draw["min_len"], max_pad_ratio=runner.config.max_pad_ratio,
                    max_len=draw["max_len"])]:
                check(batch)
            # Replays around every kind of fallback, whatever hypothesis draws: past the
            # largest bucket, past the slots (a model of graphcap attention), padded more
            # than twice over (where a bucket is that large).
            def make(tokens, requests):
                if draw["max_len"]:  # requests within the model's positions: more of them
                    requests = max(requests, -(-tokens // draw["max_len"]))
                return full_batch(tokens, requests, draw["vocab"], device=draw["device"],
                                  min_len=draw["min_len"], seed=tokens + requests,
                                  max_len=draw["max_len"])
            top, slots = ladder[-1], kwargs["max_requests"]
            calls = [full, make(2 * top, slots)]
            if attends and top >= slots + 1:
                calls.append(make(top, slots + 1))
            if ladder[0] > 2 * max(draw["min_len"], 1):
                calls.append(make(max(draw["min_len"], 1), 1))
            sequence([*calls, full])
        call_sequence()
    except Flaky as exc:  # seen once, not again on the same batch
        if any(not isinstance(e, AssertionError) for e in getattr(exc, "exceptions", ())):
            raise  # the forward raised on some calls only: its error, not a mismatch
        raise _flaky(exc, label) from exc
    # "attention": the backend the model's forward called (None: it called none).
    report = runner.report()
    report["fallbacks"] = dict(Counter(report["fallbacks"]) + fallbacks)
    unreplayed = [b for b in runner.config.buckets
                  if not report["replays"].get(b) and not replays[b]]
    if len(unreplayed) == len(runner.config.buckets):
        raise AssertionError(
            f"{label}: no call replayed a graph (every batch ran eagerly: "
            f"{report['fallbacks']}), so nothing was checked: give batches= that fill the "
            f"buckets {runner.config.buckets} to more than half (a batch padded more than "
            "twice over runs eagerly), or buckets= that fit the batches")
    report["unreplayed"] = unreplayed  # buckets no call replayed (custom batches=)
    return {**report, "max_error": worst[0], "build_wall_s": round(build_s, 3)}
