"""transformers' own calls on graphcap's engine (``graphcap.accelerate``): the model's
``generate`` on a padded batch from its tokenizer, and a text-generation pipeline, give
what transformers gives (greedy: token for token) for every family the suite builds;
sampling draws from the given temperature / top-k / top-p; an option graphcap does not
serve is refused by name; ``graphcap.restore`` gives the model back untouched."""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch

import graphcap

transformers = pytest.importorskip("transformers")
from tests.support.hf_families import FAMILIES, hf_model  # noqa: E402  (needs transformers)
from tests.support.runner_helpers import DEVICE  # noqa: E402
from tests.support.tokenizers import byte_tokenizer  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
OPTIONS = dict(max_batch=2, max_len=40, prefill_tokens=16)
TEXTS = ["graphs, ", "a"]


def pair(family: str):
    """A tiny stock model and an accelerated copy of it."""
    wide = {"initializer_range": 0.5} if family in ("gemma", "gpt2") else {}
    ref = hf_model(family, **wide).to(DEVICE)
    return ref, graphcap.accelerate(copy.deepcopy(ref), **OPTIONS)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("side", ["left", "right"])
def test_generate_on_a_padded_batch_gives_transformers_greedy_tokens(family, side):
    ref, fast = pair(family)
    tok = byte_tokenizer(128)
    tok.padding_side = side
    batch = tok(TEXTS, return_tensors="pt", padding=True).to(DEVICE)
    got = fast.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert got.shape[0] == 2 and torch.equal(got[:, :batch["input_ids"].shape[1]],
                                             batch["input_ids"])
    if side == "left":  # transformers' own batch: what it returns, token for token
        want = ref.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(got, want)
    for row, text in enumerate(TEXTS):  # each prompt's continuation, alone
        ids = tok(text, return_tensors="pt").to(DEVICE)
        alone = ref.generate(**ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        new = got[row, batch["input_ids"].shape[1]:].tolist()
        want_new = alone[0, ids["input_ids"].shape[1]:].tolist()
        assert new[:len(want_new)] == want_new and set(new[len(want_new):]) <= {0}


def test_a_text_generation_pipeline_runs_on_graphcap_and_says_what_transformers_says():
    ref, fast = pair("llama")
    tok = byte_tokenizer(128)
    args = dict(max_new_tokens=8, do_sample=False)
    want = transformers.pipeline("text-generation", model=ref, tokenizer=tok)("hello", **args)
    before = fast.__dict__["_graphcap_llm"].report()["decode"]["calls"]
    got = transformers.pipeline("text-generation", model=fast, tokenizer=tok)("hello", **args)
    assert got == want
    assert fast.__dict__["_graphcap_llm"].report()["decode"]["calls"] > before


def test_sampling_draws_with_the_given_parameters_and_torchs_seed():
    _, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    greedy = fast.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(fast.generate(ids, max_new_tokens=8, do_sample=True, top_k=1), greedy)
    # top_p=0.0: transformers keeps the most likely token alone
    assert torch.equal(fast.generate(ids, max_new_tokens=8, do_sample=True, top_p=0.0), greedy)
    torch.manual_seed(3)
    hot = fast.generate(ids, max_new_tokens=8, do_sample=True, temperature=5.0, top_k=0)
    torch.manual_seed(3)
    assert torch.equal(fast.generate(ids, max_new_tokens=8, do_sample=True,
                                     temperature=5.0, top_k=0), hot)
    assert not torch.equal(hot, greedy)
    # top_p of 1 or more: transformers applies no top-p (its warper refuses past 1)
    torch.manual_seed(3)
    assert torch.equal(fast.generate(ids, max_new_tokens=8, do_sample=True,
                                     temperature=5.0, top_k=0, top_p=1.5), hot)


def test_options_spelled_out_at_values_that_change_nothing_are_served():
    """Some transformers versions write every global default into the generation config a
    pipeline passes (``num_beams=1``, ``repetition_penalty=1.0``, the assistant's knobs):
    those are transformers' plain greedy or sampled decoding, and are served."""
    ref, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    config = copy.deepcopy(ref.generation_config)
    spelled = dict(num_beams=1, num_return_sequences=1, repetition_penalty=1.0,
                   length_penalty=1.0, typical_p=1.0, encoder_repetition_penalty=1.0,
                   num_assistant_tokens=20, assistant_lookbehind=10, target_lookbehind=10,
                   assistant_confidence_threshold=0.4, num_assistant_tokens_schedule="constant")
    for key, value in spelled.items():
        setattr(config, key, value)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, **args)
    assert torch.equal(fast.generate(ids, generation_config=config, **args), want)
    config.repetition_penalty = 1.3
    with pytest.raises(ValueError, match="does not serve repetition_penalty"):
        fast.generate(ids, generation_config=config, **args)


def test_what_it_does_not_serve_is_refused_by_name_and_restore_gives_the_model_back():
    ref, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    with pytest.raises(ValueError, match="does not serve num_beams"):
        fast.generate(ids, max_new_tokens=4, num_beams=2)
    with pytest.raises(ValueError, match="does not serve logits_processor"):
        fast.generate(ids, max_new_tokens=4, logits_processor=[lambda i, s: s])
    with pytest.raises(ValueError, match="accelerated already"):
        graphcap.accelerate(fast)
    with pytest.raises(TypeError, match="not copied or pickled.*graphcap.restore"):
        copy.deepcopy(fast)  # its graphs and cache are the device's
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args))
    back = graphcap.restore(fast)
    assert back is fast and "generate" not in fast.__dict__
    assert fast.config._attn_implementation == ref.config._attn_implementation
    assert fast.training == ref.training
    beams = dict(max_new_tokens=4, num_beams=2, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(ids, **beams), ref.generate(ids, **beams))
    with torch.no_grad():  # its own forward again, graphcap's context not needed
        torch.testing.assert_close(fast(ids).logits, ref(ids).logits)
    with pytest.raises(ValueError, match="is not accelerated"):
        graphcap.restore(fast)
    copied = copy.deepcopy(fast)  # restored: a stock model again
    assert torch.equal(copied.generate(ids, **beams), ref.generate(ids, **beams))


def test_an_llm_of_a_model_whose_generation_config_sets_decoding_defaults_says_it_ignores_them(
        recwarn):
    # transformers' generate applies them (a checkpoint's repetition_penalty, do_sample,
    # ...); graphcap.LLM decodes as its own generate() is told, and says so once, naming
    # them. accelerate() applies them per call or refuses them, so it says nothing.
    from graphcap.engine import DefaultsNotApplied

    ref = hf_model("qwen2").to(DEVICE)
    ref.generation_config.repetition_penalty = 1.3
    ref.generation_config.do_sample, ref.generation_config.temperature = True, 0.7
    with pytest.warns(DefaultsNotApplied, match=r"do_sample=True, repetition_penalty=1\.3, "
                                                r"temperature=0\.7: graphcap\.LLM applies none"):
        graphcap.LLM(copy.deepcopy(ref), **OPTIONS)
    recwarn.clear()
    graphcap.accelerate(copy.deepcopy(ref), **OPTIONS)
    assert not [w for w in recwarn if issubclass(w.category, DefaultsNotApplied)]
    graphcap.LLM(hf_model("qwen2").to(DEVICE), **OPTIONS)  # eos and pad ids only: quiet
    assert not [w for w in recwarn if issubclass(w.category, DefaultsNotApplied)]


IDS = [[5, 9, 3, 7, 1], [6, 6, 4, 8, 9]]


def test_a_callers_eos_token_id_replaces_the_models_as_in_transformers():
    ref = hf_model("llama").to(DEVICE)
    ids = torch.tensor(IDS[:1], device=DEVICE)
    first = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1]
    ref.generation_config.eos_token_id = int(first)  # the model's: its 4th greedy token
    fast = graphcap.accelerate(copy.deepcopy(ref), **OPTIONS)
    for eos in (None, 127):  # the model's, then the caller's (never drawn) over it
        args = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos)
        if eos is None:
            del args["eos_token_id"]
        assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args)), eos


def test_rows_that_end_first_are_padded_with_the_first_eos_id_without_a_pad_token():
    ref, fast = pair("llama")
    ids = torch.tensor(IDS, device=DEVICE)
    ends = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1]
    args = dict(max_new_tokens=8, do_sample=False, eos_token_id=[int(ends), 1],
                attention_mask=torch.ones_like(ids))
    assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args))


def test_a_generation_config_given_takes_the_models_defaults_where_it_sets_none():
    ref = hf_model("llama").to(DEVICE)
    ref.generation_config.repetition_penalty = 5.0  # not served: refused, never ignored
    fast = graphcap.accelerate(copy.deepcopy(ref), **OPTIONS)
    config = transformers.GenerationConfig(max_new_tokens=8, pad_token_id=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        fast.generate(torch.tensor(IDS[:1], device=DEVICE), generation_config=config)


def test_sampling_without_top_k_draws_from_transformers_default_top_50():
    _, fast = pair("llama")
    ids = torch.tensor(IDS[:1], device=DEVICE)
    torch.manual_seed(0)
    drawn = {int(fast.generate(ids, max_new_tokens=1, do_sample=True, temperature=50.0)[0, -1])
             for _ in range(200)}
    assert len(drawn) <= 50  # of 128: the 50 likeliest only


def test_sampling_at_temperature_zero_is_refused_as_transformers_refuses_it():
    _, fast = pair("llama")
    with pytest.raises(ValueError, match="temperature"):
        fast.generate(torch.tensor(IDS[:1], device=DEVICE), max_new_tokens=2, do_sample=True,
                      temperature=0.0)


def test_with_no_length_anywhere_it_generates_transformers_default_20_new_tokens():
    ref, fast = pair("llama")
    for length in (5, 18):  # 20 new tokens after each prompt, not 20 in all
        ids = torch.arange(1, length + 1, device=DEVICE)[None] % 100 + 3
        want = ref.generate(ids, do_sample=False, pad_token_id=0)
        assert torch.equal(fast.generate(ids, do_sample=False, pad_token_id=0), want)


def test_a_generation_config_as_second_argument_the_prompts_as_inputs_and_a_tensor_eos():
    ref, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    config = transformers.GenerationConfig(max_new_tokens=4, do_sample=False, pad_token_id=0)
    want = ref.generate(ids, config)
    assert torch.equal(fast.generate(ids, config), want)
    assert torch.equal(fast.generate(inputs=ids, generation_config=config), want)
    eos = want[0, -2:].clone()  # stops at the first of them, as transformers does
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=eos)
    assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args))


@pytest.mark.parametrize("option", [{"forced_eos_token_id": 0}, {"guidance_scale": 0.0},
                                    {"max_time": 0.0}])
def test_an_option_set_to_zero_that_changes_transformers_decoding_is_refused(option):
    _, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    with pytest.raises(ValueError, match=f"does not serve {next(iter(option))}"):
        fast.generate(ids, max_new_tokens=4, do_sample=False, **option)


def test_a_model_put_in_training_mode_is_refused_until_eval():
    ref, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    fast.train()  # transformers' generate would decode with dropout
    with pytest.raises(ValueError, match="in training mode.*model.eval"):
        fast.generate(ids, **args)
    fast.eval()
    assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args))


def test_zeros_that_change_nothing_and_keys_transformers_never_reads_are_served():
    ref, fast = pair("llama")
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    config = copy.deepcopy(ref.generation_config)
    config.presence_penalty = 0.5  # no field of GenerationConfig: transformers ignores it
    for extra in ({"min_p": 0.0}, {"min_new_tokens": 0}, {"generation_config": config}):
        assert torch.equal(fast.generate(ids, **args, **extra), ref.generate(ids, **args,
                                                                             **extra))
    with pytest.raises(ValueError, match="does not serve past_key_values"):
        fast.generate(ids, **args, past_key_values=transformers.DynamicCache())


@pytest.fixture(scope="module")
def llama():
    """One tiny Llama and an accelerated copy, for the tests that leave both as they are."""
    return pair("llama")


def test_a_pad_token_id_given_as_a_tensor_is_the_id_transformers_compares_with_the_eos(
        llama):
    # pad 2 is the eos: transformers infers no mask from it, and token 2 in a prompt is
    # the prompt's (as a tensor it was never found among the eos ids: rows lost their 2s)
    ref, fast = llama
    ids = torch.tensor([[5, 9, 2, 7, 1], [0, 0, 2, 3, 4]], device=DEVICE)
    for pad, eos in ((torch.tensor(2), 2), (torch.tensor(0), torch.tensor([2]))):
        args = dict(max_new_tokens=6, do_sample=False, pad_token_id=pad, eos_token_id=eos)
        assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args)), pad


def test_int32_prompts_give_int64_rows_as_transformers_gives(llama):
    ref, fast = llama
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE, dtype=torch.int32)
    args = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    got, want = fast.generate(ids, **args), ref.generate(ids, **args)
    assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)


def test_eos_ids_outside_the_vocabulary_end_no_row_as_in_transformers(llama):
    # some checkpoints list ids past the model's vocabulary (or -1): never drawn
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    ends = ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1]
    for eos in ([500, int(ends)], [-1, int(ends)], 128):
        args = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=0)
        assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args)), eos


def test_a_length_past_the_accelerated_max_len_is_refused_naming_what_asked_for_it(llama):
    # OPTIONS' max_len is 40: the option that asks for the tokens, and accelerate's max_len
    _, fast = llama
    ids = torch.tensor(IDS[:1], device=DEVICE)
    fits = r"max_new_tokens=35 or fewer, or graphcap.restore\(model\) and " \
        r"graphcap.accelerate\(model, max_len=45"
    with pytest.raises(ValueError, match=r"max_new_tokens=40 asks 40 new tokens after a "
                                         r"prompt of 5: 45 tokens pass the max_len 40 the "
                                         r"model was accelerated with; give " + fits):
        fast.generate(ids, max_new_tokens=40, do_sample=False)
    with pytest.raises(ValueError, match=r"max_length=45 .*asks 40 new tokens.*" + fits):
        fast.generate(ids, max_length=45, do_sample=False)
    long = torch.arange(3, 28, device=DEVICE)[None]  # 25 + transformers' default 20
    with pytest.raises(ValueError, match="default of 20 new tokens.*max_len=45"):
        fast.generate(long, do_sample=False)


def test_no_cache_and_no_remote_code_change_nothing_and_a_cache_given_is_refused(llama):
    # transformers 5 names the cache argument cache (past_key_values before)
    ref, fast = llama
    ids = torch.tensor(IDS[:1], device=DEVICE)
    args = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    for extra in ({"cache": None}, {"trust_remote_code": False}):
        assert torch.equal(fast.generate(ids, **args, **extra),
                           ref.generate(ids, **args, **extra)), extra
    with pytest.raises(ValueError, match="does not serve cache"):
        fast.generate(ids, **args, cache=transformers.DynamicCache())


def test_an_accelerated_model_called_on_its_own_says_to_generate_or_restore_it(llama):
    _, fast = llama
    ids = torch.tensor([[5, 9, 2, 7, 1]], device=DEVICE)
    with pytest.raises(graphcap.UnsupportedModel, match=r"accelerate gave a generate\(\) "
                       r"generates through model\.generate\(\.\.\.\) or a pipeline, and "
                       r"graphcap\.restore\(model\) gives it back as it was"):
        fast(ids)
    assert fast.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0).shape == (
        1, 7)


def test_an_empty_batch_is_refused_as_generate_refuses_it(llama):
    _, fast = llama
    with pytest.raises(ValueError, match="non-empty"):
        fast.generate(torch.zeros(0, 4, dtype=torch.long, device=DEVICE), max_new_tokens=2,
                      do_sample=False, pad_token_id=0)


def test_a_tensor_given_to_an_argument_it_does_not_serve_is_refused_by_name(llama):
    # negative_prompt_ids of several ids has no truth value: it was asked for one, and
    # torch's RuntimeError escaped instead of the refusal
    _, fast = llama
    ids = torch.tensor(IDS[:1], device=DEVICE)
    args = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    for name in ("negative_prompt_ids", "negative_prompt_attention_mask"):
        with pytest.raises(ValueError, match=f"does not serve {name}"):
            fast.generate(ids, **args, **{name: torch.tensor([[1, 2]], device=DEVICE)})
    empty = transformers.LogitsProcessorList()  # an empty list still changes nothing
    assert fast.generate(ids, **args, logits_processor=empty).shape == (1, 7)


@pytest.mark.parametrize("cache", ["paged", "quantized"])
def test_a_cache_implementation_that_changes_what_transformers_returns_is_refused(llama, cache):
    # "paged": transformers' continuous batching, a [1, batch, tokens] tensor and the
    # attention mask unread; "quantized": keys and values in fewer bits. Both were served
    # as a plain generate, a [batch, tokens] tensor of other tokens
    _, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    args = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
    with pytest.raises(ValueError, match=f"does not serve cache_implementation='{cache}'"):
        fast.generate(ids, **args, cache_implementation=cache)
    config = transformers.GenerationConfig(cache_implementation=cache, **args)
    with pytest.raises(ValueError, match=f"cache_implementation='{cache}'"):
        fast.generate(ids, generation_config=config)
    for served in ("static", "dynamic", "offloaded"):  # the tokens are the same
        assert fast.generate(ids, **args, cache_implementation=served).shape == (2, 7)


@pytest.mark.parametrize("option", [
    {"repetition_penalty": 0.0}, {"typical_p": 0.0, "do_sample": True}, {"bad_words_ids": []},
    {"sequence_bias": {}}, {"stop_strings": []}, {"top_h": 0.0, "do_sample": True},
    {"prompt_lookup_num_tokens": 0}])
def test_an_empty_or_zero_option_transformers_acts_on_is_refused_not_taken_as_unset(
        llama, option):
    # transformers applies these whenever they are set, and refuses these values (a
    # penalty of 0, an empty list of bad words or stop strings, ...): graphcap decoded as
    # if they were unset
    _, fast = llama
    name = next(k for k in option if k != "do_sample")
    with pytest.raises(ValueError, match=f"does not serve {name}"):
        fast.generate(torch.tensor(IDS[:1], device=DEVICE), max_new_tokens=2, pad_token_id=0,
                      **option)


def test_eos_and_pad_ids_given_as_numpy_ints_or_arrays_are_the_ids_transformers_takes(llama):
    # transformers makes a tensor of them; np.int64 was iterated ('not iterable') and an
    # array of two asked for its truth
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    ends = int(ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1])
    for eos, pad in ((np.int64(ends), np.int64(0)), (np.array([ends, 1]), 0),
                     (np.array(ends), np.array(0)), ([np.int32(ends)], None)):
        args = dict(max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=pad,
                    attention_mask=torch.ones_like(ids))
        assert torch.equal(fast.generate(ids, **args), ref.generate(ids, **args)), eos


def test_sampling_options_are_unread_by_greedy_decoding_as_in_transformers(llama):
    # transformers builds its warpers under do_sample alone (and warns of the flags):
    # min_p, typical_p, ... were refused where greedy decoding never reads them
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    for extra in ({"temperature": 0.3, "top_k": 3, "top_p": 0.5}, {"temperature": 0.0},
                  {"min_p": 0.2}, {"typical_p": 0.5}, {"typical_p": 0.0},
                  {"epsilon_cutoff": 0.1}, {"eta_cutoff": 0.1}, {"top_h": 0.5},
                  {"generation_config": transformers.GenerationConfig(min_p=0.2, top_k=3)}):
        assert torch.equal(fast.generate(ids, **args, **extra),
                           ref.generate(ids, **args, **extra)), extra
    with pytest.raises(ValueError, match="does not serve min_p"):  # sampling: it acts
        fast.generate(ids, max_new_tokens=4, do_sample=True, min_p=0.2)


def test_a_min_length_that_changes_nothing_is_served_and_one_that_acts_is_refused(llama):
    # transformers keeps the eos ids from the steps whose rows (the input's columns, then
    # the new tokens) are shorter than min_length: at most the input's width, or with no
    # eos id in the vocabulary, it keeps none. It was refused whatever its value
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    ends = int(ref.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, -1])
    args = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    for extra in ({"min_length": 5, "eos_token_id": ends}, {"min_length": 3},
                  {"min_length": 12, "eos_token_id": [500]}):
        assert torch.equal(fast.generate(ids, **args, **extra),
                           ref.generate(ids, **args, **extra)), extra
    with pytest.raises(ValueError, match=rf"does not serve min_length=12 past the 5 input "
                                         rf"columns: transformers keeps the eos ids \[{ends}\] "
                                         r"from the first 7 new tokens"):
        fast.generate(ids, **args, min_length=12, eos_token_id=ends)


def test_max_cache_len_sizes_transformers_static_cache_only_and_is_served(llama):
    # at least the call's length (transformers takes the larger), and unread without a
    # static cache: the tokens are the same. It was refused
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    for extra in ({"max_cache_len": 64}, {"max_cache_len": 6},
                  {"max_cache_len": 64, "cache_implementation": "static"},
                  {"max_cache_len": 6, "cache_implementation": "static"}):
        assert torch.equal(fast.generate(ids, **args, **extra),
                           ref.generate(ids, **args, **extra)), extra


def test_an_llm_of_a_model_whose_generation_config_sizes_a_static_cache_is_quiet():
    from graphcap.engine import DefaultsNotApplied

    ref = hf_model("llama").to(DEVICE)
    ref.generation_config.max_cache_len = 64  # no decoding choice: nothing unapplied
    with warnings.catch_warnings():
        warnings.simplefilter("error", DefaultsNotApplied)
        graphcap.LLM(ref, **OPTIONS)


def test_return_dict_in_generate_gives_transformers_output_of_the_sequences(llama):
    # its sequences, and no cache (graphcap's is its own), as transformers' without one;
    # output_scores and output_logits fill nothing without it. All three were refused
    ref, fast = llama
    ids = torch.tensor(IDS, device=DEVICE)
    args = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    got = fast.generate(ids, **args, return_dict_in_generate=True)
    want = ref.generate(ids, **args, return_dict_in_generate=True, use_cache=False)
    assert type(got) is type(want) and list(got.keys()) == list(want.keys()) == ["sequences"]
    cache = getattr(got, "cache", getattr(got, "past_key_values", None))  # by version
    assert torch.equal(got.sequences, want.sequences) and cache is None
    assert torch.equal(got.sequences, ref.generate(ids, **args, return_dict_in_generate=True
                                                   ).sequences)
    sampled = fast.generate(ids, max_new_tokens=4, do_sample=True, return_dict_in_generate=True)
    assert sampled.sequences.shape == (2, 9)
    for extra in ({"output_scores": True}, {"output_logits": True},
                  {"return_dict_in_generate": False}):
        assert torch.equal(fast.generate(ids, **args, **extra),
                           ref.generate(ids, **args, **extra)), extra
    for name in ("output_scores", "output_logits"):  # asked for: not served
        with pytest.raises(ValueError, match=f"does not serve {name}"):
            fast.generate(ids, **args, return_dict_in_generate=True, **{name: True})


def test_a_prompt_filling_the_positions_without_a_length_is_refused_naming_them():
    # transformers' default 20 new tokens stop at max_position_embeddings (256 here): the
    # refusal named a max_length of 20 nobody gave and asked for max_new_tokens
    ref = hf_model("llama").to(DEVICE)
    fast = graphcap.accelerate(copy.deepcopy(ref), max_batch=1, max_len=256,
                               prefill_tokens=64)
    ids = torch.arange(256, device=DEVICE)[None] % 100 + 3
    with pytest.raises(ValueError, match="256 input tokens fill the model's "
                                         "max_position_embeddings 256"):
        fast.generate(ids, do_sample=False, pad_token_id=0)
