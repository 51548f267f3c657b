"""Benchmarks' arms compute the same thing as eager, and their timing interleaves them,
counts device time and records runs without overwriting one.
(The timings themselves are taken on the H200: `graphcap bench`, docs/results/.)"""

from __future__ import annotations

import pytest
import torch

from graphcap.bench.arms import build_arms, prompts
from graphcap.bench.common import time_interleaved, write_result
from graphcap.models import build_model


def test_every_arm_returns_the_eager_last_token_logits_for_every_length():
    model = build_model("tiny", logits="last")
    lengths = [4, 16, 32]
    names = ["eager", "breakable", "tc_piecewise-eager", "full-triton", "compile-default"]
    arms, skipped = build_arms(model, names, lengths)
    assert "full-triton" in skipped and "cuda" in skipped["full-triton"]
    assert set(arms) == {"eager", "breakable", "tc_piecewise-eager", "compile-default"}
    every = build_model("tiny")  # the same weights, logits of every token
    inputs = prompts(lengths, model.args.vocab_size, "cpu")
    for n in lengths:
        want = every(*inputs[n], seq_lens=[n])[-1:]
        for name, arm in arms.items():
            torch.testing.assert_close(arm.call(n), want, atol=1e-5, rtol=1e-5,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert arms["breakable"].runner.report()["replays"] == {4: 1, 16: 1, 32: 1}


def test_an_unknown_arm_is_named_with_the_known_ones():
    with pytest.raises(ValueError, match="compile-reduce-overhead"):
        build_arms(build_model("tiny", logits="last"), ["fast"], [4])


def test_timing_interleaves_arms_round_by_round_and_takes_medians():
    order = []
    arms = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    fake = iter(range(1000))

    def timer(fn):
        fn()
        return float(next(fake))

    times = time_interleaved(arms, reps=4, rounds=2, warmup=1, timer=timer)
    assert order == ["a", "b", "a", "a", "b", "b", "a", "a", "b", "b"]
    # timed calls: a a b b a a b b -> a got 0, 1, 4, 5 and b 2, 3, 6, 7
    assert times["a"] == {"median_ms": 2.5, "p10_ms": 0.3, "p90_ms": 4.7, "n": 4}
    assert times["b"]["median_ms"] == 4.5
    # reps not a multiple of the rounds: at least reps timed calls, never fewer
    times = time_interleaved(arms, reps=7, rounds=5, warmup=0, timer=timer)
    assert times["a"]["n"] == 10


def test_back_to_back_times_runs_of_calls_round_by_round_and_gives_a_call_s_share():
    from graphcap.bench.common import back_to_back

    order = []
    cases = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    got = back_to_back(cases, calls=4, reps=2, rounds=2, warmup=0,
                       timer=lambda fn: (fn(), 8.0)[1])
    assert got == {"a": 2.0, "b": 2.0}  # a run of 4 calls in 8 ms
    assert order == ["a"] * 4 + ["b"] * 4 + ["a"] * 4 + ["b"] * 4  # interleaved


def test_settling_runs_an_arm_untimed_until_the_time_passed_before_its_timed_calls(
        monkeypatch):
    import time

    now = [0.0]
    order, syncs = [], []

    def arm(name, ms):
        def call():
            order.append(name)
            now[0] += ms / 1000  # each call takes ``ms`` of wall time
        return call

    def timer(fn):
        fn()
        return 1.0

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    arms = {"eager": arm("eager", 30), "graph": arm("graph", 7)}
    time_interleaved(arms, reps=2, rounds=2, warmup=0, settle_ms=20, timer=timer,
                     sync=lambda: syncs.append(1))
    # Per round: eager settles in one call (30 ms), the graph arm in three (7, 14, 21 ms),
    # each waited for, then one timed call each.
    assert order == ["eager", "eager", "graph", "graph", "graph", "graph"] * 2
    assert len(syncs) == 2 * (1 + 3)
    order.clear()
    time_interleaved(arms, reps=2, rounds=2, warmup=0, timer=timer, sync=syncs.append)
    assert order == ["eager", "graph"] * 2  # no settling unless asked for
    order.clear()
    time_interleaved(arms, reps=2, rounds=2, warmup=0, settle_calls=2, timer=timer,
                     sync=lambda: None)  # by count: the same calls whatever the clock says
    assert order == ["eager", "eager", "eager", "graph", "graph", "graph"] * 2


def test_a_warm_up_in_seconds_runs_untimed_passes_over_every_arm_first(monkeypatch):
    import time

    now = [0.0]
    order = []

    def arm(name):
        def call():
            order.append(name)
            now[0] += 0.4  # each call takes 0.4 s of wall time
        return call

    def timer(fn):
        fn()
        return 1.0

    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    time_interleaved({"a": arm("a"), "b": arm("b")}, reps=1, rounds=1, warmup=1,
                     warmup_s=2.0, timer=timer, sync=lambda: None)
    # One warm-up call each (0.8 s), untimed passes until 2 s (two more), one timed each.
    assert order == ["a", "b"] * 3 + ["a", "b"]


def test_top_kernels_rank_device_time_per_replay():
    from graphcap.bench.prefill import top_kernels

    # Two replays: a gemm, then a norm launched with PDL that started 2 us before the
    # gemm ended (its wait is the gemm's time, not its own), then a gap.
    spans = [(0, 10, "gemm"), (8, 13, "rms_norm"), (20, 30, "gemm"), (28, 33, "rms_norm")]
    got = top_kernels(spans, reps=2, top=2)
    assert got == [{"kernel": "gemm", "launches": 1.0, "us": 10.0, "share": 0.7692},
                   {"kernel": "rms_norm", "launches": 1.0, "us": 3.0, "share": 0.2308}]
    assert top_kernels(spans, reps=2, top=1) == got[:1]


def test_kernel_spans_are_device_kernels_only():
    from types import SimpleNamespace

    from graphcap.bench.prefill import busy_us, kernel_spans

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, device, start, end, **flags):
        return SimpleNamespace(name=name, device_type=device,
                               time_range=SimpleNamespace(start=start, end=end), **flags)

    events = [event("gemm", cuda, 0, 10), event("aten::mm", cpu, 0, 50),
              event("replay", cuda, 0, 100, is_user_annotation=True),
              event("range", cuda, 0, 100, is_async=True), event("norm", cuda, 20, 25)]
    spans = kernel_spans(events)
    assert spans == [(0, 10, "gemm"), (20, 25, "norm")]
    assert busy_us(spans) == 15  # an annotation over every kernel would have read 100


def test_results_are_never_overwritten_silently(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = write_result({"a": 1}, None, "r.json")
    second = write_result({"a": 2}, None, "r.json")
    assert first.name == "r.json" and second.name == "r-2.json"
    assert first.read_text().strip().endswith("}")
    given = write_result({"a": 3}, str(tmp_path / "r.json"), "unused.json")  # --out too
    assert given.name == "r-3.json" and '"a": 1' in first.read_text()
    (tmp_path / "p.png").write_bytes(b"a plot of another run")  # its JSON gone
    plotted = write_result({"a": 4}, "p.json", "unused.json", (".png",))
    assert plotted.name == "p-2.json"  # whose plot, p-2.png, leaves p.png as it was


def test_busy_time_counts_overlapping_kernels_once():
    from graphcap.bench.prefill import busy_us

    # Two kernels overlapping (a PDL launch waiting on its predecessor), a gap, a third.
    assert busy_us([(0, 10, "a"), (4, 12, "b"), (20, 25, "a")]) == 17
    assert busy_us([(20, 25, "a"), (0, 10, "b"), (2, 3, "c")]) == 15  # order, nesting
    assert busy_us([(0, 5, "a"), (5, 9, "b")]) == 9  # back to back: no gap, no double count
    assert busy_us([]) == 0


def test_prefill_interleaves_every_length_and_arm_in_one_timing(monkeypatch):
    # Lengths are interleaved as arms are: none is timed only in one stretch of the run.
    from graphcap.bench import prefill

    timed = []
    real = prefill.time_interleaved

    def recording(cases, **kwargs):
        timed.append(list(cases))
        return real(cases, timer=lambda fn: (fn(), 1.0)[1], **kwargs)

    monkeypatch.setattr(prefill, "time_interleaved", recording)
    rounds = []
    result = prefill.bench_model("tiny", ["eager", "breakable"], [4, 8], reps=2,
                                 device="cpu", progress=rounds.append)
    assert timed == [[(4, "eager"), (4, "breakable"), (8, "eager"), (8, "breakable")]]
    assert [r["tokens"] for r in result["rows"]] == [4, 8]
    assert result["rows"][1]["ms"] == {"eager": 1.0, "breakable": 1.0}
    assert rounds[-prefill.ROUNDS:] == [f"tiny {i}" for i in range(1, prefill.ROUNDS + 1)]


def test_a_copy_of_the_tree_inside_another_repository_does_not_record_its_head(tmp_path,
                                                                              environ):
    import shutil
    import subprocess

    from graphcap.bench import common

    environ.unset("GRAPHCAP_COMMIT")
    outer = tmp_path / "outer"
    (outer / "copy").mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(outer)], check=True)
    (outer / "README").write_text("another project\n")
    subprocess.run(["git", "-C", str(outer), "add", "README"], check=True)
    subprocess.run(["git", "-C", str(outer), "-c", "user.name=x", "-c", "user.email=x@x",
                    "commit", "-qm", "outer"], check=True)
    shutil.copytree(common.ROOT / "graphcap", outer / "copy" / "graphcap")
    assert common.commit(outer / "copy").startswith("unknown")
    assert common.commit().split("-")[0] == subprocess.run(
        ["git", "-C", str(common.ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
        text=True).stdout.strip()
    environ.set("GRAPHCAP_COMMIT", "abc1234")
    assert common.commit(outer / "copy") == "abc1234"


def test_the_stock_transformers_arms_return_the_last_token_logits_of_one_model():
    pytest.importorskip("transformers")
    from graphcap.bench.hf import HF_ARMS, build_hf_arms, hf_config, stock_model

    lengths = [4, 16]
    arms, skipped = build_hf_arms("tiny-moe", HF_ARMS, lengths, "torch_masked", "cpu",
                                  torch.float32)
    assert set(skipped) == {"hf-compile-reduce-overhead"}  # CUDA graphs: the GPU only
    assert type(hf_config("tiny-moe")).__name__ == "Qwen3MoeConfig"
    assert type(hf_config("llama3-8b")).__name__ == "LlamaConfig"
    reference = stock_model("tiny-moe", "cpu", torch.float32)  # every arm's weights
    inputs = prompts(lengths, 256, "cpu")
    for n in lengths:
        with torch.no_grad():
            want = reference(input_ids=inputs[n][0][None]).logits[0, -1:]
        for name, arm in arms.items():
            torch.testing.assert_close(arm.call(n), want, atol=1e-4, rtol=1e-4,
                                       msg=lambda m, name=name: f"{name}: {m}")
    assert "graphcap kernels in 2/2 attention, 2/2 mlp" in \
        arms["hf-full-graphcap"].detail["kernels"]
    assert "0/" not in arms["hf-full-graphcap"].detail["kernels"]


def test_no_two_arms_of_a_plot_share_a_colour_and_a_marker():
    from graphcap.bench.decode import ARMS
    from graphcap.bench.report import style

    looks = [tuple(style(i).values()) for i in range(max(len(ARMS), 20))]
    assert len(set(looks)) == len(looks)
