"""Tensor parallelism on CPU, a rank that fails: one that raises in a capture, its set-up or
a call stops the others within seconds (not at a timeout), and the closed group says
why on every later use; a capture one rank refuses, or a model changed on some ranks
only, is refused on every rank at once."""

from __future__ import annotations

import time

import pytest
import torch

import graphcap
from graphcap.errors import (
    ModelChanged,
    RankError,
)
from graphcap.models import build_model
from graphcap.tp import TPGroup
from tests.tp.test_tp import PATIENT, spawn
from tests.tp.test_tp_group import call

# One worker keeps the two-rank world; slow: the ranks are processes of their own.
pytestmark = [pytest.mark.xdist_group("tp-world"), pytest.mark.slow]


class Boom(RuntimeError):
    pass


def _raise_on(rank: int, module: torch.nn.Module, tokens: int, where: str):
    """From now on, rank 1's ``module`` raises ``Boom`` on ``tokens`` tokens (rank 0's
    goes on to its next collective, where it waits for rank 1)."""
    def hook(mod, args):
        if rank == 1 and args[0].shape[0] == tokens:
            raise Boom(f"rank 1's forward fails {where}")
    return module.register_forward_pre_hook(hook)


def _failure_in_capture(rank: int, strategy: str) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    model = build_model("tiny", tp=tp)
    _raise_on(rank, model.blocks[1], 8, "in the capture of 8 tokens")  # the second shape
    start = time.monotonic()
    if rank == 1:
        with pytest.raises(Boom):
            graphcap.capture(model, strategy, buckets=[8, 16], max_requests=2)
    else:
        with pytest.raises(RankError, match="rank 1 raised Boom in a capture: rank 1's "
                           "forward fails in the capture of 8 tokens"):
            graphcap.capture(model, strategy, buckets=[8, 16], max_requests=2)
    assert time.monotonic() - start < PATIENT / 2
    assert tp.closed is not None
    with pytest.raises(RankError, match="is closed"):  # every later use says why, at once
        graphcap.capture(model, strategy, buckets=[8], max_requests=2)


@pytest.mark.parametrize("strategy", ["breakable", "full"])
def test_a_rank_that_raises_during_capture_stops_every_rank_within_seconds(strategy):
    spawn(_failure_in_capture, strategy)


def _refused_capture(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    model = build_model("tiny", tp=tp)
    start = time.monotonic()
    # The first capture, refused on rank 1 (its arguments): every rank raises at once.
    with pytest.raises(RankError, match=r"rank 1: refused \(ValueError: max_tokens=32"):
        graphcap.capture(model, "full", buckets=[8, 16], max_requests=2,
                         **({"max_tokens": 32} if rank == 1 else {}))
    with pytest.raises(RankError, match="disagree"):  # another ladder per rank
        graphcap.capture(model, "full", buckets=[8, 16] if rank == 0 else [8], max_requests=2)
    with pytest.raises(RankError, match="disagree"):  # another answer to a changed model
        graphcap.capture(model, "full", buckets=[8, 16], max_requests=2,
                         on_change="error" if rank == 1 else "recapture")
    # Another compiler per rank: the replicated norms and router rounded otherwise on each
    # rank (an MoE's ranks could route a near tie to other experts). It was captured.
    with pytest.raises(RankError, match="disagree"):
        graphcap.capture(model, "tc_piecewise", buckets=[8], max_requests=2,
                         compiler="inductor" if rank == 1 else "eager")
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    runner = graphcap.capture(model, "full", buckets=[8, 16], max_requests=2)  # in step
    assert call(runner, [6]).shape == (6, model.args.vocab_size)
    # capture_all(example) with an example one rank refuses: every rank raises at once.
    ids = torch.ones(6, dtype=torch.long)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1: refused \(BadBatch"):
        runner.capture_all((ids, torch.arange(5 if rank == 1 else 6)))
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    assert call(runner, [6]).shape == (6, model.args.vocab_size)
    # A model changed on one rank only, its runner refusing changes: every rank raises.
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=2, on_change="error")
    call(runner, [6])
    if rank == 1:
        model.norm = torch.nn.Parameter(model.norm.detach().clone())
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 1: refused \(ModelChanged"):
        call(runner, [6])
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None


def test_a_capture_one_rank_refuses_is_refused_on_every_rank_at_once():
    spawn(_refused_capture)


def _changed_on_some_ranks(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    model = build_model("tiny", tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=2)  # recapture
    want, norm = call(runner, [6]), model.norm
    if rank == 1:  # replaced on one rank only
        model.norm = torch.nn.Parameter(norm.detach().clone())
    start = time.monotonic()
    for _ in range(2):  # every call, until the ranks' models agree again
        # It was "rank 1: capture [8]": make the same calls with the same shapes.
        with pytest.raises(RankError, match=r"rank 0: replay 8: 6 tokens, requests \[6\], "
                           r"rank 1: Decoder changed since capture \(norm: another tensor "
                           r".*a split model must change alike on every rank"):
            call(runner, [6])
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    model.norm = norm  # undone: in step, the graphs of capture
    assert torch.equal(call(runner, [6]), want) and runner.stats.recaptures == 0
    # Replaced alike on every rank: every rank captures its share again.
    model.norm = torch.nn.Parameter(norm.detach() * 2)
    got = call(runner, [6])
    assert runner.stats.recaptures == 1
    with torch.no_grad():
        torch.testing.assert_close(got, model(torch.ones(6, dtype=torch.long),
                                              torch.arange(6), seq_lens=[6]))
    # Replaced on every rank, but not alike (another slot per rank): refused too.
    o = model.blocks[rank].attn.o
    o.weight = torch.nn.Parameter(o.weight.detach().clone())
    with pytest.raises(RankError, match=r"rank 0: Decoder changed since capture \(blocks\.0\."
                       r"attn\.o\.weight.*rank 1: Decoder changed since capture \(blocks\.1\."):
        call(runner, [6])
    assert tp.closed is None


def test_a_model_changed_on_some_ranks_only_is_refused_on_every_rank_naming_the_change():
    spawn(_changed_on_some_ranks)


def test_a_change_is_compared_without_each_rank_s_own_gpu():
    from graphcap.tp.keys import rank_neutral

    what = "norm: another tensor (bfloat16 (64,) on cuda:1; was bfloat16 (64,) on cuda:1)"
    assert rank_neutral(what) == \
        "norm: another tensor (bfloat16 (64,) on cuda; was bfloat16 (64,) on cuda)"
    assert rank_neutral("moved from ['cuda:1'] to ['cpu'] (<X object at 0x7f00>)") == \
        "moved from ['cuda'] to ['cpu'] (<X object>)"


def test_a_key_comes_back_as_it_went_empty_short_or_cut_with_its_digest():
    from graphcap.tp.keys import KEY_BYTES, decode, digest, encode

    for key in ("", "replay 8: 5 tokens, requests [5]", "naïve ✓"):
        assert decode(encode(key)) == key
    long = "x" * (2 * KEY_BYTES)
    cut = decode(encode(long))
    assert len(cut.encode()) == KEY_BYTES and cut.endswith("..." + digest(long))
    assert decode(encode(long + "y")) != cut  # long keys that differ still differ


def _refused_alike_on_each_gpu(rank: int) -> None:
    import graphcap.core.snapshot as snapshot

    # Each rank's tensors on its own GPU, as under NCCL: cuda:0 on rank 0, cuda:1 on 1.
    plain = snapshot._describe
    snapshot._describe = lambda t: plain(t).replace("on cpu", f"on cuda:{rank}")
    try:
        tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
        model = build_model("tiny", tp=tp)
        runner = graphcap.capture(model, "full", buckets=[8], max_requests=2,
                                  on_change="error")
        call(runner, [6])
        model.norm = torch.nn.Parameter(model.norm.detach().clone())  # alike on each rank
        # Each rank refuses the change as it would unsplit (it was RankError: "the ranks
        # disagree ... must change alike", naming cuda:0 against cuda:1).
        with pytest.raises(ModelChanged, match="norm: another tensor"):
            call(runner, [6])
        assert tp.closed is None
    finally:
        snapshot._describe = plain


def test_a_change_refused_alike_on_each_rank_s_own_gpu_raises_model_changed():
    spawn(_refused_alike_on_each_gpu)


def _lazy_slot_on_one_rank(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    model = build_model("tiny", tp=tp)

    def make(mod, args):  # rank 0's first forward makes a buffer: its warm-up runs twice
        if rank == 0 and "lazy" not in mod._buffers:
            mod.register_buffer("lazy", torch.zeros(1))
    model.blocks[0].register_forward_pre_hook(make)
    runner = graphcap.capture(model, "full", buckets=[8, 16], max_requests=2)
    # every shape warmed (split), the first twice on both ranks, the next once
    assert runner.report()["warmups"] == 3
    eager = graphcap.capture(model, "eager", max_requests=2)
    torch.testing.assert_close(call(runner, [6]), call(eager, [6]))


def test_a_warm_up_that_makes_a_slot_on_one_rank_only_runs_again_on_every_rank():
    # Alone, the rank that made it would run its forward (and its collectives) once more.
    spawn(_lazy_slot_on_one_rank)


def _failure_in_the_set_up_of_a_capture(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    model = build_model("tiny", tp=tp)
    if rank == 1:  # as an out-of-memory error in the static buffers' allocation would

        def before():
            raise Boom("rank 1 ran out of memory before its capture")
        model.graphcap_before_capture = before
    start = time.monotonic()
    with pytest.raises(Boom if rank == 1 else RankError, match="rank 1 ran out of memory"):
        graphcap.capture(model, "full", buckets=[8, 16], max_requests=2)
    assert time.monotonic() - start < PATIENT / 2
    assert tp.closed is not None


def test_a_rank_that_fails_setting_up_a_capture_stops_every_rank_within_seconds():
    spawn(_failure_in_the_set_up_of_a_capture)


def _failure_in_a_call(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    model = build_model("tiny", tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=2)
    call(runner, [6])
    # 12 tokens run eagerly (past the largest bucket): the hook runs in that call.
    _raise_on(rank, model.blocks[1], 12, "in an eager call")
    start = time.monotonic()
    with pytest.raises(Boom if rank == 1 else RankError,
                       match="rank 1's forward fails" if rank == 1 else
                       "all_reduce failed on rank 0: the group was closed .rank 1 raised Boom"):
        call(runner, [12])
    assert time.monotonic() - start < PATIENT / 2
    with pytest.raises(RankError, match="is closed"):
        call(runner, [6])


def test_a_rank_that_raises_during_a_call_stops_every_rank_within_seconds():
    spawn(_failure_in_a_call)
