"""Tensor parallelism on CPU, the group's agreements: ranks that disagree on a call (its
route, token count or request lengths) or refuse it raise ``RankError`` on every rank at
once and stay usable; a rank that does not come closes the group after the timeout, one
that left is named so; one whose own collective torch refused says so in torch's words,
and the others fail at once; a released group refuses every later use; ranks calling a model
of tensors of other shapes all raise; an asynchronous collective waited on across an
eager break is refused."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import graphcap
from graphcap.errors import (
    CaptureError,
    GraphcapError,
    RankError,
)
from graphcap.models import build_model
from graphcap.tp import TPGroup, group_named
from tests.tp.test_tp import PATIENT, spawn

# One worker keeps the two-rank world; slow: the ranks are processes of their own.
pytestmark = [pytest.mark.xdist_group("tp-world"), pytest.mark.slow]


def call(runner, lens):
    n = sum(lens)
    return runner(torch.ones(n, dtype=torch.long), torch.cat([torch.arange(k) for k in lens]),
                  seq_lens=lens)


def _disagreement(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)  # nothing here waits for a timeout
    model = build_model("tiny", tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8, 16], max_requests=2)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"disagree \(rank 0: replay 8: 5 tokens, requests "
                       r"\[5\], rank 1: replay 16: 12 tokens"):
        call(runner, [5] if rank == 0 else [12])  # bucket 8 on one rank, 16 on the other
    assert time.monotonic() - start < PATIENT / 2  # at once, not after the timeout
    with pytest.raises(RankError, match=r"rank 0: replay 8: 5 tokens.*rank 1: eager \(too_many"):
        call(runner, [5] if rank == 0 else [20])
    # One bucket, one route, and yet other graphs: other lengths of the same token count.
    with pytest.raises(RankError, match=r"rank 0: replay 8: 5 tokens, requests \[5\], rank 1: "
                       r"replay 8: 6 tokens, requests \[6\]"):
        call(runner, [5] if rank == 0 else [6])
    with pytest.raises(RankError, match=r"requests \[3, 2\], rank 1: replay 8: 5 tokens, "
                       r"requests \[5\]"):
        call(runner, [3, 2] if rank == 0 else [5])
    # A call one rank refuses (bad input) is refused on every rank, at once.
    with pytest.raises(RankError, match=r"rank 1: refused \(BadBatch"):
        if rank == 0:
            call(runner, [6])
        else:
            runner(torch.ones(6, dtype=torch.long), torch.arange(6), seq_lens=[5])
    out = call(runner, [6])  # the runner and the group are still usable
    assert out.shape == (6, model.args.vocab_size) and tp.closed is None
    # generate() with other prompts per rank, even of the same lengths: refused on both,
    # never other tokens; the error says that the arguments differ, not their shapes.
    for other in ([[5, 9, 2, 7], [3]], [[7, 1, 8], [6]]):
        prompts = [[5, 9, 2], [3]] if rank == 0 else other
        with pytest.raises(RankError, match=r"disagree \(rank 0: \w+, rank 1: \w+\) on .*: "
                           r"every rank must make this call with the same arguments"):
            graphcap.generate(model, prompts, 3, strategy="full", max_batch=2,
                              prefill_tokens=8)
    # One rank refusing its arguments: every rank raises, and the next call is in step.
    prompts = [[5, 9, 2], [3]] if rank == 0 else [[5, 9, 2], [10**6]]
    with pytest.raises(RankError, match=r"rank 1: refused \((BadBatch|ValueError)"):
        graphcap.generate(model, prompts, 3, strategy="full", max_batch=2,
                          prefill_tokens=8)
    # LLM.generate with a stop one rank refuses (past the vocabulary): the same.
    from tests.support.tokenizers import byte_tokenizer

    llm = graphcap.LLM(model, tokenizer=byte_tokenizer(), strategy="eager", max_batch=2)
    with pytest.raises(RankError, match=r"rank 1: refused \(ValueError: stop \[1000000\]"):
        llm.generate([[5, 9, 2]], 2, stop=["x"] + ([10**6] if rank == 1 else []))
    whole = graphcap.LLM(build_model("tiny"), tokenizer=byte_tokenizer(), strategy="eager",
                         max_batch=2)
    assert [c.tokens for c in llm.generate([[5, 9, 2]], 2)] == \
        [c.tokens for c in whole.generate([[5, 9, 2]], 2)]  # the next call in step
    got = graphcap.generate(model, [[5, 9, 2], [3]], 3, strategy="full", max_batch=2,
                            prefill_tokens=8).tokens
    assert got == graphcap.generate(build_model("tiny"), [[5, 9, 2], [3]], 3,
                                    strategy="eager", max_batch=2).tokens


def test_ranks_that_disagree_on_a_call_all_raise_at_once_and_stay_usable():
    spawn(_disagreement)


def _absence(rank: int) -> None:
    tp = TPGroup(timeout_s=2.0)  # the bound under test; the ranks meet before each wait
    model = build_model("tiny", tp=tp)
    dist.barrier()
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=2)
    dist.barrier()
    call(runner, [6])
    if rank == 0:  # rank 1 does not come: rank 0 raises after the timeout
        start = time.monotonic()
        with pytest.raises(RankError, match="did not come to a call of the runner within 2 s"):
            call(runner, [6])
        assert time.monotonic() - start < PATIENT / 2
    dist.barrier()  # the world group: rank 1 waits here for rank 0's timeout
    # The group closed on rank 0; rank 1 learns why at its next call, at once.
    start = time.monotonic()
    with pytest.raises(RankError, match="closed.*rank 0: .*did not come"):
        call(runner, [6])
    assert time.monotonic() - start < PATIENT / 2
    assert tp.closed is not None


def test_a_rank_that_does_not_come_closes_the_group_on_every_rank():
    spawn(_absence)


def _departure(rank: int) -> None:
    groups = [TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT) for _ in "ab"]
    dist.barrier()
    try:
        if rank == 1:  # what a rank's exit does to its groups (release_all): no word left
            for tp in groups:
                tp.release(tell=False)
            return
        for use in (lambda: groups[0].agree("here", "a test"),  # both fail at once
                    lambda: groups[1].meet("a test", "a meeting")):
            start = time.monotonic()
            with pytest.raises(RankError, match=r"a rank left the group \(its process "
                               r"ended\?\) instead of coming to (a test|it)"):
                use()
            assert time.monotonic() - start < PATIENT / 2
    finally:
        dist.barrier()


def test_a_rank_that_left_is_named_so_not_as_one_that_did_not_come_in_time():
    spawn(_departure)


# A collective refused on rank 0 alone: by gloo (no uint16), by torch's own checks before
# the backend sees it (a ValueError: an output list of another dtype), or by gloo inside the
# model's own error (raised from it: its frames hold the group too); the op, the words.
REFUSALS = {"by gloo": ("all_reduce", "Invalid scalar type)"),
            "by torch's checks": ("all_gather", "Invalid usage of tensors with different dtypes"),
            "under the model's error": ("all_reduce", "the model's all_reduce failed")}


def _raised_from(run, words: str):
    def wrapped():
        try:
            run()
        except RuntimeError as exc:
            raise ValueError(words) from exc
    return wrapped


def _refused_here(rank: int, by: str) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    dist.barrier()
    op, words = REFUSALS[by]
    x = torch.ones(2, dtype=torch.uint16 if rank == 0 and op == "all_reduce" else torch.float32)
    parts = [torch.empty(2, dtype=torch.float64 if rank == 0 else torch.float32)
             for _ in range(2)]
    run = {"all_reduce": lambda: dist.all_reduce(x, group=tp.data),
           "all_gather": lambda: dist.all_gather(parts, x, group=tp.data)}[op]
    if by == "under the model's error":
        run = _raised_from(run, words)
    start = time.monotonic()
    with pytest.raises(RankError) as caught:
        tp.collective(run, op)
    assert time.monotonic() - start < PATIENT / 2
    message = str(caught.value)
    if rank == 0:  # its own call was refused: torch's words say so
        assert f"or this rank's call was refused (torch.distributed: {words}" in message
    else:  # rank 1 learns it from the group, at once, not at its collective timeout
        assert f"the group was closed (rank 0: {op} failed: " in message
        assert words in message


@pytest.mark.parametrize("by", REFUSALS)
def test_a_collective_refused_on_one_rank_says_why_in_torchs_words_on_every_rank(by):
    spawn(_refused_here, by)


def _own_call_refused_in_a_step(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)  # fail-fast: never waited
    dist.barrier()
    x, parts = torch.ones(2), [torch.empty(2) for _ in range(2)]
    start, kept = time.monotonic(), None
    try:
        if rank == 0:  # a model's own torch.distributed call, which torch's checks refuse
            with pytest.raises(ValueError, match="different dtypes") as kept, \
                    tp.together("a step"):
                dist.all_gather([p.double() for p in parts], x, group=tp.data)
        else:  # waiting in the step's collective, rank 1 fails at once, naming rank 0's error
            with pytest.raises(RankError, match=r"the group was closed \(rank 0 raised "
                               r"ValueError in a step: Invalid usage of tensors with different "
                               r"dtypes"), tp.together("a step"):
                tp.collective(lambda: dist.all_gather(parts, x, group=tp.data), "all_gather")
            assert time.monotonic() - start < PATIENT / 2
    finally:
        dist.barrier()  # rank 0 keeps its error (a caller reporting it later) until then
    assert tp.closed is not None and (rank == 1 or kept.value is not None)


def test_a_rank_whose_own_torch_distributed_call_raised_in_a_step_ends_the_others_wait_at_once():
    """However long the error lives on: its frames (the call's ``group``) held the data
    group open past its close, and the others waited to their collective timeout."""
    spawn(_own_call_refused_in_a_step)


def _late_to_the_group(rank: int) -> None:
    from unittest import mock

    made = dist.new_group

    def late(*args, **kwargs):  # rank 1 comes to the control group 3 s after rank 0
        if rank == 1 and kwargs.get("backend") == "gloo":
            time.sleep(3.0)
        return made(*args, **kwargs)

    # NCCL makes the data group without meeting the ranks: they come to the control
    # group as far apart as they come to TPGroup(). Its making waited timeout_s only.
    with mock.patch.object(dist, "new_group", late):
        tp = TPGroup(timeout_s=1.0)
    tp.meet("a test", "a meeting")  # in step again (the data group waits longer)
    if rank == 1:
        time.sleep(3.0)  # the agreements still wait timeout_s
    with pytest.raises(RankError, match="within 1 s|closed"):
        tp.agree("here", "a test")


def test_a_rank_that_comes_to_the_group_later_than_timeout_s_still_makes_it():
    spawn(_late_to_the_group)


def _later_than_collective_timeout_s(rank: int) -> None:
    # On gloo the data group meets the ranks too: one that comes later than the bound
    # fails every rank's TPGroup() with RankError saying so (it was gloo's "Wait timeout").
    if rank == 1:
        time.sleep(3.0)
    with pytest.raises(RankError, match=r"a rank did not make its TPGroup within 1\.5 s"):
        TPGroup(timeout_s=1.0, collective_timeout_s=1.5)
    dist.barrier()
    TPGroup(timeout_s=PATIENT).agree("here", "a test")  # the ranks still make groups together


def test_a_rank_later_to_the_group_than_collective_timeout_s_fails_it_with_rank_error():
    spawn(_later_than_collective_timeout_s)


def _timeout_fixed_at_making(rank: int) -> None:
    from unittest import mock

    from graphcap import compat

    # A torch that cannot change a made group's timeout: the control group is made again,
    # bounded by timeout_s, so an agreement still waits timeout_s, not the making's bound.
    with mock.patch.object(compat, "set_group_timeout", lambda group, seconds: False):
        tp = TPGroup(timeout_s=1.0, collective_timeout_s=PATIENT)
    tp.agree("here", "a test")
    if rank == 1:
        time.sleep(3.0)
    start = time.monotonic()
    with pytest.raises(RankError, match="within 1 s|closed"):
        tp.agree("here", "a test")
    assert time.monotonic() - start < PATIENT / 2


def test_agreements_wait_timeout_s_on_a_torch_that_cannot_change_a_made_group_s_timeout():
    spawn(_timeout_fixed_at_making)


def _release(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    model = build_model("tiny", tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=1)
    call(runner, [6])
    tp.release()
    assert tp.data is None and tp.control is None  # destroyed now, not at exit
    with pytest.raises(RankError, match=rf"closed \(rank {rank} released the group\)"):
        call(runner, [6])
    # Called directly, its collectives say so too (it was "no TP group named 'tp0'").
    with pytest.raises(RankError, match=rf"closed \(rank {rank} released the group\)"), \
            torch.no_grad():
        model(torch.ones(6, dtype=torch.long), torch.arange(6), seq_lens=[6])
    with pytest.raises(RankError, match=rf"{tp.name} is closed \(rank {rank} released"):
        group_named(tp.name)
    with pytest.raises(GraphcapError, match="no TP group named 'tp-none'"):
        group_named("tp-none")
    # One rank releasing: the other's next call says so, at once (no timeout blamed).
    tp = TPGroup(timeout_s=PATIENT)
    model = build_model("tiny", tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=1)
    dist.barrier()
    if rank == 1:
        tp.release()
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 1 released the group"):
            call(runner, [6])
        assert time.monotonic() - start < PATIENT / 2
        # A collective refused (the group closed) is not counted: tp.collectives counts
        # the collectives this rank ran.
        ran = dict(tp.collectives)
        with pytest.raises(RankError, match="is closed"), torch.no_grad():
            model(torch.ones(6, dtype=torch.long), torch.arange(6), seq_lens=[6])
        assert dict(tp.collectives) == ran


def test_a_released_group_destroys_its_process_groups_and_refuses_every_later_use():
    spawn(_release)


class _SplitOfTensors(torch.nn.Module):
    """A model of tensors along dim 0 whose output is summed over the ranks."""

    def __init__(self, tp):
        super().__init__()
        self.tp = tp
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, x):
        return torch.ops.graphcap.all_reduce(x * self.w.to(x.dtype), self.tp.name)


def _tensor_shapes(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    model = _SplitOfTensors(tp)
    # One dim 0, other trailing sizes or dtypes (of one width: gloo would sum the bits):
    # refused on every rank at once, never captured or run out of step.
    for mine in (torch.ones(4, 8 if rank == 0 else 4),
                 torch.ones(4, 8, dtype=torch.float16 if rank == 0 else torch.bfloat16)):
        start = time.monotonic()
        with pytest.raises(RankError, match="disagree"):
            graphcap.capture(model, "full", buckets=[4], example_inputs=(mine,))
        with pytest.raises(RankError, match="disagree"):
            graphcap.capture(model, "eager")(mine)
        assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    x = torch.full((4, 8), float(rank + 1))
    runner = graphcap.capture(model, "full", buckets=[4], example_inputs=(x,))
    assert torch.equal(runner(x), torch.full((4, 8), 3.0))  # in step


def test_ranks_calling_a_model_of_tensors_with_other_shapes_or_dtypes_all_raise():
    spawn(_tensor_shapes)


class _AsyncAcrossABreak(torch.nn.Module):
    """An all-reduce launched asynchronously, its result handed to an eager break before
    anyone waits on it."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        from torch.distributed import _functional_collectives as funcol

        pending = funcol.all_reduce(self.lin(x), "sum", self.group)
        return _eager_double(pending)


@graphcap.eager_on_graph
def _eager_double(x):
    return x * 2


def _async_break(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    with pytest.raises(CaptureError, match="asynchronous collective that was not waited"):
        graphcap.capture(_AsyncAcrossABreak(tp.data), "breakable", buckets=[4],
                         example_inputs=(torch.ones(4, 8),))


def test_an_async_collective_waited_on_across_a_break_is_refused():
    spawn(_async_break)


def test_a_group_whose_backend_refuses_a_new_timeout_is_one_whose_timeout_cannot_change():
    # torch's Backend.setTimeout raises where a backend does not implement it: TPGroup()
    # then makes its control group again, bounded by timeout_s, instead of failing.
    from graphcap import compat

    class Refusing:
        def set_timeout(self, timeout):
            raise RuntimeError("Backend fake does not support setting timeout")

    assert compat.set_group_timeout(Refusing(), 1.0) is False
