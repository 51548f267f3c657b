"""Tensor parallelism on CPU: two processes over gloo, the graph emulator. The reference
decoders split across the ranks (dense and MoE; gpt-oss's layers eagerly) give the
unsharded model's logits eagerly and under every strategy, and each strategy's replays
the TP model's eager logits (up to the rounding of a padded shape); every replay runs
the model's collectives on every rank (the emulator re-runs them); a Hugging Face
checkpoint loads as each rank's share. Ranks that split other whole models, or one that
refuses its build, load, split or LLM, raise on every rank at once. The group's
agreements: test_tp_group.py; a rank that fails: test_tp_failures.py."""

from __future__ import annotations

import tempfile
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import graphcap
from graphcap.api import STRATEGIES
from graphcap.errors import (
    RankError,
    UnsupportedModel,
)
from graphcap.models import PRESETS, build_model, shard_args, shard_model, shard_tensor
from graphcap.tp import TPGroup, release_all
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


def _still_in_step(tp, start, forward=lambda model: model) -> None:
    """The group failed fast and stays usable: a rank built next matches the whole model."""
    assert time.monotonic() - start < PATIENT / 2 and tp.closed is None
    call = forward(build_model("tiny", tp=tp))
    ids, pos = torch.arange(1, 7), torch.arange(6)
    with torch.no_grad():
        torch.testing.assert_close(call(ids, pos, seq_lens=[6]),
                                   build_model("tiny")(ids, pos, seq_lens=[6]),
                                   atol=1e-5, rtol=1e-5)


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
    _still_in_step(tp, start)


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
    _still_in_step(tp, start, lambda model: graphcap.capture(
        model, "full", buckets=[8], max_requests=2))


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


@pytest.mark.parametrize("seconds", [0, -1.0, float("nan"), float("inf"), True, "5", None,
                                     np.int64(0), np.bool_(True)])
def test_a_timeout_that_is_not_a_positive_number_of_seconds_is_refused_by_name(seconds):
    for name in ("timeout_s", "collective_timeout_s"):
        with pytest.raises(ValueError, match=f"^{name}=.*positive number of seconds"):
            TPGroup(**{name: seconds})


def test_numpy_numbers_are_seconds_too():
    """numpy's ints and floats (a config read with numpy) pass the timeouts' check: past it,
    only torch.distributed is missing here."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(graphcap.errors.GraphcapError, match="init_process_group"):
        TPGroup(timeout_s=np.int64(5), collective_timeout_s=np.float32(60.0))




def test_the_old_graphcap_dist_import_still_works_and_says_where_each_part_went():
    import importlib
    import sys

    sys.modules.pop("graphcap.dist", None)
    with pytest.warns(DeprecationWarning, match="graphcap.tp.*graphcap.models"):
        old = importlib.import_module("graphcap.dist")
    assert old.TPGroup is TPGroup and old.shard_args is shard_args
    assert old.shard_model is shard_model
