"""graphcap bench's other suites: prefill split across GPUs, generate, speculative
decoding, and the launch line."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import requires_cuda


@pytest.mark.slow
def test_bench_prefill_tp_times_the_split_preset_beside_the_whole_in_one_job():
    if torch.cuda.is_available():
        pytest.skip("the CPU form (gloo, the emulator); the GPUs run it through the CLI")
    from graphcap.bench import tp

    result = tp.run(("tiny",), ("eager", "breakable"), (8,), reps=2, tp=2, device="cpu",
                    timeout_s=120.0)  # ranks a loaded machine keeps apart still agree
    model = result["models"][0]
    assert model["tp1"]["rows"][0]["tokens"] == 8 and model["tp2"]["rows"][0]["ms"]
    assert set(model["ratios"][0]["tp_over_1"]) == {"eager", "breakable"}
    assert len(model["tp2"]["ranks"]) == 2 and "breakable" in model["tp2"]["ranks"][1]
    assert any("breakable rank 1: build s" in t["target"] for t in model["targets"])


def test_bench_prefill_tp_takes_results_larger_than_a_pipe_holds(monkeypatch):
    import threading

    from graphcap.bench import tp
    from tests.support.bench_workers import large_result

    # It joined the ranks before reading: rank 0 waited on a full pipe for ever.
    monkeypatch.setattr(tp, "_worker", large_result)
    got = []
    thread = threading.Thread(target=lambda: got.append(
        tp._spawn(1, {"bytes": 1 << 20})), daemon=True)
    thread.start()
    thread.join(60)
    assert got and len(got[0][0]["model"]) == 1 << 20


def test_the_split_breakable_share_is_judged_against_full_on_its_own_kernels():
    # As the unsplit targets: full-<attention>, not whichever full arm is listed first.
    from graphcap.bench.tp import tp_targets

    ms = {"eager": 10.0, "full-triton": 2.0, "full-flashinfer": 1.0, "breakable": 1.2}
    one = {"model": "llama3-8b", "attention": "flashinfer", "build": {},
           "rows": [{"tokens": 16, "ms": ms}]}
    split = {**one, "ranks": []}
    share = [t for t in tp_targets(one, split, 2) if "breakable speed-up" in t["target"]]
    assert [t["target"] for t in share] == [
        "16 tokens, TP=2: breakable speed-up / full-flashinfer's"]
    assert share[0]["measured"] == pytest.approx(0.8333) and not share[0]["met"]


def test_bench_generate_judges_the_llm_against_its_own_decode_step():
    if torch.cuda.is_available():
        pytest.skip("the CPU form of the suite (the GPU runs it through the CLI)")
    from graphcap.bench import generate

    result = generate.run(("tiny",), cases=((1, 8, 6), (3, 8, 6)), long=(40, 16), reps=1)
    model = result["models"][0]
    assert {(c["strategy"], c["prompts"]) for c in model["cases"]} == \
        {(s, p) for s in ("full", "breakable") for p in (1, 3)}
    assert all(c["tokens_per_s"] > 0 for c in model["cases"])
    assert set(model["step_ms"]) == {1, 3} and model["captured_nothing_later"]
    assert all(long["prefill_fallbacks"] == 0 and long["extend_replays"] == 2
               for long in model["long_prompt"].values())  # 40 tokens: 16 + 16 + 8
    names = [t["target"] for t in model["targets"]]
    assert "full, 1 x 8 + 6: tokens/s of the step's floor" in names
    assert "breakable: LLM build s" in names and all("met" in t for t in model["targets"])
    assert "CUDA only" in model["transformers"]["skipped"]


def test_bench_generate_counts_idle_time_between_launches_apart_from_gaps_inside_one():
    from graphcap.bench.generate import _idle, targets

    assert _idle([]) == 0.0
    assert _idle([(0, 2), (1, 3), (5, 6)]) == round(1 - 4 / 6, 4)  # idle 3..5
    assert _idle([(0, 6), (1, 2), (3, 4)]) == 0.0  # spans inside one launch's span
    found = targets({"cases": [], "step_ms": {}, "build_s": {}, "long_prompt": {},
                     "captured_nothing_later": True,
                     "gpu_idle": {"full": {"between_launches": 0.04, "any": 0.2}}})
    idle = [t for t in found if "idle" in t["target"]]
    assert [(t["measured"], t["met"]) for t in idle] == [(0.04, True)]


def test_bench_speculative_sets_each_proposer_beside_plain_decode_with_its_acceptance():
    from graphcap.bench import speculative

    result = speculative.run(("tiny",), batches=(1, 2), k=3, reps=1, device="cpu",
                             prompt=32, new=12, strategies=("full", "breakable"))
    model = result["models"][0]
    assert set(model["steps"]) == {1, 2}
    assert all(s["verify_ms"] > 0 and s["decode_ms"] > 0 for s in model["steps"].values())
    for rows in model["generate"].values():
        assert set(rows) == {"plain", "plain-repeating", "target", "random", "ngram"}
        # the target's own tokens are all accepted; random ones (almost) never
        assert rows["target"]["mean_acceptance_length"] == 4.0
        assert rows["random"]["acceptance_rate"] < 0.1
        assert all(rows[a]["tokens_equal_plain"] for a in ("target", "random", "ngram"))
    assert model["verify_fallbacks"] == 0 and model["verify_replays"] > 0
    names = [t["target"] for t in model["targets"]]
    assert names[0] == "verify step of 1 + 3 tokens over a decode step, batch 1"
    assert "the target as its own draft: acceptance length, batch 1" in names
    assert set(model["generate"][1]["random"]["ms_per_step"]) == \
        {"draft", "verify", "host", "loop"}
    assert names[-2] == "every verify and draft step replayed a graph"
    assert model["targets"][-2]["met"]
    # the preset in float32 under each strategy: speculation's greedy tokens are plain's
    assert set(model["exact"]) == {"full", "breakable"}
    for rows in model["exact"].values():
        assert rows["random"]["tokens_equal_plain"] and rows["ngram"]["tokens_equal_plain"]
        assert rows["random"]["verify_steps"] > 0 and rows["fallbacks"] == 0
    assert names[-1].startswith("greedy tokens equal plain decoding's (float32; full, ")
    assert model["targets"][-1] == {**model["targets"][-1], "measured": "4 of 4 runs",
                                    "met": True}


def test_the_exact_target_fails_on_one_run_that_parts_from_plain_decoding():
    from graphcap.bench.speculative import targets

    def exact(equal: bool, fallbacks: int = 0) -> dict:
        return {"model": "tiny", "k": 4, "exact": {
            "full": {"random": {"tokens_equal_plain": True},
                     "ngram": {"tokens_equal_plain": equal}, "fallbacks": fallbacks}}}

    assert targets(exact(True)) == [{
        "target": "greedy tokens equal plain decoding's (float32; full; random and n-gram "
                  "proposals)", "measured": "2 of 2 runs", "limit": "all", "met": True}]
    assert targets(exact(False))[0]["measured"] == "1 of 2 runs"
    assert not targets(exact(False))[0]["met"]
    assert not targets(exact(True, fallbacks=1))[0]["met"]  # an eager step: not met either


def test_the_launch_line_fits_fixed_time_and_rate_and_refuses_what_sets_no_line():
    from graphcap.bench.launch_line import fit

    line = fit([(b, 2.5 + b / 4e12 * 1e6) for b in (4e6, 16e6, 64e6, 256e6)])
    assert line["fixed_us"] == pytest.approx(2.5, abs=1e-3)
    assert line["bytes_per_s"] == pytest.approx(4e12, rel=1e-6)
    assert line["largest_miss_us"] < 1e-3 and len(line["points"]) == 4
    with pytest.raises(ValueError, match="two sizes"):
        fit([(4e6, 3.0), (4e6, 3.1)])
    with pytest.raises(ValueError, match="fall with the bytes"):
        fit([(4e6, 5.0), (64e6, 3.0)])


def test_the_launch_floor_prices_each_projection_and_attention_launch_and_the_lm_head():
    from graphcap.bench.launch_line import decode_floor_ms
    from graphcap.models import PRESETS

    a = PRESETS["qwen3-0.6b"]
    line = {"fixed_us": 2.0, "bytes_per_s": 4e12}
    q, kv = a.heads * a.head_dim, a.kv_heads * a.head_dim
    per_layer = [(q + 2 * kv) * a.hidden, a.hidden * q, 2 * a.intermediate * a.hidden,
                 a.hidden * a.intermediate, 8 * 1025 * 2 * kv]
    launches = 5 * a.layers + 1
    reads = 2 * (sum(per_layer) * a.layers + a.vocab_size * a.hidden)
    want = (launches * 2.0 + reads / 4e12 * 1e6) / 1e3
    assert decode_floor_ms(a, 8, 1025, line) == pytest.approx(want, abs=1e-4)
    # The recorded H200 line (docs/notes/2026-12-04-decode-launch-floor.md): 0.630 ms.
    recorded = {"fixed_us": 2.4317, "bytes_per_s": 4.554e12}
    assert decode_floor_ms(a, 1, 1024, recorded) == pytest.approx(0.630, abs=1e-3)
    assert decode_floor_ms(PRESETS["qwen3-30b-a3b-4l"], 1, 1024, recorded) is None  # experts


def test_the_read_kernel_reads_every_block_once():
    from graphcap.bench.launch_line import read

    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.arange(3 * 4096 + 100, dtype=torch.float32, device=device) % 7
    out = torch.empty(4, dtype=torch.float32, device=device)
    want = torch.stack([x[i * 4096:(i + 1) * 4096].sum() for i in range(4)])
    torch.testing.assert_close(read(x.to(torch.bfloat16), out), want)
    with pytest.raises(ValueError, match="4 blocks need one each"):
        read(x, torch.empty(3, device=device))
    with pytest.raises(ValueError, match="contiguous"):
        read(x.view(-1, 2).t(), out)


def test_every_size_of_the_launch_line_is_timed_over_as_many_launches(monkeypatch):
    # A graph's replay is timed whole and shared among its launches: with fewer launches
    # at large sizes, the graph's own launch would weigh on them alone and bend the line.
    from graphcap.bench import launch_line, timing

    counts = []

    def timed(calls, **_):
        counts.append((len(calls), len(set(calls))))
        return 1.0

    monkeypatch.setattr(timing, "cycled_ms", timed)
    monkeypatch.setattr(launch_line, "CYCLED_MB", 8)
    with pytest.raises(ValueError, match="no rate"):  # every point 1 ms: a flat line
        launch_line.measure("cpu", sizes_mb=(1, 4))
    assert counts == [(launch_line.LAUNCHES, 8), (launch_line.LAUNCHES, 2)]


@requires_cuda
@pytest.mark.gpu
def test_the_launch_line_of_this_gpu_is_a_few_microseconds_and_terabytes_a_second():
    from graphcap.bench.launch_line import measure

    line = measure("cuda", sizes_mb=(4, 64))
    assert 0.2 < line["fixed_us"] < 50 and 2e11 < line["bytes_per_s"] < 2e13


def _tp_run(monkeypatch, one_skipped, split_skipped, one_ms, split_ms, attention="triton"):
    from graphcap.bench import tp

    def result(skipped, ms):
        return [{"model": "llama3-8b", "attention": attention, "build": {}, "ranks": [],
                 "skipped": skipped, "rows": [{"tokens": 16, "ms": ms}]}]

    env = {"commit": "abc", "device": "NVIDIA H100 80GB HBM3", "torch": "2.x"}
    monkeypatch.setattr(tp, "environment", lambda: env)
    monkeypatch.setattr(tp, "_spawn", lambda size, job: result(
        one_skipped, one_ms) if size == 1 else result(split_skipped, split_ms))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    arms = sorted({*one_ms, *one_skipped, *split_ms, *split_skipped})
    return tp.run(["llama3-8b"], arms, [16], tp=2, device="cuda")


def test_bench_prefill_tp_records_the_gpu_and_does_not_judge_what_the_split_did_not_run(
        monkeypatch, capsys):
    # The record's device read "cuda"; an arm that failed split was neither shown nor
    # judged, and the run exited 0.
    from graphcap.bench.report import show_tp

    why = "RuntimeError: NCCL error"
    ms = {"eager": 10.0, "breakable": 1.2, "full-triton": 1.0}
    result = _tp_run(monkeypatch, {}, {"breakable": why, "full-triton": why}, ms,
                     {"eager": 8.0})
    assert result["device"] == "NVIDIA H100 80GB HBM3"
    targets = {t["target"]: t for t in result["models"][0]["targets"]}
    assert set(targets) == {"breakable: TP=2 against TP=1", "full-triton: TP=2 against TP=1",
                            "16 tokens: full TP=2 ms / TP=1 ms",
                            "16 tokens, TP=2: breakable speed-up / full's"}
    assert all(not t["met"] and why in t["not_judged"] for t in targets.values())
    show_tp(result)
    assert f"not run at TP=2: breakable: {why}" in capsys.readouterr().out
    # An arm here at neither (a backend not installed): shown, not judged against itself.
    result = _tp_run(monkeypatch, {"full-flash_attn": "no FA4"}, {"full-flash_attn": "no FA4"},
                     ms, {"eager": 8.0, "breakable": 0.7, "full-triton": 0.6})
    assert all("not_judged" not in t for t in result["models"][0]["targets"])
    # The share is breakable's: full-triton failing split, breakable not asked for.
    result = _tp_run(monkeypatch, {}, {"full-triton": why}, {"eager": 10.0, "full-triton": 1.0},
                     {"eager": 8.0})
    assert [t["target"] for t in result["models"][0]["targets"]] == [
        "full-triton: TP=2 against TP=1", "16 tokens: full TP=2 ms / TP=1 ms"]


def test_a_full_arm_only_the_split_run_has_is_not_compared_with_a_missing_one(monkeypatch):
    # It took the first full arm of the split run and read the unsplit run's (KeyError,
    # after every arm was timed and before anything was written).
    why = "OutOfMemoryError: ..."
    result = _tp_run(monkeypatch, {"full-flashinfer": why}, {},
                     {"eager": 10.0, "full-triton": 1.0},
                     {"eager": 8.0, "full-flashinfer": 0.5, "full-triton": 0.6})
    targets = {t["target"]: t for t in result["models"][0]["targets"]}
    assert targets["16 tokens: full-triton TP=2 ms / TP=1 ms"]["measured"] == 0.6
    assert "not_judged" in targets["full-flashinfer: TP=2 against TP=1"]


def test_a_speculative_ratio_just_past_its_limit_is_a_miss_judged_unrounded():
    from graphcap.bench.speculative import targets

    model = {"model": "tiny", "k": 4,
             "steps": {1: {"decode_ms": 1.0, "verify_ms": 1.3004}},
             "generate": {1: {"random": {"plain_over_this": 1 / 1.3504},
                              "ngram": {"mean_acceptance_length": 3.5,
                                        "plain_over_this": 1.9996}}}}
    verdicts = {t["target"].split(":")[0].split(" (")[0]: t for t in targets(model)}
    assert [t["met"] for t in verdicts.values()] == [False, False, False]
    assert verdicts["zero acceptance"]["measured"] == 1.35  # given rounded
