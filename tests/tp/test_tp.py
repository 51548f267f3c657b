"""Tensor parallelism on CPU: two processes over gloo, the graph emulator. The reference
decoders split across the ranks (dense and MoE; gpt-oss's layers eagerly) give the
unsharded model's logits eagerly and under every strategy, and each strategy's replays
the TP model's eager logits (up to the rounding of a padded shape); every replay runs
the model's collectives on every rank (the emulator re-runs them); a Hugging Face
checkpoint loads as each rank's share.
No rank waits for ever or goes on alone: ranks that disagree on a call (its route, token
count or request lengths) or refuse it raise ``RankError`` on every rank at once and stay
usable; a rank that does not come closes the group after the timeout; a rank that raises
in a capture or a call stops the others within seconds (not at a timeout), and the closed
group says why on every later use; an asynchronous collective waited on across an eager
break is refused."""

from __future__ import annotations

import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphcap
from graphcap.api import STRATEGIES
from graphcap.errors import (
    CaptureError,
    GraphcapError,
    ModelChanged,
    RankError,
    UnsupportedModel,
)
from graphcap.models import PRESETS, build_model, shard_args, shard_model, shard_tensor
from graphcap.tp import TPGroup, group_named, release_all
from tests.support import tp_world

WORLD = 2
# A loaded two-core machine can keep one rank seconds behind the other: no test waits on
# a bound it does not test, and "at once" means well within the bound that would fire.
PATIENT = 120.0
# One worker keeps the two-rank world; slow: the ranks are processes of their own.
pytestmark = [pytest.mark.xdist_group("tp-world"), pytest.mark.slow]


def spawn(fn, *args, world: int = WORLD, backend: str = "gloo"):
    """``fn(rank, *args)`` on ``world`` processes joined in one world of ``backend``
    (NCCL: one GPU each, new processes; gloo: the test session's world, tp_world); a
    rank's exception fails the test."""
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    if backend == "gloo":
        tp_world.world(world, backend).run(fn, *args)
        return
    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(f"file://{folder}/init", world, backend, fn, args),
                 nprocs=world, join=True)


def _worker(rank: int, init: str, world: int, backend: str, fn, args) -> None:
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        release_all()  # every scenario's groups, before the world's
        dist.destroy_process_group()


def batches(vocab: int):
    gen = torch.Generator().manual_seed(1)
    for lens in ([5, 3], [9], [2, 2], [14, 1]):
        n = sum(lens)
        yield (torch.randint(0, vocab, (n,), generator=gen),
               torch.cat([torch.arange(k) for k in lens]), lens)


def _equivalence(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(rank))
    # Schema (no undeclared mutation), fake tensors, dynamic shapes: on both ranks at once.
    torch.library.opcheck(torch.ops.graphcap.all_reduce.default, (x, tp.name))
    torch.library.opcheck(torch.ops.graphcap.all_gather.default, (x, -1, tp.name))
    both = [torch.randn(6, 8, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    torch.testing.assert_close(torch.ops.graphcap.all_reduce(x, tp.name), both[0] + both[1])
    assert torch.equal(torch.ops.graphcap.all_gather(x, -1, tp.name), torch.cat(both, -1))
    for preset in ("tiny", "tiny-moe"):
        full = build_model(preset)
        model = build_model(preset, tp=tp)
        layers = model.args.layers
        with torch.no_grad():
            for ids, pos, lens in batches(model.args.vocab_size):
                torch.testing.assert_close(model(ids, pos, seq_lens=lens),
                                           full(ids, pos, seq_lens=lens),
                                           atol=1e-5, rtol=1e-5)
        for strategy in STRATEGIES:
            runner = graphcap.capture(model, strategy, buckets=[8, 16], max_requests=2)
            for ids, pos, lens in batches(model.args.vocab_size):
                before = tp.collectives.copy()
                got = runner(ids, pos, seq_lens=lens)
                ran = tp.collectives - before
                assert ran == {"all_reduce": 2 * layers, "all_gather": 1}, (strategy, ran)
                with torch.no_grad():
                    eager = model(ids, pos, seq_lens=lens)
                    want = full(ids, pos, seq_lens=lens)
                # A padded bucket changes the matmuls' blocking: equal up to rounding.
                torch.testing.assert_close(got, eager, atol=1e-6, rtol=1e-6)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if strategy != "eager":
                assert sum(runner.report()["replays"].values()) == 4, strategy
    # gpt-oss's layers: sinks split by heads, expert biases by columns, the down bias once.
    full, model = build_model("tiny-gpt-oss"), build_model("tiny-gpt-oss", tp=tp)
    with torch.no_grad():
        for ids, pos, lens in batches(model.args.vocab_size):
            torch.testing.assert_close(model(ids, pos, seq_lens=lens),
                                       full(ids, pos, seq_lens=lens), atol=1e-5, rtol=1e-5)


def test_the_split_model_equals_the_whole_under_every_strategy():
    spawn(_equivalence)


def _generation(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 11, 6, 2, 9]]
    want = graphcap.generate(build_model("tiny"), prompts, 6, strategy="eager",
                             max_batch=2).tokens
    model = build_model("tiny", tp=tp)
    for strategy in STRATEGIES:
        got = graphcap.generate(model, prompts, 6, strategy=strategy, max_batch=2,
                                prefill_tokens=16)
        assert got.tokens == want, strategy  # each rank caches its own key/value heads


def test_greedy_generation_of_the_split_model_is_the_whole_model_s():
    spawn(_generation)


def _refused_llm(rank: int) -> None:
    # The first capture's warm-up waits collective_timeout_s: an LLM one rank refused to
    # build left the other there until the group closed.
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    model = build_model("tiny", tp=tp)
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank 0: refused \(ValueError: max_len 100000 "
                       r"passes the model's max_position.*on the build of an LLM"):
        graphcap.LLM(model, max_len=100_000 if rank == 0 else 64, max_batch=2)
    with pytest.raises(RankError, match="disagree"):  # another LLM per rank
        graphcap.LLM(model, max_len=64 + 16 * rank, max_batch=2)
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    llm = graphcap.LLM(model, strategy="eager", max_len=64, max_batch=2)  # in step
    want = graphcap.generate(build_model("tiny"), [[5, 9, 2]], 4, strategy="eager").tokens
    assert [c.tokens for c in llm.generate([[5, 9, 2]], 4)] == want


def test_an_llm_one_rank_refuses_to_build_is_refused_on_every_rank_at_once():
    spawn(_refused_llm)


def _checkpoint(rank: int, folder: str) -> None:
    from graphcap.models import load_checkpoint

    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    start = time.monotonic()  # one rank's folder is not there: every rank raises, at once
    with pytest.raises(RankError, match=r"rank 0: refused \(CheckpointError: .*no such "
                       r"directory\), rank 1: shard_model: logits all"):
        load_checkpoint(folder if rank else folder + "-gone", tp=tp)
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    whole, mine = load_checkpoint(folder), load_checkpoint(folder, tp=tp)
    assert mine.local_args.heads == whole.args.heads // WORLD
    ids, pos = torch.arange(1, 12), torch.arange(11)
    with torch.no_grad():
        torch.testing.assert_close(mine(ids, pos, seq_lens=[11]),
                                   whole(ids, pos, seq_lens=[11]), atol=1e-5, rtol=1e-5)


def test_a_hugging_face_checkpoint_loads_as_each_rank_s_share(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=256, tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    spawn(_checkpoint, str(tmp_path))


def _other_models(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    start = time.monotonic()
    # Another seed per rank: the shares of two models, which gave the logits of neither.
    with pytest.raises(RankError, match=r"rank 0: build_model\('tiny', seed=0, dtype="
                       r"torch.float32\): logits all, weights \w+, config \w+, rank 1: "
                       r"build_model\('tiny', seed=1, .*every rank must split the same "
                       r"whole model"):
        build_model("tiny", tp=tp, seed=rank)
    with pytest.raises(RankError, match=r"dtype=torch.float64"):  # another dtype
        build_model("tiny", tp=tp, dtype=torch.float64 if rank else torch.float32)
    # The same arguments, another whole model (edited on rank 1): the weights differ.
    whole = build_model("tiny")
    if rank == 1:
        with torch.no_grad():
            whole.blocks[1].mlp.down.weight[3, 5] += 1
    with pytest.raises(RankError, match=r"rank 0: shard_model: logits all, weights (\w+), "
                       r"config \w+, rank 1: shard_model: logits all, weights (?!\1)"):
        shard_model(whole, tp)
    # The same weights, another config per rank (its rotary base): it was split without a
    # word, each rank's share computing another model (logits 0.02 off rank 0's).
    from dataclasses import replace

    from graphcap.models.decoder import Decoder

    torch.manual_seed(0)
    whole = Decoder(replace(PRESETS["tiny"], rope_theta=500.0 if rank else 1e4)).eval()
    with pytest.raises(RankError, match=r"rank 0: shard_model: logits all, weights (\w+), "
                       r"config (\w+), rank 1: shard_model: logits all, weights \1, "
                       r"config (?!\2).*the same config"):
        shard_model(whole, tp)
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    model = build_model("tiny", tp=tp, seed=3)  # in step: the share of the whole model
    ids, pos = torch.arange(1, 12), torch.arange(11)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, seq_lens=[11]),
                                   build_model("tiny", seed=3)(ids, pos, seq_lens=[11]),
                                   atol=1e-5, rtol=1e-5)


def test_ranks_that_split_other_whole_models_all_raise():
    spawn(_other_models)


def _refused_before_the_split(rank: int) -> None:
    # The split's meeting waits collective_timeout_s: a rank that refused before it (its
    # build, or the split's checks) left the other there until the group closed.
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    start = time.monotonic()
    from dataclasses import replace

    from graphcap.models.decoder import Decoder

    # A config rank 0 cannot split two ways (3 key/value heads), rank 1's it can.
    torch.manual_seed(0)
    whole = Decoder(replace(PRESETS["tiny"], heads=6, kv_heads=3) if rank == 0
                    else PRESETS["tiny"]).eval()
    with pytest.raises(RankError, match=r"rank 0: refused \(UnsupportedModel: .*kv_heads 3.*"
                       r"rank 1: shard_model: logits all, weights"):
        shard_model(whole, tp)
    with pytest.raises(RankError, match=r"rank 0: build_model\('tiny'.*rank 1: refused "
                       r"\(KeyError: .*no model preset 'tiny-'"):
        build_model("tiny" if rank == 0 else "tiny-", tp=tp)
    with pytest.raises(KeyError, match="no model preset"):  # refused alike: its own error
        build_model("tiny-", tp=tp)
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    model = build_model("tiny", tp=tp)  # in step
    ids, pos = torch.arange(1, 12), torch.arange(11)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, pos, seq_lens=[11]),
                                   build_model("tiny")(ids, pos, seq_lens=[11]),
                                   atol=1e-5, rtol=1e-5)


def test_a_rank_that_refuses_before_the_split_stops_every_rank_at_once():
    spawn(_refused_before_the_split)


def _failure_in_a_split(rank: int) -> None:
    from unittest import mock

    from graphcap.models import shard

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory making rank 1's share")

    # A rank that failed making its share (or moving it to its GPU) left the others going
    # on alone with theirs, to wait at their first capture until collective_timeout_s.
    tp = TPGroup(timeout_s=PATIENT, collective_timeout_s=2 * PATIENT)
    start = time.monotonic()
    with mock.patch.object(shard, "shard_tensor", out_of_memory if rank else
                           shard.shard_tensor):
        with pytest.raises(RankError, match=r"rank 1: refused \(OutOfMemoryError: out of "
                           r"memory making rank 1's share\)"):
            build_model("tiny", tp=tp)
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    model = build_model("tiny", tp=tp)  # in step
    runner = graphcap.capture(model, "full", buckets=[8], max_requests=2)
    ids, pos = torch.arange(1, 7), torch.arange(6)
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, pos, seq_lens=[6]),
                                   build_model("tiny")(ids, pos, seq_lens=[6]),
                                   atol=1e-5, rtol=1e-5)


def test_a_rank_that_fails_making_its_share_stops_every_rank_at_once():
    spawn(_failure_in_a_split)


@pytest.mark.parametrize("device,dtype", [
    ("cpu", torch.float32),
    *(pytest.param("cuda", dtype, marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU")])
      for dtype in (torch.float32, torch.bfloat16))])
def test_a_fingerprint_names_the_weights_bits_and_shapes(device, dtype):
    from graphcap.models.shard import fingerprint

    def built(seed=0):
        return build_model("tiny", device=device, dtype=dtype, seed=seed)

    a, b = built(), built()
    assert fingerprint(a) == fingerprint(b) != fingerprint(built(seed=1))
    with torch.no_grad():
        b.norm[0] = -b.norm[0]  # one bit: the sign
    assert fingerprint(a) != fingerprint(b)
    meta = build_model("tiny", device="meta")
    assert fingerprint(meta) == fingerprint(build_model("tiny", device="meta", seed=1))
    assert fingerprint(meta) != fingerprint(build_model("tiny-moe", device="meta"))


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
    # never other tokens.
    for other in ([[5, 9, 2, 7], [3]], [[7, 1, 8], [6]]):
        prompts = [[5, 9, 2], [3]] if rank == 0 else other
        with pytest.raises(RankError, match="disagree"):
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


def _release(rank: int) -> None:
    tp = TPGroup(timeout_s=PATIENT)
    runner = graphcap.capture(build_model("tiny", tp=tp), "full", buckets=[8],
                              max_requests=1)
    call(runner, [6])
    tp.release()
    assert tp.data is None and tp.control is None  # destroyed now, not at exit
    with pytest.raises(RankError, match=rf"closed \(rank {rank} released the group\)"):
        call(runner, [6])
    with pytest.raises(GraphcapError, match="no TP group named"):
        group_named(tp.name)
    # One rank releasing: the other's next call says so, at once (no timeout blamed).
    tp = TPGroup(timeout_s=PATIENT)
    runner = graphcap.capture(build_model("tiny", tp=tp), "full", buckets=[8],
                              max_requests=1)
    dist.barrier()
    if rank == 1:
        tp.release()
    dist.barrier()
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(RankError, match="rank 1 released the group"):
            call(runner, [6])
        assert time.monotonic() - start < PATIENT / 2


def test_a_released_group_destroys_its_process_groups_and_refuses_every_later_use():
    spawn(_release)


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
    from graphcap.tp.group import _rank_neutral

    what = "norm: another tensor (bfloat16 (64,) on cuda:1; was bfloat16 (64,) on cuda:1)"
    assert _rank_neutral(what) == \
        "norm: another tensor (bfloat16 (64,) on cuda; was bfloat16 (64,) on cuda)"
    assert _rank_neutral("moved from ['cuda:1'] to ['cpu'] (<X object at 0x7f00>)") == \
        "moved from ['cuda'] to ['cpu'] (<X object>)"


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


def test_a_tp_size_that_does_not_divide_the_heads_is_refused():
    with pytest.raises(UnsupportedModel, match="does not divide kv_heads 2"):
        shard_args(PRESETS["tiny"], 4)
    t = torch.arange(12).reshape(6, 2)
    assert shard_tensor(t, 0, [4, 2], 1, 2).tolist() == [[4, 5], [6, 7], [10, 11]]
    assert shard_tensor(t, 1, [2], 0, 2).tolist() == [[0], [2], [4], [6], [8], [10]]
    # A part the size does not divide: refused, not cut (it gave 1 row a rank of 3, the
    # last one on no rank).
    with pytest.raises(ValueError, match=r"part 0 of \[3, 3\] \(3 along dim 0\) does not "
                       r"divide into 2"):
        shard_tensor(t, 0, [3, 3], 0, 2)


def test_only_the_feed_forward_a_model_has_must_divide_the_tp_size():
    from dataclasses import replace

    # An MoE model's dense intermediate is unused: it was refused all the same.
    moe = replace(PRESETS["tiny-moe"], intermediate=127)
    local = shard_args(moe, 2)
    assert (local.moe_intermediate, local.intermediate) == (16, 127)
    with pytest.raises(UnsupportedModel, match="does not divide moe_intermediate 33"):
        shard_args(replace(moe, moe_intermediate=33), 2)
    with pytest.raises(UnsupportedModel, match="does not divide intermediate 127"):
        shard_args(replace(PRESETS["tiny"], intermediate=127), 2)  # dense: split, checked
    assert shard_args(replace(PRESETS["tiny"], moe_intermediate=33), 2).intermediate == 64


class _OneRank:
    """A one-rank group's face to the split (its agreements have no one to agree with)."""
    size, rank, name = 1, 0, "one-rank"

    def meet(self, what, op):
        pass

    def agree(self, key, what, advice=None):
        pass


def test_a_one_rank_group_takes_mxfp4_experts_whole():
    from graphcap.models.shard import shard_whole

    # It was ValueError: parts [32] do not add up to dim 2 of shape (8, 64, 16) (the
    # packed bytes of w2 split as if they were values).
    whole = build_model("tiny-gpt-oss-mxfp4")
    share = shard_whole(whole, _OneRank(), "a test")
    assert share.local_args == whole.args
    mine, want = share.state_dict(), whole.state_dict()
    assert mine.keys() == want.keys()
    assert all(torch.equal(mine[k], want[k]) for k in want)
    with pytest.raises(UnsupportedModel, match="does not split MXFP4 experts"):
        shard_args(PRESETS["tiny-gpt-oss-mxfp4"], 2)


def test_a_one_rank_share_of_mxfp4_experts_is_put_in_the_kernel_s_order(monkeypatch):
    from graphcap.models.decoder import MoE

    # As load_checkpoint(tp=) does; build_model(tp=) left the share in the published order
    # (the Triton kernels, 1.5-2.6x slower on an H200 than the CUDA kernel's order).
    asked = []
    monkeypatch.setattr(MoE, "to_operand_order", lambda self: asked.append(self))
    share = build_model("tiny-gpt-oss-mxfp4", tp=_OneRank())
    assert [id(m) for m in asked] == [id(m) for m in share.modules() if isinstance(m, MoE)]


def test_a_group_needs_torch_distributed_initialised():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(graphcap.errors.GraphcapError, match="init_process_group"):
        TPGroup()




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


def test_the_old_graphcap_dist_import_still_works_and_says_where_each_part_went():
    import importlib
    import sys

    sys.modules.pop("graphcap.dist", None)
    with pytest.warns(DeprecationWarning, match="graphcap.tp.*graphcap.models"):
        old = importlib.import_module("graphcap.dist")
    assert old.TPGroup is TPGroup and old.shard_args is shard_args
    assert old.shard_model is shard_model
