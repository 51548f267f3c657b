"""The graphcap command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from graphcap.api import GRAPHED

ROOT = Path(__file__).resolve().parent.parent


def run(*args):
    return subprocess.run([sys.executable, "-m", "graphcap", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_ops_lists_every_op_with_backends_fake_and_tags_as_json():
    proc = run("ops", "--json", "--device", "cpu")
    assert proc.returncode == 0, proc.stderr
    ops = {row["op"]: row for row in json.loads(proc.stdout)["ops"]}
    assert {"graphcap::rms_norm", "graphcap::silu_and_mul", "graphcap::rotary_embedding",
            "graphcap::fused_add_rms_norm", "graphcap::moe_topk_softmax",
            "graphcap::moe_experts"} <= set(ops)
    norm = ops["graphcap::rms_norm"]
    assert norm["kernels"]["torch"] == "available"
    assert norm["kernels"]["flashinfer"] != "available"  # says why instead
    assert norm["fake"] == "derived" and ops["graphcap::moe_experts"]["fake"] == "given"
    assert norm["capturable"] is True and norm["split"] is False


def test_demo_replays_match_eager_and_print_a_table():
    proc = run("demo", "--device", "cpu", "--steps", "2")
    assert proc.returncode == 0, proc.stderr
    assert "replay matches eager" in proc.stdout and "max |replay - eager|" in proc.stdout


def test_check_passes_a_good_model_with_a_table_row_per_strategy():
    proc = run("check", "tests.check_models:good", "--examples", "3", "--sequences", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for strategy in GRAPHED:
        assert any(line.split()[:3] == [strategy, "torch_masked", "pass"]
                   for line in proc.stdout.splitlines()), proc.stdout


def test_check_flags_a_python_side_effect_that_capture_freezes():
    proc = run("check", "tests.check_models:counting", "--examples", "3", "--sequences",
               "1", "--strategies", "full")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAIL" in proc.stdout and "frozen" in proc.stdout


def test_check_names_a_factory_it_cannot_import():
    proc = run("check", "no_such_module:build")
    assert proc.returncode == 2 and "cannot import 'no_such_module'" in proc.stderr


def test_check_fails_a_model_whose_attention_cannot_see_the_packed_requests():
    proc = run("check", "tests.check_models:sdpa", "--examples", "3", "--sequences", "1",
               "--strategies", "breakable")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "ran no graphcap attention" in proc.stdout and "Bring your own model" in proc.stdout


def test_every_command_s_help_shows_its_defaults_and_choices():
    for command, needles in {"check": ["(default: 10)", "{breakable,full,tc_piecewise}",
                                       "torch_masked"],
                             "bench": ["(default: 30)", "{ops,prefill,decode,build,memory}"],
                             "demo": ["(default: 5)", "{cuda,cpu}"],
                             "ops": ["--json"]}.items():
        proc = run(command, "--help")
        assert proc.returncode == 0, proc.stderr
        for needle in needles:
            assert needle in proc.stdout, (command, needle, proc.stdout)


def test_ops_lists_the_attention_backends_and_where_each_runs():
    proc = run("ops", "--json", "--device", "cpu")
    rows = {row["backend"]: row for row in json.loads(proc.stdout)["attention"]}
    assert rows["torch_masked"]["available"] and rows["torch_masked"]["static_metadata"]
    assert not rows["torch_varlen"]["static_metadata"]
    assert not rows["flash_attn"]["available"] and "cuda" in rows["flash_attn"]["why_not"]


def test_check_wraps_a_stock_transformers_causal_lm_itself_and_says_so():
    for factory in ("hf_llama", "hf_stablelm", "hf_starcoder2"):
        proc = run("check", f"tests.check_models:{factory}", "--examples", "2",
                   "--sequences", "1", "--strategies", "breakable", "full")
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "wrapped in graphcap.hf.PrefillLM; graphcap kernels in" in proc.stdout
        assert proc.stdout.count(" pass ") == 2, proc.stdout


def test_check_names_the_signature_it_expects_of_a_model_it_cannot_run():
    proc = run("check", "tests.check_models:two_tensors")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "forward('x', 'scale') is no model of packed requests" in proc.stderr
    assert "Traceback" not in proc.stderr
