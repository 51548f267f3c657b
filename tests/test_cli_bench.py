"""``graphcap bench``: what it refuses before it runs (presets, arms, options its suite does
not take, prompts past a preset's positions, TP sizes, an --out it could not write, no GPU),
and the reps it runs."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from tests.support.cli import refused


@pytest.mark.parametrize("argv, needle", [
    (["prefill", "--models", "qwen9"], "no preset 'qwen9'"),
    (["decode", "--models", "hf:qwen3-0.6b"], "no preset 'hf:qwen3-0.6b'"),
    (["build", "--models", "tiny,qwen3-0.6b"], "one model"),
    (["prefill", "--arms", "eager,fastest"], "no arm 'fastest'"),
    (["memory", "--arms", "tc_piecewise-inductor"], "no arm 'tc_piecewise-inductor'"),
    (["generate", "--arms", "full,eager-ish"], "no arm 'eager-ish'"),
    (["generate", "--lengths", "16"], "bench generate does not take --lengths"),
    (["decode", "--attention", "triton", "--lengths", "8"],
     "bench decode does not take --lengths, --attention: leave them out"),
    (["ops", "--reps", "3"], "bench ops does not take --reps"),
    (["decode", "--speculative", "4", "--arms", "full"], "no arm 'full'"),
    (["decode", "--speculative", "4", "--context", "512"], "leave out --context"),
    (["decode", "--speculative", "4", "--context", "128"], "leave out --context"),
    (["decode", "--speculative", "4", "--max-len", "4096"], "--window and --max-len"),
    (["decode", "--context", "1024", "--max-len", "1024"],
     "--max-len 1024: a request's table holds its context and the step's token (1025 for "
     "--context 1024) and at most qwen3-0.6b's 8192 positions; give a --max-len from 1025 "
     "to 8192"),
    (["decode", "--context", "256,1024", "--max-len", "512"], "from 1025 to 8192"),
    (["decode", "--max-len", "8193"], "from 129 to 8192"),
    (["prefill", "--max-len", "4096"], "bench prefill does not take --max-len"),
    (["ops", "--reps", "30"], "bench ops does not take --reps"),
    (["decode", "--context", "1024,8192"], "qwen3-0.6b has 8192 positions"),
    (["decode", "--models", "tiny", "--context", "4096"], "tiny has 4096 positions"),
    (["prefill", "--speculative", "4"], "bench prefill does not take --speculative"),
    (["memory", "--models", "hf-stock:tiny-gpt-oss"], "no stock transformers model mirrors"),
    (["prefill", "--tp", "2", "--arms", "eager,hf-eager"], "not split across ranks"),
    (["decode", "--arms", "full,breakable,full"], "--arms: 'full' is given twice"),
    (["prefill", "--models", "tiny,qwen3-0.6b,tiny"], "--models: 'tiny' is given twice"),
    (["decode", "--batches", "1,8,1"], "--batches: 1 is given twice"),
    (["prefill", "--lengths", "16,16"], "--lengths: 16 is given twice"),
    (["decode", "--context", "256,0256"], "--context: 256 is given twice"),
    (["prefill", "--models", ":qwen3-0.6b"], "no preset ':qwen3-0.6b'"),
    (["memory", "--models", ":qwen3-0.6b"], "no preset ':qwen3-0.6b'"),
    (["prefill", "--arms", ""], "--arms '' names nothing between its commas"),
    (["decode", "--arms", ","], "--arms ',' names nothing between its commas"),
    (["decode", "--models", "tiny,"], "--models 'tiny,' names nothing between its commas")])
def test_bench_refuses_a_preset_or_arm_its_suite_lacks_before_it_needs_a_gpu(
        capsys, argv, needle):
    err = refused(capsys, "bench", *argv)
    assert err.startswith("graphcap bench: ") and needle in err, err


@pytest.mark.parametrize("given, runs", [(None, 3), (30, 30), (31, 31)])
def test_bench_generate_runs_the_reps_given_and_three_where_none_is(
        monkeypatch, tmp_path, given, runs):
    from graphcap.bench import generate
    from graphcap.bench.suites import run_suite

    seen = []
    monkeypatch.setattr(generate, "run", lambda *a, reps: seen.append(reps) or {"models": []})
    args = argparse.Namespace(suite="generate", speculative=0, models=None, arms=None,
                              reps=given, out=str(tmp_path / "out.json"))
    assert run_suite(args) == 0 and seen == [runs]


def test_bench_without_cuda_says_it_needs_a_gpu(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU" in refused(capsys, "bench", "decode")
    # --window 0 is the default's no window, given: past the parser to the same refusal
    assert "needs a CUDA GPU" in refused(capsys, "bench", "decode", "--window", "0")


def test_bench_split_across_more_gpus_than_there_are_says_how_many(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert "--tp 2: 1 GPU here" in refused(capsys, "bench", "prefill", "--tp", "2")


@pytest.mark.parametrize("argv, needle", [
    (["prefill", "--models", "tiny", "--lengths", "16,8192"],
     "--lengths 8192: tiny has 4096 positions"),
    (["prefill", "--lengths", "16,16384"], "--lengths 16384: qwen3-0.6b has 8192 positions"),
    (["prefill", "--tp", "2", "--models", "tiny-moe", "--lengths", "5000"],
     "--lengths 5000: tiny-moe has 4096 positions"),
    (["generate", "--models", "qwen3-0.6b,tiny"], "tiny has 4096 positions")])
def test_bench_refuses_prompts_past_a_preset_s_positions_before_it_runs(
        capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no GPU, first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    err = refused(capsys, "bench", *argv)
    assert err.startswith("graphcap bench: ") and needle in err, err


@pytest.mark.parametrize("out, needle", [
    ("a_file/result.json", "--out a_file/result.json: a_file is a file, not a directory"),
    ("a_file/more/result.json", "a_file is a file, not a directory"),
    ("a_dir", "--out a_dir is a directory")])
def test_bench_refuses_an_out_it_could_not_write_before_it_runs(
        capsys, monkeypatch, tmp_path, out, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("mine\n")
    (tmp_path / "a_dir").mkdir()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no GPU, first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, "bench", "ops", "--out", out)
    assert err.startswith("graphcap bench: ") and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir", "a_file"]


@pytest.mark.parametrize("suite", ["prefill", "decode"])
def test_bench_refuses_an_out_its_plot_would_write_over(capsys, monkeypatch, tmp_path, suite):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no GPU, first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, "bench", suite, "--out", "run.png")
    assert "--out run.png: " in err and "give run.json" in err, err


@pytest.mark.parametrize("argv, needle", [
    (["--tp", "3"], "--tp 3 --models qwen3-0.6b: tensor parallelism over 3 ranks does not "
                    "divide kv_heads 8"),
    (["--tp", "4", "--models", "tiny"], "--tp 4 --models tiny: "),
    (["--tp", "2", "--models", "gpt-oss-20b-mxfp4"], "does not split MXFP4 experts")])
def test_bench_refuses_a_tp_size_a_preset_does_not_split_into_before_it_runs(
        capsys, monkeypatch, argv, needle):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no GPU, first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    err = refused(capsys, "bench", "prefill", *argv)
    assert err.startswith("graphcap bench: ") and needle in err, err


def test_bench_without_out_refuses_a_working_directory_it_may_not_write_into(
        capsys, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # else: no GPU, first
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    access = os.access  # root may write anywhere: the directory as another user sees it
    monkeypatch.setattr(os, "access", lambda p, mode: os.path.abspath(p) != str(tmp_path)
                        and access(p, mode))
    err = refused(capsys, "bench", "ops")
    assert f"may not write into the working directory {tmp_path}" in err, err
    assert "give --out a path" in err
