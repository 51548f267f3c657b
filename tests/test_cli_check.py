"""``graphcap check FACTORY``: a table row per strategy, the defects it finds told in words
(frozen side effects, attention that cannot see the packed requests, dropout in training
mode, a forward that raises), stock transformers models wrapped, and factories, modules,
backends and strategies it cannot check refused in one line."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest
import torch

from graphcap.api import GRAPHED
from tests.support.cli import cli, refused


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


def test_check_fails_a_model_whose_attention_cannot_see_the_packed_requests(capsys):
    code, out, err = cli(capsys, "check", "tests.support.check_models:sdpa", "--examples", "3",
                         "--sequences", "1", "--strategies", "breakable")
    assert code == 1, out + err
    assert "ran no graphcap attention" in out and "Bring your own model" in out


def test_check_passes_stock_models_with_windows_soft_capping_and_sinks(capsys):
    for factory in ("hf_gemma2", "hf_gemma3", "hf_cohere2", "hf_olmo3", "hf_gpt_oss",
                    "hf_mistral_windowed"):
        # Buckets to 32 tokens: its fullest batches hold requests past the 8-token windows.
        code, out, err = cli(capsys, "check", f"tests.support.check_models:{factory}",
                             "--examples", "2", "--sequences", "1", "--max-tokens", "32",
                             "--strategies", "full")
        assert code == 0, factory + out + err
        assert out.count(" pass ") == 1, out


def test_check_wraps_a_stock_transformers_causal_lm_itself_and_says_so(capsys):
    for factory in ("hf_llama", "hf_stablelm", "hf_starcoder2"):
        code, out, err = cli(capsys, "check", f"tests.support.check_models:{factory}", "--examples",
                             "2", "--sequences", "1", "--max-tokens", "16", "--strategies",
                             "breakable", "full")
        assert code == 0, out + err
        assert "wrapped in graphcap.hf.PrefillLM; graphcap kernels in" in out
        assert out.count(" pass ") == 2, out


def test_check_names_the_signature_it_expects_of_a_model_it_cannot_run(capsys):
    err = refused(capsys, "check", "tests.support.check_models:two_tensors")
    assert "forward('x', 'scale') is no model of packed requests" in err


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


def test_a_factory_after_check_strategies_is_named_as_the_factory(capsys):
    """--strategies takes every word after it: a factory given there is told as such."""
    message = refused(capsys, "check", "--strategies", "full",
                      "tests.support.check_models:good")
    assert "'tests.support.check_models:good' is the factory, not a strategy: give it " \
        "before --strategies" in message


def test_check_refuses_a_strategy_given_twice_before_it_builds_the_model(capsys):
    message = refused(capsys, "check", "tests.support.check_models:good", "--strategies",
                      "full", "breakable", "full")
    assert message.startswith("graphcap check: --strategies: full is given twice"), message


@pytest.mark.parametrize("returns, told", [
    ("Tagger(), 'tokenizer'", "a tuple holding a Tagger, not a torch.nn.Module: return the "
                              "Tagger alone"),
    ("{'model': Tagger()}", "a dict holding a Tagger, not a torch.nn.Module: return the "
                            "Tagger alone"),
    ("None", "None, not a torch.nn.Module: end it with return model"),
    ("3", "an int, not a torch.nn.Module: return the model")])
def test_a_factory_that_returns_no_model_is_told_what_to_return(capsys, user_module, returns,
                                                                 told):
    name = user_module("returns_no_model", f"""
        import torch

        class Tagger(torch.nn.Module):
            pass

        def build():
            return {returns}
        """)
    message = refused(capsys, "check", f"{name}:build")
    assert message.strip() == f"graphcap check: the factory returned {told}", message


# A misdeclared attribute is refused once, naming it, not failed under every strategy as
# if the replays differed, nor raised as a traceback.
@pytest.mark.parametrize("declared, told", [
    ('graphcap_inputs = "prefil"', "Tagger.graphcap_inputs is 'prefil': a model takes "
                                   "'prefill'"),
    ('graphcap_inputs = "prefill"\n            output_rows = "request"',
     "Tagger.output_rows is 'request': use 'tokens'")])
def test_a_model_whose_graphcap_attributes_name_nothing_is_refused_naming_the_attribute(
        capsys, user_module, declared, told):
    name = user_module("misdeclared", f"""
        import torch

        class Tagger(torch.nn.Module):
            {declared}

            def forward(self, input_ids, positions):
                return input_ids

        def build():
            return Tagger()
        """)
    message = refused(capsys, "check", f"{name}:build")
    assert message.startswith(f"graphcap check: {told}"), message


def test_check_draws_no_request_past_the_model_s_positions(capsys):
    # 64-token buckets, and batches past them of 128 tokens in 4 requests: requests of
    # more than 40 tokens read past the rotary table (an IndexError's traceback).
    code, out, err = cli(capsys, "check", "tests.support.check_models:short_positions",
                         "--examples", "3", "--sequences", "1", "--strategies", "full")
    assert code == 0, out + err


def test_check_refuses_buckets_only_requests_past_the_model_s_positions_fill(capsys):
    message = refused(capsys, "check", "tests.support.check_models:short_positions",
                      "--max-requests", "1")
    assert message.strip() == (
        "graphcap check: --max-tokens 64 is filled only by requests longer than Decoder's "
        "max_position 40 with --max-requests 1: give --max-requests of at least 2, or "
        "--max-tokens of at most 40"), message


def test_check_refuses_a_max_tokens_past_the_ladder_in_one_line(capsys):
    message = refused(capsys, "check", "tests.support.check_models:good", "--max-tokens",
                      "600000")
    assert message.startswith("graphcap check: --max-tokens=600000 would capture") and \
        message.strip().endswith("give a smaller --max-tokens"), message
