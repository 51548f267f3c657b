"""graphcap bench decode: every arm per batch and context, the bytes a step reads, the
gpt-fast recipe as the peer, and the decode targets."""

from __future__ import annotations

import pytest
import torch

from graphcap.bench.targets import prefill_targets
from graphcap.errors import GraphcapError
from graphcap.models import build_model
from tests.support.bench_rows import row
from tests.support.runner_helpers import DEVICE


def test_bench_decode_times_every_arm_per_batch_and_context_and_says_what_did_not_run():
    if torch.cuda.is_available():
        pytest.skip("the CPU form of the suite (the GPU runs it through the CLI)")
    from graphcap.bench import decode

    result = decode.run(("tiny",), batches=(1, 2), contexts=(8, 12), reps=2)
    assert [m["context"] for m in result["models"]] == [8, 12]
    assert result["reps"] == 2  # the repetitions a call's time is the median of
    model = result["models"][0]
    assert [r["batch"] for r in model["rows"]] == [1, 2]
    for step in model["rows"]:
        assert set(step["ms"]) == {"eager", "breakable", "full", "tc_piecewise", "full-no-pdl"}
        assert all(ms > 0 for ms in step["ms"].values())
        # every arm but eager also fed back to back (no wait between calls)
        assert set(step["ms_back_to_back"]) == set(step["ms"]) - {"eager"}
        assert all(ms > 0 for ms in step["ms_back_to_back"].values())
        # and each graphcap arm's host time of a call from an idle device
        assert set(step["host_us"]) == set(step["ms"]) - {"eager"}
        assert all(us > 0 for us in step["host_us"].values())
        assert step["floor_ms"] == pytest.approx(step["bytes"] / decode.peak_bytes_per_s() * 1e3,
                                                abs=1e-4)
    assert model["rows"][1]["bytes"] > model["rows"][0]["bytes"]  # one more request's K/V
    for arm in ("hf-static-compile", "gpt-fast", "gpt-fast-gqa"):
        assert "CUDA" in model["skipped"][arm]
    assert "CUDA only" in model["skipped"]["full-flashinfer"]
    assert model["build"]["full"]["graph_pool_bytes"] > 0
    assert model["targets"] == []  # judged at a 1024-token context only
    # The launch line is measured on CUDA only: no launch floor here.
    assert result["launch_line"] is None
    assert all("launch_floor_ms" not in step for step in model["rows"])


def test_bench_decode_captures_for_tables_as_long_as_max_len_and_judges_no_target_there(
        monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the CPU form of the suite (the GPU runs it through the CLI)")
    from graphcap.bench import decode
    from graphcap.kv import PagedKVCache

    widths = []
    made = PagedKVCache.__init__

    def recorded(self, *args, **kwargs):
        made(self, *args, **kwargs)
        widths.append(self.block_table.shape[1] * self.page_size)

    monkeypatch.setattr(PagedKVCache, "__init__", recorded)
    result = decode.run(("tiny",), arms=("eager", "full"), batches=(1,), contexts=(8,),
                        reps=2, max_len=64)
    model = result["models"][0]
    assert model["max_len"] == 64 and widths == [64]  # an engine's table, not context + 1
    assert model["rows"][0]["ms"]["full"] > 0
    assert model["rows"][0]["bytes"] == decode.step_bytes(build_model("tiny"), 1, 9)
    with pytest.raises(ValueError, match="max_len 8: a request's table holds its context"):
        decode.run(("tiny",), arms=("eager",), batches=(1,), contexts=(8,), reps=2,
                   max_len=8)
    assert decode.targets({**model, "context": 1024, "max_len": 4096}) == []


def test_a_bench_arm_never_times_an_eager_fallback_as_its_own():
    # A step its graphs do not hold raises: it is never timed under the arm's name.
    from graphcap.bench import decode
    from graphcap.kv import PagedKVCache

    model = build_model("tiny", device=DEVICE)
    a = model.args
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=4, max_len=16,
                         dtype=torch.float32, device=DEVICE)
    for slot in range(4):
        cache.admit(slot, 16)
    runner = decode._capture(model, "full", cache, [1, 2])
    tokens = torch.ones(4, dtype=torch.long, device=DEVICE)
    positions = torch.zeros(4, dtype=torch.long, device=DEVICE)
    runner(tokens[:2], positions=positions[:2], slots=[0, 1])  # a captured batch: replayed
    with pytest.raises(GraphcapError, match="fallback"):
        runner(tokens, positions=positions, slots=[0, 1, 2, 3])  # 4 rows: no graph holds it
    assert runner.report()["fallbacks"] == {}


def test_bench_decode_plots_each_arm_beside_the_floor_or_says_why_not(tmp_path, capsys):
    from graphcap.bench.report import plot_decode, show_decode

    rows = [{"batch": b, "floor_ms": 0.1 * b, "launch_floor_ms": 0.3 * b,
             "ms": {"eager": 20.0, "full": 0.5 * b}} for b in (1, 8)]
    line = {"fixed_us": 2.43, "bytes_per_s": 4.55e12, "largest_miss_us": 0.2}
    result = {"arms": ["eager", "full"], "device": "cpu", "commit": "abc",
              "launch_line": line, "models": [{"model": "tiny", "context": 8, "rows": rows,
                                               "skipped": {}, "targets": []}]}
    show_decode(result)
    printed = capsys.readouterr().out
    assert "2.43 us + bytes at 4.55 TB/s" in printed and "launch floor" in printed
    assert "2.400" in printed  # batch 8's launch floor, in its column
    failed = {**result, "launch_line": {"failed": "OutOfMemoryError: ..."},
              "models": [{**result["models"][0], "rows": [
                  {k: v for k, v in r.items() if k != "launch_floor_ms"} for r in rows]}]}
    show_decode(failed)
    printed = capsys.readouterr().out
    assert "launch line was not measured: OutOfMemoryError" in printed
    assert "launch floor" not in printed
    path = plot_decode(result, tmp_path / "decode.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert path is None and "matplotlib is not installed" in capsys.readouterr().out
    else:
        assert path == tmp_path / "decode.png" and path.stat().st_size > 0


def test_a_decode_step_reads_every_weight_once_and_each_requests_kv():
    from graphcap.bench.decode import step_bytes
    from graphcap.models import build_model

    model = build_model("tiny", device="cpu", dtype=torch.bfloat16)
    a = model.args
    params = sum(p.numel() for p in model.parameters())
    kv_token = a.layers * a.kv_heads * a.head_dim * 2 * 2
    unread = (a.vocab_size - 3) * a.hidden * 2  # the embedding rows no request looks up
    assert step_bytes(model, 3, 100) == params * 2 - unread + 3 * 100 * kv_token


def test_a_moe_decode_step_reads_the_experts_its_tokens_reach_on_average():
    from graphcap.bench.decode import step_bytes
    from graphcap.models import build_model

    model = build_model("tiny-moe", device="cpu", dtype=torch.bfloat16)
    a = model.args
    experts = sum(t.numel() * t.element_size() for m in model.modules()
                  if type(m).__name__ == "MoE" for t in m.parameters(recurse=False))
    dense = step_bytes(model, 1, 100) - 100 * a.layers * a.kv_heads * a.head_dim * 2 * 2
    everything = sum(p.numel() * 2 for p in model.parameters()) \
        - (a.vocab_size - 1) * a.hidden * 2
    assert dense == everything - experts + experts * a.top_k // a.experts  # 2 of 8
    wide = 8 * 100 * a.layers * a.kv_heads * a.head_dim * 2 * 2
    reached = 1 - (1 - a.top_k / a.experts) ** 8  # 8 tokens, 2 of 8 each: 90% of them
    assert step_bytes(model, 8, 100) - wide == pytest.approx(
        everything - experts + experts * reached + 7 * a.hidden * 2, abs=1)


def test_a_windowed_layer_s_kv_counts_its_window_only():
    import dataclasses

    from graphcap.bench.decode import step_bytes
    from graphcap.bench.launch_line import decode_floor_ms
    from graphcap.models import PRESETS, build_model

    model = build_model("tiny", device="cpu", dtype=torch.bfloat16)
    full = step_bytes(model, 4, 1000)
    # every other layer windowed to 128 tokens (gpt-oss's pattern)
    model.args = dataclasses.replace(model.args, window=128, global_every=2)
    per_token = model.args.kv_heads * model.args.head_dim * 2 * 2
    assert full - step_bytes(model, 4, 1000) == 4 * (1000 - 128) * per_token
    line = {"fixed_us": 0.0, "bytes_per_s": 1e9}
    saved = decode_floor_ms(PRESETS["tiny"], 4, 1000, line) - \
        decode_floor_ms(model.args, 4, 1000, line)
    assert saved == pytest.approx(4 * (1000 - 128) * per_token / 1e9 * 1e3, abs=1e-4)


def test_decode_targets_judge_the_fastest_graphcap_arm_and_the_strategies_shares():
    from graphcap.bench.decode import targets

    model = {"model": "qwen3-0.6b", "context": 1024, "window": 0, "rows": [
        {"batch": 1, "ms": {"eager": 20.0, "full": 0.6, "full-flashinfer": 0.45,
                            "breakable": 0.62, "tc_piecewise": 0.7, "gpt-fast": 1.5}}]}
    found = {t["target"]: t for t in targets(model)}
    best = found["batch 1: ms per step, fastest graphcap arm (full-flashinfer)"]
    assert best["measured"] == 0.45 and best["met"]
    over = found["batch 1: gpt-fast ms / full-flashinfer ms, a call alone each"]
    assert over["measured"] == pytest.approx(3.333) and over["met"]  # 3x needed
    # the faster form of the recipe is the peer
    faster = {t["target"]: t for t in targets(
        {**model, "rows": [{"batch": 1, "ms": {**model["rows"][0]["ms"], "gpt-fast-gqa": 1.2}}]})}
    assert "batch 1: gpt-fast ms / full-flashinfer ms, a call alone each" not in faster
    assert not faster["batch 1: gpt-fast-gqa ms / full-flashinfer ms, a call alone each"][
        "met"]  # 2.667x
    # The recipe's steps fed back to back, as gpt-fast's loop feeds them, against graphcap's
    # fed alike: a call alone would count the recipe's host work a loop hides.
    fed = {**model["rows"][0], "ms_back_to_back": {"full": 0.4, "full-flashinfer": 0.42,
                                                   "gpt-fast": 1.1, "gpt-fast-gqa": 1.3}}
    judged = [t for t in targets({**model, "rows": [fed]}) if "gpt-fast" in t["target"]]
    assert [t["target"] for t in judged] == [
        "batch 1: gpt-fast ms / full ms, both fed back to back"]
    assert judged[0]["measured"] == pytest.approx(2.75) and not judged[0]["met"]
    assert found["batch 1: breakable speed-up / full's"]["measured"] == pytest.approx(0.968)
    assert not found["batch 1: tc_piecewise speed-up / full's"]["met"]
    assert targets({**model, "context": 128}) == []


def test_a_decode_ratio_just_short_of_its_limit_is_a_miss_though_it_rounds_to_it():
    from graphcap.bench.decode import targets

    model = {"model": "qwen3-0.6b", "context": 1024, "window": 0, "rows": [
        {"batch": 1, "ms": {"eager": 20.0, "full": 0.5, "breakable": 0.52633,
                            "tc_piecewise": 0.5556},
         "ms_back_to_back": {"full": 0.4, "gpt-fast": 1.1999}}]}  # 2.99975x, 0.94997, 0.89993
    found = {t["target"]: t for t in targets(model)}
    for what, shown in (("batch 1: gpt-fast ms / full ms, both fed back to back", 3.0),
                        ("batch 1: breakable speed-up / full's", 0.95),
                        ("batch 1: tc_piecewise speed-up / full's", 0.9)):
        assert found[what]["measured"] == shown and not found[what]["met"], found[what]


def test_a_target_whose_arm_did_not_run_is_not_judged_and_not_met(capsys):
    # The arm a target needs was asked for and failed: the verdict says so (the run's exit
    # status with it), it does not vanish from the targets.
    from graphcap.bench.decode import targets
    from graphcap.bench.report import show_targets

    why = "RuntimeError: Inductor failed"
    result = {"model": "qwen3-0.6b", "attention": "triton",
              "skipped": {"compile-reduce-overhead": why, "breakable": why},
              "rows": [row(16, eager=10.0, **{"full-triton": 1.0})]}
    got = {t["target"]: t for t in prefill_targets(result)}
    for what, arm in (("reduce-overhead ms / fastest graphcap arm on its kernels",
                       "compile-reduce-overhead"), ("breakable speed-up / full's", "breakable")):
        assert not got[what]["met"] and arm in got[what]["not_judged"]
    assert "tc_piecewise-inductor speed-up / full's" not in got  # not asked for
    show_targets(list(got.values()))
    assert "NOT JUDGED" in capsys.readouterr().out
    decode = {"model": "qwen3-0.6b", "context": 1024, "window": 0,
              "skipped": {"gpt-fast": why, "gpt-fast-gqa": why},
              "rows": [{"batch": 1, "ms": {"full": 0.4}, "ms_back_to_back": {"full": 0.35}}]}
    peer = [t for t in targets(decode) if "gpt-fast" in t["target"]]
    assert len(peer) == 1 and not peer[0]["met"] and why in peer[0]["not_judged"]
    # one form of the recipe running judges it
    decode["skipped"].pop("gpt-fast")
    decode["rows"][0]["ms_back_to_back"]["gpt-fast"] = 1.5
    assert [t["met"] for t in targets(decode) if "gpt-fast" in t["target"]] == [True]


@pytest.mark.parametrize("gqa", [False, True], ids=["repeated-heads", "enable_gqa"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_the_gpt_fast_recipe_computes_graphcaps_decode_step_on_the_same_weights(qk_norm, gqa):
    from graphcap.bench.gptfast import StaticCacheDecoder
    from graphcap.engine.eager import decode_step, prefill
    from graphcap.kv import PagedKVCache
    from graphcap.models import Decoder, ModelArgs

    torch.manual_seed(0)
    model = Decoder(ModelArgs(qk_norm=True) if qk_norm else ModelArgs()).eval()
    if qk_norm:
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.q_norm, 1.0, 0.2)
            torch.nn.init.normal_(block.attn.k_norm, 1.0, 0.2)
    a = model.args
    batch, context = 3, 5
    recipe = StaticCacheDecoder(model, batch, 13, gqa=gqa)
    assert len(recipe._buffers) == 2 * a.layers + 1  # a cache buffer per layer (+ mask)
    assert recipe.cache(0)[0].shape[2] == 16  # gpt-fast rounds its length up to 8s
    cache = PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=batch, max_len=16,
                         dtype=torch.float32, device="cpu")
    ids = torch.randint(1, a.vocab_size, (batch, context + 1))
    for slot in range(batch):
        cache.admit(slot, 16)
    prefill(model, cache, ids[:, :context].reshape(-1), [context] * batch, list(range(batch)))
    with torch.no_grad():
        for p in range(context):  # the recipe's cache filled a token at a time
            recipe(ids[:, p:p + 1], torch.tensor([p]))
        got = recipe(ids[:, context:], torch.tensor([context]))
        want = decode_step(model, cache, ids[:, context], torch.full((batch,), context),
                           list(range(batch)))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_gpt_fast_recipe_refuses_what_it_does_not_cover_by_name():
    from graphcap.bench.gptfast import StaticCacheDecoder
    from graphcap.models import build_model

    with pytest.raises(ValueError, match="experts"):
        StaticCacheDecoder(build_model("tiny-moe", device="cpu"), 1, 8)


def test_each_gpt_fast_step_is_compiled_for_its_own_static_shapes(monkeypatch):
    # gpt-fast compiles one batch size and cache length a process: static shapes. The bench
    # compiles a step per arm, batch and context in one process, where Dynamo's automatic
    # dynamic shapes made every step after a shape changed symbolic (batch 8 after 1).
    from graphcap.bench.gptfast import compiled_step
    from graphcap.models import Decoder, ModelArgs

    symbolic, compile = [], torch.compile

    def record(gm, inputs):  # in Inductor's place: whether the graph's shapes are symbols
        values = [n.meta.get("example_value") for n in gm.graph.nodes
                  if n.op == "placeholder"]
        symbolic.append(any(isinstance(v, torch.SymInt) or isinstance(v, torch.Tensor)
                            and any(isinstance(s, torch.SymInt) for s in v.shape)
                            for v in values))
        return gm.forward

    def recorded(module, mode=None, **options):
        assert mode == "reduce-overhead" and options["fullgraph"]
        return compile(module, backend=record, **options)

    monkeypatch.setattr(torch, "compile", recorded)
    torch._dynamo.reset()
    model = Decoder(ModelArgs()).eval()
    config = torch._dynamo.config
    limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    before = getattr(config, limit)
    try:
        for batch, max_len, gqa in ((1, 13, False), (3, 13, False), (5, 13, True),
                                    (3, 21, True)):
            ids = torch.randint(1, model.args.vocab_size, (batch, 1))
            compiled_step(model, ids, torch.tensor([max_len - 1]), max_len, gqa=gqa,
                          math=not gqa, warmup=1)
    finally:
        torch._dynamo.reset()
    assert symbolic == [False] * 4
    # room for its compiles while they were made; the process's limit left as it was
    assert getattr(config, limit) == before


def test_decode_targets_whose_every_graphcap_arm_failed_are_not_judged():
    # --arms eager,full-flashinfer,gpt-fast --context 1024, FlashInfer failing: the step
    # and gpt-fast targets vanished, and the run exited 0 with nothing judged.
    from graphcap.bench.decode import targets

    why = "RuntimeError: FlashInfer plan failed"
    model = {"model": "qwen3-0.6b", "context": 1024, "window": 0,
             "skipped": {"full-flashinfer": why},
             "rows": [{"batch": b, "ms": {"eager": 20.0, "gpt-fast": 1.5},
                       "ms_back_to_back": {"gpt-fast": 1.4}} for b in (1, 8)]}
    got = targets(model)
    assert [t["target"] for t in got] == [
        "batch 1: ms per step, fastest graphcap arm",
        "batch 1: the gpt-fast recipe's ms / fastest graphcap arm's",
        "batch 8: ms per step, fastest graphcap arm"]  # qwen3's 3x is batch 1's only
    assert all(not t["met"] and why in t["not_judged"] for t in got)
    model["skipped"] = {}  # none asked for: no claim
    assert targets(model) == []


def test_only_an_h200_is_judged_against_the_h200_s_copy_rate():
    """A GH200's memory is another: its rate is measured, as any other GPU's is."""
    from graphcap.bench.decode_attention import is_h200

    assert is_h200("NVIDIA H200") and is_h200("NVIDIA H200 NVL")
    assert not is_h200("NVIDIA GH200 480GB") and not is_h200("NVIDIA H100 80GB HBM3")
