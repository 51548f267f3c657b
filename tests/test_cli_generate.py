"""``graphcap generate DIR --prompt ...``: text from a local checkpoint directory (a tiny
stock model and a byte tokenizer saved here, nothing downloaded) on ``graphcap.LLM``,
streamed for one prompt, one line each for several, equal to the library's text; bad
input told in one line, exit status 2."""

from __future__ import annotations

import pytest

import graphcap
from graphcap.cli import main

transformers = pytest.importorskip("transformers")
from tests.support.hf_families import hf_model  # noqa: E402  (needs transformers)
from tests.support.tokenizers import byte_tokenizer  # noqa: E402

OPTIONS = ["--max-batch", "2", "--max-len", "40", "--prefill-tokens", "16"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model("llama").save_pretrained(path)
    byte_tokenizer(128).save_pretrained(path)
    return path


def test_one_prompt_streams_the_text_the_library_gives(checkpoint, capsys):
    assert main(["generate", str(checkpoint), "--prompt", "hello", "--max-new-tokens", "6",
                 *OPTIONS]) == 0
    llm = graphcap.LLM(str(checkpoint), max_batch=2, max_len=40, prefill_tokens=16,
                       progress=False)
    want = llm.generate(["hello"], 6)[0].text
    assert capsys.readouterr().out == want + "\n"


def test_several_prompts_give_a_line_each_and_sampling_options_are_taken(checkpoint, capsys):
    args = ["generate", str(checkpoint), "--prompt", "ab", "--prompt", "c",
            "--max-new-tokens", "4", "--temperature", "0.8", "--top-k", "5", "--seed", "7",
            "--strategy", "breakable", *OPTIONS]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert first.startswith("[0] ") and "\n[1] " in first
    assert main(args) == 0 and capsys.readouterr().out == first  # seeded


@pytest.mark.parametrize(("args", "message"), [
    (["/nonexistent/dir", "--prompt", "x"], "not a directory"),
    (["CHECKPOINT", "--prompt", "x" * 50, *OPTIONS], "passes this LLM's --max-len 40"),
    (["CHECKPOINT", "--prompt", "x", "--max-len", "100000"], "with --max-len at most 256"),
    (["CHECKPOINT", "--prompt", "x", "--top-p", "0"], "--top-p must be"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_status_2(checkpoint, capsys, args,
                                                          message):
    args = [str(checkpoint) if a == "CHECKPOINT" else a for a in args]
    assert main(["generate", *args]) == 2
    last = capsys.readouterr().err.splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("graphcap generate: ") and message in last


def test_a_cache_past_the_device_s_memory_is_told_in_generate_s_flags(checkpoint, capsys,
                                                                     monkeypatch):
    from graphcap.engine import engine
    from graphcap.errors import CacheTooLarge

    def too_large(*args, **kwargs):
        raise CacheTooLarge("too large", need=2**40, free=2**30, pages=64)

    monkeypatch.setattr(engine, "PagedKVCache", too_large)
    assert main(["generate", str(checkpoint), "--prompt", "x", *OPTIONS]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith("graphcap generate: graphcap.LLM: 2 requests (--max-batch) of 40 "
                           "tokens (--max-len)") and "smaller --max-len or --max-batch" in last


def test_a_directory_without_config_json_is_named_as_no_checkpoint(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"graphcap generate: LLM({str(tmp_path)!r}): the directory has no config.json; give "
        "a local Hugging Face checkpoint directory (config.json, safetensors, tokenizer "
        "files)")


def test_a_checkpoint_without_tokenizer_files_has_no_tokenizer(tmp_path, capsys):
    # transformers 5 builds a Qwen3 config's tokenizer from nothing (an empty vocabulary
    # whose eos id 0 would end every request drawing token 0): token ids only here.
    hf_model("qwen3").save_pretrained(tmp_path)
    llm = graphcap.LLM(str(tmp_path), max_batch=1, max_len=40, prefill_tokens=16,
                       progress=False)
    assert llm.tokenizer is None and llm.eos == set()
    assert main(["generate", str(tmp_path), "--prompt", "x", *OPTIONS]) == 2
    assert "has no tokenizer files" in capsys.readouterr().err.splitlines()[-1]


def test_a_checkpoint_with_only_mistrals_tekken_file_has_its_tokenizer(tmp_path):
    # transformers 5 converts a tekken.json (a Mistral checkpoint's only tokenizer file)
    import base64
    import json

    hf_model("mistral").save_pretrained(tmp_path)
    vocab = [{"rank": i, "token_bytes": base64.b64encode(bytes([i])).decode(),
              "token_str": None} for i in range(256)]
    specials = [{"rank": i, "token_str": s, "is_control": True}
                for i, s in enumerate(["<unk>", "<s>", "</s>"])]
    (tmp_path / "tekken.json").write_text(json.dumps({
        "config": {"pattern": r"\s+|\S+", "num_vocab_tokens": 256, "default_vocab_size": 259,
                   "default_num_special_tokens": 3, "version": "v7"},
        "vocab": vocab, "special_tokens": specials}))
    llm = graphcap.LLM(str(tmp_path), max_batch=1, max_len=40, prefill_tokens=16,
                       progress=False)
    assert llm.tokenizer is not None and llm.tokenizer("ab").input_ids[-2:] == [100, 101]


@pytest.mark.parametrize(("family", "cls"), [("gemma", "GemmaTokenizer"),
                                             ("qwen3", "Qwen2Tokenizer"),
                                             ("llama", "PreTrainedTokenizerFast")])
def test_a_checkpoint_with_tokenizer_config_alone_has_no_tokenizer_and_says_so(
        tmp_path, family, cls):
    # transformers 5 builds Gemma's and Qwen2's tokenizers from the config alone: no
    # vocabulary ("hello" was Gemma's unknown id, its text always empty; Qwen2's no ids)
    import json

    hf_model(family).save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": cls}))
    with pytest.warns(UserWarning, match=r"holds tokenizer_config\.json but no file a "
                      r"tokenizer's vocabulary is read from \(tokenizer\.json, "
                      r"tokenizer\.model, .*tekken\.json.*\): the LLM has no tokenizer"):
        llm = graphcap.LLM(str(tmp_path), max_batch=1, max_len=40, prefill_tokens=16,
                           progress=False)
    assert llm.tokenizer is None


def test_a_checkpoint_whose_tokenizer_reads_no_vocabulary_file_has_its_tokenizer(tmp_path):
    # ByT5's tokenizer is bytes: tokenizer_config.json is all it saves
    hf_model("llama").save_pretrained(tmp_path)
    transformers.ByT5Tokenizer().save_pretrained(tmp_path)
    llm = graphcap.LLM(str(tmp_path), max_batch=1, max_len=40, prefill_tokens=16,
                       progress=False)
    assert isinstance(llm.tokenizer, transformers.ByT5Tokenizer)


@pytest.mark.parametrize("content", ["{not json", "{}", '{"added_tokens": [], "model": '
                                     '{"type": "BPE", "vocab": 5}}'])
def test_a_checkpoint_whose_tokenizer_fails_to_load_says_why(tmp_path, content):
    # a vocabulary file transformers cannot read: token ids only, and a warning naming
    # transformers' error (not a silent LLM without its tokenizer); JSON of another shape
    # too, whose KeyError or TypeError (from transformers or tokenizers) failed the build
    hf_model("qwen3").save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.warns(UserWarning, match=r"its tokenizer did not load \(.*Error: .*\): the "
                      r"LLM has no tokenizer \(token ids only\)") as seen:
        llm = graphcap.LLM(str(tmp_path), max_batch=1, max_len=40, prefill_tokens=16,
                           progress=False)
    assert llm.tokenizer is None
    assert seen[0].filename == __file__  # the caller's line
