"""Stock transformers families graphcap.hf cannot run as they are built: each is refused
with ``UnsupportedModel`` naming the model and the config fields that switch the feature
off (and doing as the message says makes it run exactly), or, where graphcap can run it
exactly, it runs. Families of tests/support/hf_families.py's OTHER_FAMILIES; those with
sliding windows, soft-capping and sinks: tests/hf/test_hf_variants.py."""

from __future__ import annotations

import re

import pytest
import torch

import graphcap

transformers = pytest.importorskip("transformers")
from graphcap.hf import PrefillLM, UnsupportedModel  # noqa: E402  (needs transformers)
from tests.support.hf_families import VOCAB, hf_model  # noqa: E402

IDS = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
POS = torch.cat([torch.arange(5), torch.arange(3)])
LENS = [5, 3]  # shorter than the tiny configs' windows of 8 tokens
PROMPTS = [[5, 9, 2, 7, 1], [3, 4]]


def stock_logits(ref, ids=IDS, lens=LENS):
    with torch.no_grad():
        return torch.cat([ref(r[None], use_cache=False).logits[0] for r in ids.split(lens)])


def advised(message: str) -> dict:
    """The keyword arguments of from_pretrained that a refusal tells the user to load with."""
    found = re.search(r"from_pretrained\(path, (.*?)\) \(or set", message)
    assert found, message
    return eval(f"dict({found.group(1)})")  # noqa: S307  (our own message)


def test_qwen2_with_use_sliding_window_but_only_full_attention_layers_runs():
    # max_window_layers past the last layer: every layer attends fully, whatever
    # use_sliding_window says; the model is not refused.
    ref = hf_model("qwen2", use_sliding_window=True, sliding_window=8)
    assert set(ref.config.layer_types) == {"full_attention"}
    lm = PrefillLM(hf_model("qwen2", use_sliding_window=True, sliding_window=8))
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


def test_chunked_attention_is_refused_and_loading_as_the_refusal_says_runs_exactly(tmp_path):
    chunked = {"layer_types": ["chunked_attention", "full_attention"],
               "attention_chunk_size": 4}
    model = hf_model("llama", **chunked)
    with pytest.raises(UnsupportedModel, match=r"^LlamaForCausalLM has chunked_attention "
                       r"layers .*not chunks: load the model with them turned off") as no:
        PrefillLM(model)
    model.save_pretrained(tmp_path)
    full = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", **advised(str(no.value))).eval()
    assert set(full.config.layer_types) == {"full_attention"}
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", layer_types=full.config.layer_types).eval()
    with torch.no_grad():
        torch.testing.assert_close(PrefillLM(full)(IDS, POS, seq_lens=LENS),
                                   stock_logits(ref), atol=1e-5, rtol=1e-5)


def test_layers_that_are_not_attention_are_refused_naming_their_type():
    model = hf_model("llama", layer_types=["full_attention", "linear_attention"])
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLM has layers of type "
                       "linear_attention .*no config field turns off"):
        PrefillLM(model)


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_mla_values_of_another_head_dim_than_keys_are_refused_naming_the_dims(kernels):
    # DeepSeek-V3's checkpoints: qk_nope_head_dim + qk_rope_head_dim != v_head_dim.
    model = hf_model("deepseek_v3")
    with pytest.raises(UnsupportedModel, match=r"^DeepseekV3ForCausalLM: .*keys of head dim "
                       r"16 and values of head dim 8 \(config: qk_nope_head_dim=8, "
                       r"qk_rope_head_dim=8, v_head_dim=8\).*transformers' own attention"):
        PrefillLM(model, kernels=kernels)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("strategy", ["eager", "full"])
def test_mla_with_one_head_dim_generates_what_transformers_generates(strategy):
    # Its keys have every query head and head dim qk_nope + qk_rope, which neither
    # num_key_value_heads nor head_dim says: the cache takes what the attention receives.
    ref = hf_model("deepseek_v3_one_head_dim")
    lm = PrefillLM(hf_model("deepseek_v3_one_head_dim"), logits="last")
    assert set(lm.kv_shapes.values()) == {(4, 16)}
    got = graphcap.generate(lm, PROMPTS, 4, strategy=strategy, max_batch=2,
                            prefill_tokens=16)
    want = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                           do_sample=False, pad_token_id=0)
        want.append(out[0, len(prompt):].tolist())
    assert got.tokens == want


def on_the_interface(family: str) -> bool:
    """Whether the installed transformers' ``family`` model calls its AttentionInterface
    (Falcon does from 5.25)."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return "ALL_ATTENTION_FUNCTIONS" in vars(module)


@pytest.mark.parametrize("family", ["phi", "gpt_neox", pytest.param("falcon", marks=(
    pytest.mark.skipif(not on_the_interface("falcon"),
                       reason="Falcon computes its own attention before transformers 5.25")))])
def test_other_families_on_transformers_attention_interface_run_exactly(family):
    ref = hf_model(family)
    lm = PrefillLM(hf_model(family))
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


def test_falcon_with_alibi_is_refused_naming_the_bias_graphcap_attention_lacks():
    with pytest.raises(UnsupportedModel, match=r"FalconForCausalLM: ALiBi \(config.alibi="
                                               r"True\) adds a bias"):
        PrefillLM(hf_model("falcon", alibi=True))


def test_bloom_whose_attention_does_not_use_the_attention_interface_is_refused():
    """Bloom computes attention in its own modules (transformers 5.24 and 5.25; Falcon
    did until 5.25, which moved it onto the interface)."""
    with pytest.raises(UnsupportedModel, match=r"BloomForCausalLM cannot switch.*"
                                               r"BloomAttention"):
        PrefillLM(hf_model("bloom"))


def test_a_layer_calling_attention_twice_prefills_exactly_and_its_generation_is_refused():
    """DiffLlama's differential attention calls the attention function once per half of
    its values, both under the layer's index: its prefill logits are exact, and
    generation is refused (graphcap's paged cache holds one set of keys and values per
    layer: decode steps would read the second call's values for both)."""
    ref = hf_model("diffllama")
    lm = PrefillLM(hf_model("diffllama"))
    assert lm.kv_repeats == {0: 2, 1: 2}
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)
    model = hf_model("diffllama")
    with pytest.raises(UnsupportedModel, match=r"^DiffLlamaForCausalLM: its attention "
                       r"layer 0 calls the attention function 2 times a forward"):
        graphcap.generate(model, PROMPTS, 4, strategy="eager")
    assert model.config._attn_implementation == "eager"  # given back as it came


def test_queries_scaled_by_positions_counted_along_the_row_are_refused_and_turned_off_run(
        tmp_path):
    """Llama 4's attn_temperature_tuning scales its NoPE layers' queries by positions it
    counts along the row, not position_ids: a request packed after another would take the
    scale of the positions after it, and a decode step that of position 0. Refused; loaded
    with it off as the refusal says, the model runs exactly (past floor_scale tokens)."""
    model = hf_model("llama4")
    with pytest.raises(UnsupportedModel, match=r"^Llama4ForCausalLM: attn_temperature_tuning "
                       r"scales the queries of its layers without rotary \(\[1\]\)") as no:
        PrefillLM(model)
    assert model.config._attn_implementation == "eager"
    model.save_pretrained(tmp_path)
    off = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", **advised(str(no.value))).eval()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", attn_temperature_tuning=False).eval()
    lens = [9, 7]
    ids = torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        torch.testing.assert_close(PrefillLM(off)(ids, pos, seq_lens=lens),
                                   stock_logits(ref, ids, lens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_a_model_that_numbers_its_packed_row_itself_is_refused(kernels):
    """BART's decoder (and mBART's, Marian's, Pegasus', PLBart's, Blenderbot's: their
    causal LMs) reads no position_ids: its positions count along the row, so a request
    packed after another would take the positions after it (its logits off by about
    their own size) and every decode step position 0. Refused, and left as it came."""
    model = hf_model("bart")
    with pytest.raises(UnsupportedModel, match=r"^BartForCausalLM: a request's logits "
                       r"change when another request is packed before it .*position_ids"):
        PrefillLM(model, kernels=kernels)
    assert model.config._attn_implementation == "eager"
    torch.testing.assert_close(model(IDS[None]).logits[0, :5],
                               stock_logits(model, IDS[:5], [5]))


@pytest.mark.parametrize("family", ["mistral", "phi3", "mixtral"])
@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_windows_as_shipped_run_those_that_cannot_bind_at_no_cost(family, kernels):
    """Shipped windows of 4096 tokens on models of at most that many positions (the tiny
    configs have 256) never bind: such models run as full attention, token for token
    transformers' own generation; a window of 255 tokens could bind at position 255, and
    is computed (tests/hf/test_hf_variants.py: windows that bind)."""
    from tests.hf.test_hf_generate import transformers_greedy

    ref = hf_model(family, sliding_window=4096)
    lm = PrefillLM(hf_model(family, sliding_window=4096), logits="last", kernels=kernels)
    assert lm.graphcap_attention_options == ()
    eos = ref.generation_config.eos_token_id
    got = graphcap.generate(lm, PROMPTS, 6, strategy="full", max_batch=2, prefill_tokens=8,
                            stop_tokens=[eos] if isinstance(eos, int) else list(eos or []))
    assert got.tokens == [transformers_greedy(ref, p) for p in PROMPTS]
    tight = PrefillLM(hf_model(family, sliding_window=255), kernels=kernels)
    assert tight.graphcap_attention_options == ("window",)
