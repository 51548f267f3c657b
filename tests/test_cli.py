"""The graphcap command line."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import graphcap
from graphcap.api import GRAPHED
from graphcap.cli import main

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


def test_check_passes_a_good_model_with_a_table_row_per_strategy(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:good", "--examples", "3",
                         "--sequences", "1")
    assert code == 0, out + err
    for strategy in GRAPHED:
        assert any(line.split()[:3] == [strategy, "torch_masked", "pass"]
                   for line in out.splitlines()), out


def test_check_flags_a_python_side_effect_that_capture_freezes(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:counting", "--examples", "3",
                         "--sequences", "1", "--strategies", "full")
    assert code == 1, out + err
    assert "FAIL" in out and "frozen" in out


def test_check_compares_every_strategy_with_the_model_from_before_any_capture(capsys):
    # Each strategy's check against a copy taken before the first capture: one taken
    # after the first strategy's captures had the warm-up's scale, and the later
    # strategies passed the defect the first failed.
    code, out, err = cli(capsys, "check", "tests.support.check_models:calibrated",
                         "--examples", "2", "--sequences", "1", "--max-tokens", "16",
                         "--max-requests", "1", "--strategies", "full", "breakable")
    assert code == 1, out + err
    rows = [line.split() for line in out.splitlines()]
    assert [r[2] for r in rows if r[:1] in (["full"], ["breakable"])] == ["FAIL", "FAIL"]


def test_check_says_replays_differ_where_they_differ_in_several_ways(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:cycling",
                         "--examples", "5", "--sequences", "2", "--strategies", "full",
                         "breakable")
    assert code == 1, out + err
    assert "Replays differ from eager" in out and "ExceptionGroup" not in out, out


def test_check_of_a_model_without_attention_packs_requests_and_says_what_to_do(capsys):
    # The fullest batch: four requests in one call, which a model that runs no graphcap
    # attention cannot tell apart (one request drawn passes).
    code, out, err = cli(capsys, "check", "tests.support.check_models:sdpa",
                         "--examples", "1", "--sequences", "1", "--strategies", "full")
    assert code == 1, out + err
    assert "ran no graphcap attention" in out and "--max-requests 1" in out, out


def test_check_takes_code_in_a_directory_named_like_graphcap_for_the_models():
    # graphcap_user/ beside the package is the user's: its error is the model's, not ours.
    from graphcap import check

    namespace = {}
    exec(compile("def forward():\n    raise ValueError('a bug')\n",
                 check._PACKAGE + "_user/model.py", "exec"), namespace)
    with pytest.raises(ValueError) as info:
        namespace["forward"]()
    assert check._from_the_model(info.value)


def cli(capsys, *argv):
    """``graphcap ARGV`` in this process: its exit status, stdout and stderr."""
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's exits: --help, --version, a refused argument
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def refused(capsys, *argv) -> str:
    """The one line ``graphcap ARGV`` writes to stderr, having exited 2."""
    code, _, err = cli(capsys, *argv)
    assert code == 2 and len(err.strip().splitlines()) == 1, (code, err)
    return err


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """Writes a module of the user's in the working directory, where ``check`` finds it."""
    monkeypatch.chdir(tmp_path)
    names = []

    def write(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()  # the finder of "." may have listed it before
        names.append(name)
        return name

    yield write
    for name in names:
        sys.modules.pop(name, None)


def test_check_without_hypothesis_says_to_install_it_not_a_traceback(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "hypothesis", None)  # as if not installed
    err = refused(capsys, "check", "tests.support.check_models:good")
    assert "hypothesis, which is not installed" in err


def test_check_names_a_factory_it_cannot_import(capsys):
    assert "cannot import 'no_such_module'" in refused(capsys, "check", "no_such_module:build")


def test_check_names_a_factory_that_raises_and_where(capsys, user_module):
    user_module("raising_factory", """
        def build():
            raise ValueError("no weights here")
    """)
    err = refused(capsys, "check", "raising_factory:build")
    assert err.startswith("graphcap check: the factory 'raising_factory:build' raised "
                          "ValueError: no weights here"), err
    assert "raising_factory.py:3" in err


@pytest.mark.parametrize("failure", ["raise RuntimeError('no GPU config')", "raise SystemExit(3)"])
def test_check_names_a_module_that_fails_on_import(capsys, user_module, failure):
    user_module("broken_module", f"""
        {failure}
        def build():
            pass
    """)
    err = refused(capsys, "check", "broken_module:build")
    assert err.startswith("graphcap check: importing 'broken_module'"), err
    assert ("RuntimeError: no GPU config" if "Runtime" in failure else "exited") in err


def test_a_factory_that_exits_is_an_error_not_a_check_that_passed(capsys, user_module):
    user_module("exiting_factory", """
        import sys
        def build():
            sys.exit(0)
    """)
    err = refused(capsys, "check", "exiting_factory:build")
    assert "'exiting_factory:build' exited" in err and "nothing was checked" in err


def test_check_refuses_a_factory_that_needs_arguments_naming_them(capsys, user_module):
    user_module("argument_factory", """
        def build(width, depth=2, *, dtype):
            raise AssertionError("never called")
    """)
    err = refused(capsys, "check", "argument_factory:build")
    assert "takes arguments ['width', 'dtype']" in err and "no arguments" in err


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
    (["decode", "--context", "256,0256"], "--context: 256 is given twice")])
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


def test_an_unexpected_error_inside_graphcap_is_raised_not_hidden(capsys, monkeypatch):
    import graphcap.check

    def bug(model):
        raise RuntimeError("a bug in graphcap")

    monkeypatch.setattr(graphcap.check, "checkable", bug)
    with pytest.raises(RuntimeError, match="a bug in graphcap"):
        main(["check", "tests.support.check_models:good"])


def test_check_fails_a_model_whose_attention_cannot_see_the_packed_requests(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:sdpa", "--examples", "3",
                         "--sequences", "1", "--strategies", "breakable")
    assert code == 1, out + err
    assert "ran no graphcap attention" in out and "Bring your own model" in out


def test_every_command_s_help_shows_its_defaults_and_choices(capsys):
    for command, needles in {"check": ["(default: 10)", "{breakable,full,tc_piecewise}",
                                       "torch_masked"],
                             "bench": ["default 30,",
                                       "{ops,prefill,decode,generate,build,memory}"],
                             "demo": ["(default: 5)", "{cuda,cpu}"],
                             "ops": ["--json"]}.items():
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


def test_check_passes_stock_models_with_windows_soft_capping_and_sinks(capsys):
    for factory in ("hf_gemma2", "hf_gemma3", "hf_cohere2", "hf_olmo3", "hf_gpt_oss",
                    "hf_mistral_windowed"):
        code, out, err = cli(capsys, "check", f"tests.support.check_models:{factory}",
                             "--examples", "2", "--sequences", "1", "--strategies", "full")
        assert code == 0, factory + out + err
        assert out.count(" pass ") == 1, out


def test_check_wraps_a_stock_transformers_causal_lm_itself_and_says_so(capsys):
    for factory in ("hf_llama", "hf_stablelm", "hf_starcoder2"):
        code, out, err = cli(capsys, "check", f"tests.support.check_models:{factory}", "--examples",
                             "2", "--sequences", "1", "--strategies", "breakable", "full")
        assert code == 0, out + err
        assert "wrapped in graphcap.hf.PrefillLM; graphcap kernels in" in out
        assert out.count(" pass ") == 2, out


def test_check_names_the_signature_it_expects_of_a_model_it_cannot_run(capsys):
    err = refused(capsys, "check", "tests.support.check_models:two_tensors")
    assert "forward('x', 'scale') is no model of packed requests" in err


@pytest.mark.slow
def test_a_reader_that_stops_early_ends_the_command_quietly():
    # graphcap ops | head -1: the pipe closes before the listing is written
    proc = subprocess.Popen([sys.executable, "-m", "graphcap.cli", "ops"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT)
    proc.stdout.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read() == b""


def test_check_names_an_attention_backend_this_machine_cannot_run_once(capsys):
    if torch.cuda.is_available():
        pytest.skip("flash_attn may run here")
    message = refused(capsys, "check", "tests.support.check_models:good", "--attention",
                      "flash_attn")
    assert "--attention flash_attn: attention backend 'flash_attn' runs on cuda" in message
    assert "choose one of" in message and "torch_masked" in message


def test_check_refuses_a_backend_a_strategy_cannot_run_before_running_any(capsys):
    message = refused(capsys, "check", "tests.support.check_models:good", "--attention",
                      "torch_varlen", "--strategies", "breakable", "full")
    assert "--attention torch_varlen with strategy full: attention backend 'torch_varlen' " \
        "cannot run under strategy 'full'" in message


def test_check_names_a_model_whose_forward_raises_and_where(capsys, user_module):
    user_module("raising_model", """
        import torch

        class Raising(torch.nn.Module):
            graphcap_inputs = "prefill"

            def __init__(self):
                super().__init__()
                self.embed = torch.nn.Embedding(256, 8)

            def forward(self, input_ids, positions):
                raise KeyError("no such layer")

        def build():
            return Raising()
    """)
    code, out, err = cli(capsys, "check", "raising_model:build", "--strategies", "full",
                         "--examples", "1", "--sequences", "1")
    assert code == 1 and "Traceback" not in out + err, out + err
    assert any(line.split()[:3] == ["full", "-", "FAIL"] for line in out.splitlines()), out
    assert "full: Raising's forward raised KeyError: 'no such layer' at " in out, out
    assert "raising_model.py:12" in out, out


def test_check_without_strategies_checks_those_the_backend_runs_under(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:good", "--attention",
                         "torch_varlen", "--examples", "2", "--sequences", "1")
    assert code == 0, out + err
    assert "--attention torch_varlen runs under breakable, tc_piecewise only: full left out" \
        in out
    rows = [line.split()[:3] for line in out.splitlines()]
    assert ["breakable", "torch_varlen", "pass"] in rows and \
        not any(r[:1] == ["full"] for r in rows)


def test_check_refuses_a_model_on_the_meta_device_before_running_any_strategy(
        capsys, user_module):
    # It has no values to run: every strategy used to FAIL (exit 1) on "no attention
    # backend runs on meta", as if a check had run.
    user_module("meta_factory", """
        import torch
        from graphcap.models import build_model

        def build():
            return build_model("tiny").to("meta")
    """)
    err = refused(capsys, "check", "meta_factory:build")
    assert "on the meta device" in err and "load or initialise its weights" in err, err


def test_check_says_the_device_and_the_graphs_it_checks_on(capsys):
    # A CPU model on a GPU machine is checked on the emulator: the header says so.
    code, out, err = cli(capsys, "check", "tests.support.check_models:good", "--examples", "1",
                         "--sequences", "1", "--strategies", "full")
    assert code == 0, out + err
    assert out.splitlines()[0].startswith(
        "graphcap check tests.support.check_models:good: Decoder on cpu (emulated graphs), "), out


def test_check_of_a_model_left_in_training_mode_says_to_call_eval(capsys, user_module):
    # Dropout differs eager from eager (a fallback's call too): the frozen-at-capture
    # advice alone sent the user looking for a side effect that is not there.
    user_module("dropout_factory", """
        import torch

        class Dropping(torch.nn.Module):
            graphcap_inputs = "prefill"
            vocab_size = 50

            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(50, 8)
                self.drop = torch.nn.Dropout(0.5)

            def forward(self, input_ids, positions):
                return self.drop(self.emb(input_ids))

        def build():
            return Dropping()
    """)
    code, out, err = cli(capsys, "check", "dropout_factory:build", "--strategies", "full",
                         "--examples", "1", "--sequences", "1", "--max-requests", "1")
    assert code == 1, out + err
    assert "nondeterministic" in out and "Its dropout drop is in training mode" in out, out
    assert "model.eval()" in out, out


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


def test_check_names_a_model_given_where_a_factory_is_expected(capsys, user_module):
    user_module("model_instance", """
        import torch
        model = torch.nn.Linear(4, 4)
    """)
    err = refused(capsys, "check", "model_instance:model")
    assert err.startswith("graphcap check: 'model_instance:model' is a Linear (a model), not "
                          "a function that returns one"), err
    assert "def" in err and "raised" not in err


@pytest.mark.parametrize("spec, name", [
    ("path_factory.py:build", "path_factory:build"), ("./path_factory.py:build",
                                                      "path_factory:build"),
    ("sub/path_factory.py:build", "sub.path_factory:build"),
    ("./path_factory:build", "path_factory:build")])
def test_check_names_the_module_to_give_for_a_file_s_path(capsys, user_module, spec, name):
    err = refused(capsys, "check", spec)
    module = spec.partition(":")[0]
    assert err.startswith(f"graphcap check: {module!r} is a file's path, not a module's "
                          f"name: give {name}"), err


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


def test_a_factory_after_check_strategies_is_named_as_the_factory(capsys):
    """--strategies takes every word after it: a factory given there is told as such."""
    message = refused(capsys, "check", "--strategies", "full",
                      "tests.support.check_models:good")
    assert "'tests.support.check_models:good' is the factory, not a strategy: give it " \
        "before --strategies" in message


@pytest.mark.parametrize(("flag", "value"), [("--temperature", "-1"), ("--top-p", "2")])
def test_generate_names_the_sampling_flag_whose_value_is_refused(capsys, tmp_path, flag,
                                                                  value):
    message = refused(capsys, "generate", str(tmp_path), "--prompt", "hi", flag, value)
    assert f"{flag} must be" in message and "Sampling." not in message
