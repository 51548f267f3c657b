"""``graphcap.generate`` of stock transformers models (``graphcap.hf.PrefillLM``): greedy
generation equals transformers' own ``model.generate(do_sample=False)`` token for token,
on graphcap kernels where they fit and on stock ones, under eager and on graphs; on the
emulator in CI, on CUDA graphs on the GPU (float32 both)."""

from __future__ import annotations

import copy
import gc

import pytest
import torch

import graphcap

transformers = pytest.importorskip("transformers")
from graphcap.hf import PrefillLM  # noqa: E402  (needs transformers)
from tests.support.hf_families import hf_model  # noqa: E402
from tests.support.runner_helpers import DEVICE  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

PROMPTS = [[5, 9, 2, 7, 1], [3, 4], [8, 8, 4, 11, 6, 2, 9, 10, 13]]
NEW = 6


def transformers_greedy(ref, prompt, new: int = NEW):
    """transformers' own greedy tokens after ``prompt`` (batch 1: no padding)."""
    ids = torch.tensor([prompt], device=DEVICE)
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                       do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# (family, kernels): substituted attention halves, and transformers' own attention
# modules calling graphcap's attention function. Gemma and GPT-2 at the default init
# repeat their last token; a wider init makes their tokens tell.
CASES = [("llama", "graphcap"), ("qwen3", "graphcap"), ("qwen3_moe", "graphcap"),
         ("phi3", "graphcap"), ("llama", "stock"), ("qwen3", "stock"), ("gemma", "graphcap"),
         ("gpt2", "graphcap")]


# tc_piecewise compiles each case's model (7-9 s on a CPU): here substituted and stock
# attention of one family and the experts; on CUDA, every case.
TC_PIECEWISE_ON_CPU = {("llama", "graphcap"), ("llama", "stock"), ("qwen3_moe", "graphcap")}


def generation_cases() -> list:
    return [pytest.param(strategy, family, kernels, id=f"{strategy}-{family}-{kernels}")
            for family, kernels in CASES for strategy in ("eager", "full", "tc_piecewise")
            if strategy != "tc_piecewise" or DEVICE == "cuda"
            or (family, kernels) in TC_PIECEWISE_ON_CPU]


@pytest.mark.parametrize(("strategy", "family", "kernels"), generation_cases())
def test_greedy_generation_equals_transformers_generate(family, kernels, strategy):
    wide = {"initializer_range": 0.5} if family in ("gemma", "gpt2") else {}
    ref = hf_model(family, **wide).to(DEVICE)
    lm = PrefillLM(copy.deepcopy(ref), logits="last", kernels=kernels)
    eos = ref.generation_config.eos_token_id
    stops = [eos] if isinstance(eos, int) else list(eos or [])
    got = graphcap.generate(lm, PROMPTS, NEW, strategy=strategy, max_batch=2,
                            stop_tokens=stops, prefill_tokens=16)
    want = [transformers_greedy(ref, p) for p in PROMPTS]
    assert got.tokens == want, lm.kernels.summary()


def test_breakable_generates_what_eager_generates_for_a_stock_model():
    lm = PrefillLM(hf_model("qwen3").to(DEVICE))
    sampling = [graphcap.Sampling(temperature=1.0, seed=s) for s in range(len(PROMPTS))]
    want = graphcap.generate(lm, PROMPTS, NEW, strategy="eager", sampling=sampling)
    got = graphcap.generate(lm, PROMPTS, NEW, strategy="breakable", sampling=sampling,
                            prefill_tokens=16)
    assert got.tokens == want.tokens


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_generate_gives_a_stock_model_it_wrapped_back_as_it_came(family):
    # Passed as it is, the model is wrapped for the call; after it, its own forward and
    # transformers' generate() run as before (graphcap attention and kernels taken out).
    ref = hf_model(family).to(DEVICE)
    model = copy.deepcopy(ref)
    attention = model.config._attn_implementation
    got = graphcap.generate(model, PROMPTS, NEW, strategy="full", max_batch=2,
                            prefill_tokens=16)
    assert model.config._attn_implementation == attention
    ids = torch.tensor([PROMPTS[2]], device=DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    assert [transformers_greedy(model, p) for p in PROMPTS] == got.tokens


@pytest.mark.parametrize("options", [dict(max_len=10**6), dict(page_size=0),
                                     dict(prefill_tokens=0)])
def test_an_llm_that_fails_to_build_gives_a_stock_model_back_as_it_came(options):
    # Wrapped first (its attention switched), then refused: the model runs on its own
    # again, and a later LLM or accelerate() of it builds.
    ref = hf_model("llama").to(DEVICE)
    model = copy.deepcopy(ref)
    attention = model.config._attn_implementation
    options = dict(max_batch=1, max_len=16, progress=False) | options
    with pytest.raises(ValueError):
        graphcap.LLM(model, **options)
    with pytest.raises(ValueError):
        graphcap.accelerate(model, **options)
    assert model.config._attn_implementation == attention
    ids = torch.tensor([PROMPTS[2]], device=DEVICE)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref(ids).logits)
    assert transformers_greedy(model, PROMPTS[0]) == transformers_greedy(ref, PROMPTS[0])


def test_a_failed_llm_leaves_a_model_another_wrapper_holds_wrapped():
    model = hf_model("llama").to(DEVICE)
    lm = PrefillLM(model, logits="last")
    with pytest.raises(ValueError, match="max_len"):
        graphcap.LLM(model, max_batch=1, max_len=10**6, progress=False)
    assert model.config._attn_implementation == "graphcap"
    graphcap.generate(lm, PROMPTS[:1], NEW, strategy="eager")  # the wrapper is usable


def test_generate_gives_back_a_model_whose_earlier_wrapper_is_gone():
    model = hf_model("llama").to(DEVICE)
    attention = model.config._attn_implementation
    llm = graphcap.LLM(model, max_batch=1, max_len=16, prefill_tokens=8, progress=False)
    del llm
    gc.collect()
    graphcap.generate(model, PROMPTS[:1], NEW, strategy="eager")
    assert model.config._attn_implementation == attention


def test_a_wrapped_model_saves_and_its_copy_is_given_back_by_generate(tmp_path):
    model = hf_model("llama").to(DEVICE)
    lm = PrefillLM(model)  # noqa: F841  (alive: the model stays wrapped)
    torch.save(model, tmp_path / "model.pt")  # what graphcap keeps of it is off the model
    twin = copy.deepcopy(model)
    graphcap.generate(twin, PROMPTS[:1], NEW, strategy="eager")
    assert twin.config._attn_implementation == "eager"  # no wrapper of the copy lives
    assert model.config._attn_implementation == "graphcap"


def test_a_wrapped_model_saved_loads_and_generates_what_its_wrapper_does(tmp_path):
    model = hf_model("llama").to(DEVICE)
    lm = PrefillLM(model, logits="last")
    assert "2/2 attention" in lm.kernels.summary()  # its layers' forwards are patched
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    want = graphcap.generate(lm, PROMPTS, NEW, strategy="eager").tokens
    assert graphcap.generate(loaded, PROMPTS, NEW, strategy="eager").tokens == want
    assert [transformers_greedy(loaded, p) for p in PROMPTS] == want  # given back


def test_generate_leaves_a_model_another_wrapper_holds_as_that_wrapper_set_it():
    model = hf_model("llama").to(DEVICE)
    lm = PrefillLM(model, logits="last")
    graphcap.generate(model, PROMPTS[:1], NEW, strategy="eager")
    assert model.config._attn_implementation == "graphcap"
    assert lm.kernels.summary()  # still wrapped: the wrapper is usable
    graphcap.generate(lm, PROMPTS[:1], NEW, strategy="eager")


def test_a_causal_lm_whose_forward_takes_no_logits_to_keep_gives_one_row_per_request():
    """WhisperForCausalLM's forward takes no logits_to_keep (every token's row comes
    back): logits='last' still gives each request's last row, eagerly and from a runner
    (whose padded batch of 2 + 2 tokens has as many rows as request slots), and greedy
    generation is its own forward's argmax, token for token (transformers' generate() of
    the decoder alone fails on its cache)."""
    ref = hf_model("whisper", init_std=0.3).to(DEVICE)
    lm = PrefillLM(copy.deepcopy(ref), logits="last")
    runner = graphcap.capture(lm, "full", max_tokens=16, max_requests=4)
    for prompts in (PROMPTS[:2], [PROMPTS[0][:2], PROMPTS[1]]):
        ids = torch.tensor(prompts[0] + prompts[1], device=DEVICE)
        lens = [len(p) for p in prompts]
        pos = torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
        with torch.no_grad():
            want = torch.stack([ref(torch.tensor([p], device=DEVICE),
                                    use_cache=False).logits[0, -1] for p in prompts])
            torch.testing.assert_close(lm(ids, pos, seq_lens=lens), want, atol=1e-5,
                                       rtol=1e-5)
            torch.testing.assert_close(runner(ids, pos, seq_lens=lens), want, atol=1e-5,
                                       rtol=1e-5)
    greedy = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        for _ in range(NEW):
            with torch.no_grad():
                logits = ref(torch.tensor([tokens], device=DEVICE), use_cache=False).logits
            tokens.append(int(logits[0, -1].argmax()))
        greedy.append(tokens[len(prompt):])
    got = graphcap.generate(lm, PROMPTS, NEW, strategy="full", max_batch=2, prefill_tokens=16)
    assert got.tokens == greedy


def test_a_decoder_whose_config_names_its_positions_max_target_positions_is_held_to_them():
    # Whisper's config has no max_position_embeddings: its decoder's learned positions
    # are max_target_positions, past which its embedding has no row.
    lm = PrefillLM(hf_model("whisper", max_target_positions=16).to(DEVICE), logits="last")
    assert lm.max_position == 16
    with pytest.raises(ValueError, match="pass the model's max_position 16"):
        graphcap.generate(lm, [PROMPTS[0]], 12, strategy="eager")
    assert graphcap.LLM(lm, max_batch=1, progress=False).max_len == 16
