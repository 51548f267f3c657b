"""The graphcap command line: ``ops`` and ``demo``, ``--version`` and ``--help``, counts the
parser refuses, errors told in one line (exit status 2) or raised where they are graphcap's
own, and a reader that stops early. ``check`` and ``bench`` have files of their own."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import graphcap
from graphcap.cli import main
from tests.support.cli import cli, refused

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "graphcap", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ops_lists_every_op_with_backends_fake_and_tags_as_json(capsys):
    code, out, err = cli(capsys, "ops", "--json", "--device", "cpu")
    assert code == 0, err
    ops = {row["op"]: row for row in json.loads(out)["ops"]}
    assert {"graphcap::rms_norm", "graphcap::silu_and_mul", "graphcap::rotary_embedding",
            "graphcap::fused_add_rms_norm", "graphcap::moe_topk_softmax",
            "graphcap::moe_experts"} <= set(ops)
    norm = ops["graphcap::rms_norm"]
    assert norm["kernels"]["torch"] == "available"
    assert norm["kernels"]["flashinfer"] != "available"  # says why instead
    assert norm["fake"] == "derived" and ops["graphcap::moe_experts"]["fake"] == "given"
    assert norm["capturable"] is True and norm["split"] is False


def test_demo_replays_match_eager_and_print_a_table(capsys):
    code, out, err = cli(capsys, "demo", "--device", "cpu", "--steps", "2")
    assert code == 0, err
    assert "replay matches eager" in out and "max |replay - eager|" in out


@pytest.mark.parametrize("argv", [
    ["check", "m:f", "--max-requests", "0"], ["check", "m:f", "--max-tokens", "-4"],
    ["check", "m:f", "--examples", "0"], ["check", "m:f", "--sequences", "ten"],
    ["demo", "--steps", "0"], ["bench", "prefill", "--reps", "0"],
    ["bench", "decode", "--context", "0"], ["bench", "prefill", "--tp", "0"],
    ["bench", "prefill", "--lengths", "16,x"], ["bench", "decode", "--batches", "1,0"]])
def test_counts_that_are_not_positive_whole_numbers_are_refused_by_the_parser(capsys, argv):
    err = refused(capsys, *argv)
    assert err.startswith(f"graphcap {argv[0]}: argument {argv[-2]}") and "--help" in err


def test_demo_on_cuda_where_torch_sees_no_gpu_says_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, "demo", "--device", "cuda")
    assert err.startswith("graphcap demo: --device cuda") and "--device cpu" in err


def test_ops_on_cuda_where_torch_sees_no_gpu_says_what_to_do(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    err = refused(capsys, "ops", "--device", "cuda")
    assert err.startswith("graphcap ops: --device cuda") and "--device cpu" in err


def test_ops_refuses_a_gpu_index_this_machine_lacks(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    err = refused(capsys, "ops", "--device", "cuda:7")
    assert err.startswith("graphcap ops: --device cuda:7, but this machine has 1 CUDA GPU")


def test_ops_names_a_device_torch_does_not_know(capsys):
    err = refused(capsys, "ops", "--device", "tpu")
    assert "argument --device: 'tpu' is no torch device" in err


@pytest.mark.slow
def test_version_names_the_package_and_torch_without_a_command():
    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    try:
        ours = importlib.metadata.version("torch-graphcap")
    except importlib.metadata.PackageNotFoundError:  # run from the tree
        ours = graphcap.__version__
    assert proc.stdout.startswith(f"graphcap {ours}")
    assert proc.stdout.rstrip().endswith(f", torch {torch.__version__}")


def test_version_falls_back_to_the_source_tree_when_the_package_is_not_installed(
        capsys, monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    code, out, _ = cli(capsys, "--version")
    assert code == 0 and out.startswith(f"graphcap {graphcap.__version__} (source tree")


@pytest.mark.slow
def test_an_error_is_one_line_and_exit_2_in_a_real_process(tmp_path):
    (tmp_path / "user_factory.py").write_text("def build():\n    raise KeyError('gone')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get(
        "PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "graphcap", "check", "user_factory:build"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr
    assert proc.stderr.splitlines() == [proc.stderr.strip()] and "KeyError: 'gone'" in proc.stderr


def test_an_unexpected_error_inside_graphcap_keeps_its_traceback_and_exits_3(capsys,
                                                                            monkeypatch):
    # 1 is a check that ran and failed: a crash must not read as one.
    import graphcap.check

    def bug(model):
        raise RuntimeError("a bug in graphcap")

    monkeypatch.setattr(graphcap.check, "checkable", bug)
    assert main(["check", "tests.support.check_models:good"]) == 3
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in bug" in err, err
    assert err.rstrip().endswith("an unexpected error inside graphcap (its traceback is "
                                 "above): exit status 3"), err


def test_every_command_s_help_shows_its_defaults_and_choices(capsys):
    for command, needles in {"check": ["(default: 10)", "{breakable,full,tc_piecewise}",
                                       "torch_masked"],
                             "bench": ["default 30,",
                                       "{ops,prefill,decode,generate,build,memory}"],
                             "demo": ["(default: 5)", "{cuda,cpu}"],
                             "ops": ["--json"],
                             "generate": ["(default: full)", "(default: 1.0)",
                                          "(default: 64)"]}.items():
        code, out, err = cli(capsys, command, "--help")
        assert code == 0, err
        for needle in needles:
            assert needle in out, (command, needle, out)


def test_ops_lists_the_attention_backends_and_where_each_runs(capsys):
    _, out, _ = cli(capsys, "ops", "--json", "--device", "cpu")
    rows = {(row["kind"], row["backend"]): row for row in json.loads(out)["attention"]}
    prefill = {name: row for (kind, name), row in rows.items() if kind == "prefill"}
    assert prefill["torch_masked"]["available"] and prefill["torch_masked"]["static_metadata"]
    assert not prefill["torch_varlen"]["static_metadata"]
    assert not prefill["flash_attn"]["available"] and "cuda" in prefill["flash_attn"]["why_not"]
    # which backend computes which per-layer option
    assert prefill["triton"]["options"] == ["window", "softcap", "sinks"]
    assert prefill["flash_attn"]["options"] == ["window", "softcap", "sinks"]  # FA4's
    assert rows["decode", "graphcap"]["options"] == ["window", "softcap", "sinks"]


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_the_command_quietly():
    # graphcap ops | head -1: the pipe closes before the listing is written
    proc = subprocess.Popen([sys.executable, "-m", "graphcap.cli", "ops"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


@pytest.mark.parametrize(("flag", "value"), [("--temperature", "-1"), ("--top-p", "2")])
def test_generate_names_the_sampling_flag_whose_value_is_refused(capsys, tmp_path, flag,
                                                                  value):
    message = refused(capsys, "generate", str(tmp_path), "--prompt", "hi", flag, value)
    assert f"{flag} must be" in message and "Sampling." not in message
