"""Tensor parallelism on CUDA graphs (NCCL, one GPU per process): qwen3-0.6b and
llama3-8b split across 2 and 4 GPUs under every strategy give the split model's eager
logits, every replay runs its collectives on every rank, and 10,000 replays across
changing buckets finish under a watchdog (a hang fails, it does not stall the suite);
these skip with fewer than two GPUs. On one GPU, a one-rank group: NCCL's collectives
captured in every strategy's graphs and counted at every replay."""

from __future__ import annotations

import os

import pytest
import torch

import graphcap
from graphcap.api import STRATEGIES
from graphcap.models import build_model
from graphcap.tp import TPGroup
from tests.tp.test_tp import spawn

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.slow]
several = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")


def _strategies(rank: int, preset: str) -> None:
    tp = TPGroup(timeout_s=30.0)
    model = build_model(preset, device="cuda", dtype=torch.bfloat16, tp=tp)
    layers = model.args.layers
    gen = torch.Generator().manual_seed(0)
    calls = [[16], [5, 9], [60], [100, 20]]
    for strategy in STRATEGIES:
        runner = graphcap.capture(model, strategy, buckets=[16, 64, 128], max_requests=2)
        for lens in calls:
            n = sum(lens)
            ids = torch.randint(1, model.args.vocab_size, (n,), generator=gen).cuda()
            pos = torch.cat([torch.arange(k) for k in lens]).cuda()
            before = tp.collectives.copy()
            got = runner(ids, pos, seq_lens=lens)
            assert tp.collectives - before == {"all_reduce": 2 * layers, "all_gather": 1}
            with torch.no_grad():
                want = model(ids, pos, seq_lens=lens)
            torch.testing.assert_close(got, want, atol=0.05, rtol=0.05)
        del runner


@several
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("preset", ["qwen3-0.6b", "llama3-8b"])
def test_every_strategy_replays_the_split_model_on_cuda_graphs(world, preset):
    if GPUS < world:
        pytest.skip(f"needs {world} GPUs")
    spawn(_strategies, preset, world=world, backend="nccl")


def test_a_one_rank_group_captures_nccl_collectives_in_every_strategy():
    if GPUS < 1:
        pytest.skip("needs a GPU")
    spawn(_strategies, "qwen3-0.6b", world=1, backend="nccl")


def _soak(rank: int) -> None:
    import threading

    tp = TPGroup(timeout_s=30.0)
    model = build_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16, tp=tp)
    runner = graphcap.capture(model, "full", buckets=[8, 16, 32, 64], max_requests=1)
    done = threading.Event()
    watchdog = threading.Timer(300.0, lambda: os._exit(3))  # a hang ends the worker
    watchdog.start()
    try:
        for i in range(10_000):
            n = (8, 13, 30, 64, 5)[i % 5]  # each replays a graph (padded at most 2x)
            runner(torch.ones(n, dtype=torch.long, device="cuda"),
                   torch.arange(n, device="cuda"), seq_lens=[n])
        torch.cuda.synchronize()
        done.set()
    finally:
        watchdog.cancel()
    assert done.is_set() and sum(runner.report()["replays"].values()) == 10_000


@several
def test_ten_thousand_replays_across_buckets_finish_on_every_rank():
    spawn(_soak, world=2, backend="nccl")
