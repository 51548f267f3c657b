"""Stock transformers families whose attention uses a sliding window, soft-capped scores
or learned sinks (Gemma 2, Gemma 3, Cohere2, OLMo 3, EXAONE 4, gpt-oss, Mistral with a
window)
run under graphcap.hf as they are built (Qwen2-MoE and PhiMoE too, whose windows come
only from the masks transformers builds): their logits equal transformers' own eager
attention, and greedy generation equals transformers' ``generate()`` token for token under
the strategies, with prompts longer than the windows and prefilled in chunks. On the
emulator in CI, on CUDA graphs on the GPU (float32 both)."""

from __future__ import annotations

import copy

import pytest
import torch

import graphcap
from graphcap.opsdb.attention import get_backend

transformers = pytest.importorskip("transformers")
from graphcap.hf import PrefillLM  # noqa: E402  (needs transformers)
from tests.hf.test_hf_generate import transformers_greedy  # noqa: E402
from tests.support.hf_families import VOCAB, hf_model  # noqa: E402
from tests.support.runner_helpers import DEVICE, stream_counting_freed  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

# Windows of 8 tokens (the tiny configs); Gemma 2 soft-caps at 2.0, low enough to bind.
FAMILIES = {
    "gemma2": ({"attn_logit_softcapping": 2.0, "initializer_range": 0.5},
               ("window", "softcap")),
    "gemma3_text": ({"initializer_range": 0.5}, ("window",)),
    "cohere2": ({}, ("window",)),
    "olmo3": ({}, ("window",)),
    "exaone4": ({"initializer_range": 0.5}, ("window",)),
    "gpt_oss": ({}, ("window", "sinks")),
    "mistral": ({"sliding_window": 8}, ("window",)),
    "qwen2_moe": ({"initializer_range": 0.5}, ("window",)),
    "phimoe": ({"initializer_range": 0.5}, ("window",)),
}
LENS = [19, 12]  # past the window
PROMPTS = [[5, 9, 2, 7, 1, 8, 8, 4, 11, 6], [3, 4], [8, 8, 4, 11, 6, 2, 9, 10, 13, 1, 2, 3]]
NEW = 8  # the longest reaches position 19


def model(family: str):
    config, _ = FAMILIES[family]
    return hf_model(family, **config).to(DEVICE)


def packed_input():
    ids = torch.randint(0, VOCAB, (sum(LENS),), generator=torch.Generator().manual_seed(5))
    pos = torch.cat([torch.arange(n) for n in LENS])
    return ids.to(DEVICE), pos.to(DEVICE)


def stock_logits(ref, ids):
    with torch.no_grad():
        return torch.cat([ref(r[None], use_cache=False).logits[0] for r in ids.split(LENS)])


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_requests_give_transformers_own_logits(family, kernels):
    ref = model(family)
    lm = PrefillLM(copy.deepcopy(ref), kernels=kernels)
    assert lm.graphcap_attention_options == FAMILIES[family][1]
    ids, pos = packed_input()
    with torch.no_grad():
        got = lm(ids, pos, seq_lens=LENS)
    # float32 on both: 1e-5, but 1e-4 on CUDA and for the MoE families, whose logits at
    # weights of scale 0.5 are 2e-4 from float64's in either float32 forward
    # (transformers' grouped_mm experts sum in another order than graphcap's)
    tol = 1e-4 if DEVICE == "cuda" or family in ("qwen2_moe", "phimoe") else 1e-5
    torch.testing.assert_close(got, stock_logits(ref, ids), atol=tol, rtol=tol)


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_the_options_change_the_logits(family):
    """The windows (and Gemma 2's cap, gpt-oss's sinks) bind in these tests: the same
    weights without them give other logits."""
    ref = model(family)
    plain = {"layer_types": ["full_attention"] * 2}
    if family == "gemma2":
        plain["attn_logit_softcapping"] = None
    other = hf_model(family, **{**FAMILIES[family][0], **plain}).to(DEVICE)
    other.load_state_dict(ref.state_dict())
    ids, _ = packed_input()
    if family == "gpt_oss":
        for layer in other.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)  # a sink that takes no weight
    assert not torch.allclose(stock_logits(ref, ids), stock_logits(other, ids), atol=1e-3)


def test_gpt_oss_experts_run_on_opsdbs_moe_kernels_as_they_are_stored():
    """gpt-oss's MLP half (a biased router, experts [E, H, 2I] with gate and up
    interleaved, biases, the clamped GLU) on graphcap::moe_experts, reading the stock
    parameters where they lie: a weight changed in place is seen."""
    ref = model("gpt_oss")
    for layer in ref.model.layers:  # biases and routing that matter
        experts = layer.mlp.experts
        for p in (layer.mlp.router.bias, experts.gate_up_proj_bias, experts.down_proj_bias):
            p.data.normal_(0, 0.5)
    lm = PrefillLM(copy.deepcopy(ref))
    mlp = [p for p in lm.kernels.parts if p.kind == "mlp"]
    assert mlp and all(p.graphcap for p in mlp), lm.kernels.table()
    assert all("moe_experts" in p.what for p in mlp)
    ids, pos = packed_input()
    with torch.no_grad():
        torch.testing.assert_close(lm(ids, pos, seq_lens=LENS), stock_logits(ref, ids),
                                   atol=1e-4, rtol=1e-4)
        for m in (ref, lm.hf_model):
            m.model.layers[0].mlp.experts.gate_up_proj.mul_(1.5)
        torch.testing.assert_close(lm(ids, pos, seq_lens=LENS), stock_logits(ref, ids),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_a_model_with_sinks_wraps_where_the_best_backend_for_none_lacks_them(
        monkeypatch, kernels):
    """Wrapping probes the model on a backend computing its options, as its calls pick
    one: the best backend for no options may compute no sinks (flash_attn where only
    FlashAttention 2/3 is installed), and gpt-oss still wraps and gives transformers'
    logits."""
    best = type(get_backend(None, DEVICE, dtype=torch.float32))
    monkeypatch.setattr(best, "options", frozenset({"window", "softcap"}))
    ref = model("gpt_oss")
    lm = PrefillLM(copy.deepcopy(ref), kernels=kernels)
    ids, pos = packed_input()
    with torch.no_grad():
        torch.testing.assert_close(lm(ids, pos, seq_lens=LENS), stock_logits(ref, ids),
                                   atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("strategy", ["eager", "full"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_generation_equals_transformers_generate(family, strategy):
    ref = model(family)
    lm = PrefillLM(copy.deepcopy(ref), logits="last")
    got = graphcap.generate(lm, PROMPTS, NEW, strategy=strategy, max_batch=2,
                            prefill_tokens=4)  # prompts in chunks over the cache
    assert got.tokens == [transformers_greedy(ref, p, NEW) for p in PROMPTS]


def test_a_family_windowed_in_every_layer_frees_pages_behind_the_window_as_it_generates():
    """Mistral with an 8-token window in every layer: its cache's pages (2 tokens each)
    behind the window are freed while it generates, and the tokens are transformers';
    Gemma 2 (a global layer in two) keeps every page."""
    ref = model("mistral")
    lm = PrefillLM(copy.deepcopy(ref), logits="last")
    assert lm.graphcap_kv_window == 8 and PrefillLM(model("gemma2")).graphcap_kv_window == 0
    llm = graphcap.LLM(lm, strategy="full", max_batch=2, max_len=32, prefill_tokens=4,
                       page_size=2, progress=False, stop_at_eos=False)
    tokens, freed = stream_counting_freed(llm, PROMPTS, NEW)
    assert tokens == [transformers_greedy(ref, p, NEW) for p in PROMPTS]
    assert freed >= 2 and llm.cache.free_pages == llm.cache.pages


@pytest.mark.parametrize("strategy", ["breakable", "tc_piecewise"])
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_every_strategy_generates_what_transformers_generates(family, strategy):
    ref = model(family)
    lm = PrefillLM(copy.deepcopy(ref), logits="last")
    got = graphcap.generate(lm, PROMPTS, NEW, strategy=strategy, max_batch=2,
                            prefill_tokens=16)
    assert got.tokens == [transformers_greedy(ref, p, NEW) for p in PROMPTS]


def test_windowed_layers_of_substituted_families_run_on_graphcaps_attention_kernels():
    """Mistral's window reaches graphcap's own attention half (the probe compares it with
    the stock module past the window: 16 tokens), which then generates transformers'
    tokens."""
    ref = model("mistral")
    lm = PrefillLM(copy.deepcopy(ref), logits="last")
    assert "2/2 attention" in lm.kernels.summary()
    got = graphcap.generate(lm, PROMPTS, NEW, strategy="full", max_batch=2, prefill_tokens=4)
    assert got.tokens == [transformers_greedy(ref, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_accelerate_and_a_pipeline_give_transformers_tokens(family):
    """transformers' own calls on the engine: the model's generate on a left-padded batch,
    and a text-generation pipeline, token for token transformers'."""
    from tests.support.tokenizers import byte_tokenizer

    ref = model(family)
    fast = graphcap.accelerate(copy.deepcopy(ref), max_batch=2, max_len=48,
                               prefill_tokens=8)
    tok = byte_tokenizer(VOCAB)
    tok.padding_side = "left"
    batch = tok(["windows, sinks and caps", "a"], return_tensors="pt",
                padding=True).to(DEVICE)
    args = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert torch.equal(fast.generate(**batch, **args), ref.generate(**batch, **args))
    text = dict(max_new_tokens=NEW, do_sample=False)
    want = transformers.pipeline("text-generation", model=ref, tokenizer=tok)("hello", **text)
    assert transformers.pipeline("text-generation", model=fast, tokenizer=tok)(
        "hello", **text) == want


@pytest.mark.parametrize("family", ["llama", "gemma", "olmo2", "olmoe"])
@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_a_window_in_the_config_of_a_family_that_reads_none_is_not_applied(family, kernels):
    """Llama, Gemma, OLMo2 and OLMoE build no window mask (OLMoE's attention passes
    ``config.sliding_window`` on, which only FlashAttention reads): a ``sliding_window``
    a config carries (as converted checkpoints do) leaves transformers' eager logits as
    they are, and so graphcap's."""
    ref = hf_model(family, sliding_window=8).to(DEVICE)
    lm = PrefillLM(copy.deepcopy(ref), kernels=kernels)
    assert lm.graphcap_attention_options == ()
    assert set(lm.kv_windows.values()) == {0}
    ids, pos = packed_input()
    with torch.no_grad():
        got = lm(ids, pos, seq_lens=LENS)
    tol = 1e-4 if DEVICE == "cuda" else 1e-5  # as the packed-logits test above
    torch.testing.assert_close(got, stock_logits(ref, ids), atol=tol, rtol=tol)


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_a_window_only_the_mask_applies_is_applied(kernels):
    """SmolLM3 with ``use_sliding_window`` off and a sliding layer in ``layer_types``: its
    attention passes no window, and the mask its model builds slides over that layer:
    transformers' eager logits, windowed where the mask is."""
    ref = hf_model("smollm3").to(DEVICE)
    lm = PrefillLM(copy.deepcopy(ref), kernels=kernels)
    assert lm.graphcap_attention_options == ("window",)
    assert lm.kv_windows == {0: 8, 1: 0}
    ids, pos = packed_input()
    with torch.no_grad():
        got = lm(ids, pos, seq_lens=LENS)
    tol = 1e-4 if DEVICE == "cuda" else 1e-5  # as the packed-logits test above
    torch.testing.assert_close(got, stock_logits(ref, ids), atol=tol, rtol=tol)
