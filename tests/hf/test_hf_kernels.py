"""opsdb's kernels substituted into stock transformers models (``PrefillLM(hf,
kernels="graphcap")``, the default): which modules run them and why others do not, the
weights shared with the model, and a model whose weights change after wrapping."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import graphcap
from graphcap.api import GRAPHED

transformers = pytest.importorskip("transformers")
from graphcap.hf import PrefillLM, UnsupportedModel  # noqa: E402  (needs transformers)
from tests.support.hf_families import SUBSTITUTED, VOCAB, hf_model  # noqa: E402

IDS = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
POS = torch.cat([torch.arange(5), torch.arange(3)])
LENS = [5, 3]


class GraphcapOps(TorchDispatchMode):
    """The graphcap ops a call dispatched, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "graphcap":
            self.ops[func._opname] += 1
        return func(*args, **(kwargs or {}))


def stock_logits(ref, ids=IDS, lens=LENS):
    """transformers' own model (eager attention), one request at a time."""
    with torch.no_grad():
        return torch.cat([ref(r[None]).logits[0] for r in ids.split(lens) if r.numel()])


def ops_of(lm):
    with torch.no_grad(), GraphcapOps() as seen:
        lm(IDS, POS, seq_lens=LENS)
    return seen.ops


@pytest.mark.parametrize("family", SUBSTITUTED)
def test_every_layer_of_a_substituted_family_runs_graphcap_kernels_with_stock_logits(family):
    ref = hf_model(family)
    lm = PrefillLM(copy.deepcopy(ref))
    parts = {p.kind: [] for p in lm.kernels.parts}
    for p in lm.kernels.parts:
        parts[p.kind].append(p.graphcap)
    assert all(parts["attention"]) and all(parts["mlp"]) and len(parts["mlp"]) == 2, \
        lm.kernels.table()
    ops = ops_of(lm)
    assert ops["rms_norm_linear"] == ops["qkv_cached_attention"] == 2
    assert ops["rms_norm_swiglu"] + ops["moe_experts"] == 2
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-4, rtol=1e-4)


def test_stock_kernels_are_the_model_s_own_code_with_graphcap_attention_only():
    lm = PrefillLM(hf_model("qwen3"), kernels="stock")
    assert lm.kernels.parts == [] and lm.kernels.summary() == "no module on graphcap kernels"
    # graphcap::cached_attention: the attention function of every layer with a layer_idx
    assert set(ops_of(lm)) == {"cached_attention"}
    again = PrefillLM(lm.hf_model)  # the same model on graphcap kernels, then back
    assert "rms_norm_linear" in ops_of(again)
    PrefillLM(lm.hf_model, kernels="stock")
    assert set(ops_of(lm)) == {"cached_attention"}


def test_an_unknown_kernels_choice_is_refused_naming_both():
    with pytest.raises(ValueError, match="kernels='fast'.*'graphcap'.*'stock'"):
        PrefillLM(hf_model("llama"), kernels="fast")


@pytest.mark.parametrize(("family", "config", "module", "why"), [
    # Gemma's RMSNorm scales by (1 + weight): the probe, not the class name, tells.
    ("gemma", {}, "model.layers.0.self_attn", "the attention half's q: the probe differs"),
    ("gemma", {}, "model.layers.0.mlp", "act_fn is not SiLU"),
    ("gemma", {}, "model.norm", "GemmaRMSNorm: the probe differs"),
    # Granite scales each residual branch: not the pre-norm layer h + f(norm(h)).
    ("granite", {}, "model.layers.1.mlp", "not the pre-norm layer"),
    ("olmo2", {}, "model.layers.0.self_attn", "Olmo2DecoderLayer has no input_layernorm"),
    ("llama", {"mlp_bias": True}, "model.layers.0.mlp", "nn.Linear without a bias"),
    # transformers clamps gpt-oss's GLU at a limit of 0 too; moe_experts reads 0 as none
    ("gpt_oss", {"swiglu_limit": 0.0}, "model.layers.0.mlp", "alpha > 0 and limit > 0"),
])
def test_a_module_that_does_not_fit_stays_stock_and_says_why(family, config, module, why):
    ref = hf_model(family, **config)
    lm = PrefillLM(copy.deepcopy(ref))
    assert why in lm.kernels.table()[module], lm.kernels.table()
    assert lm.kernels.table()[module].startswith("stock: ")
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


def test_a_layer_scaling_its_branches_stays_stock_in_half_precision_too():
    # Granite's residual_multiplier: in bf16 the residual hid it within the tolerance.
    ref = hf_model("granite")
    lm = PrefillLM(copy.deepcopy(ref).to(torch.bfloat16))
    for half in ("self_attn", "mlp"):
        assert lm.kernels.table()[f"model.layers.1.{half}"].startswith("stock: "), \
            lm.kernels.table()
    with torch.no_grad():
        want = stock_logits(ref)
        got = lm(IDS, POS, seq_lens=LENS).float()
    assert (got - want).norm() / want.norm() < 0.02  # bf16 rounding, no branch dropped


@pytest.mark.parametrize("where", ["router", "block"])
def test_a_moe_block_with_routing_state_its_kernel_does_not_read_stays_stock(where):
    # A correction bias (Ernie 4.5's router, MiniMax-M2's block) steers the routing.
    ref = hf_model("qwen3_moe")
    model = copy.deepcopy(ref)
    for layer in model.model.layers:
        owner = layer.mlp.gate if where == "router" else layer.mlp
        owner.register_buffer("e_score_correction_bias", torch.zeros(4))
    lm = PrefillLM(model)
    assert lm.kernels.table()["model.layers.0.mlp"].startswith("stock: "), \
        lm.kernels.table()
    assert "e_score_correction_bias" in lm.kernels.table()["model.layers.0.mlp"]


def test_a_window_set_in_the_config_after_wrapping_is_refused_until_wrapped_again():
    # Mistral's attention reads config.sliding_window on every call; the cache's window
    # and the attention options were found at wrapping: calls, captures and an LLM refuse
    # the change (an LLM would free pages a global layer reads) until wrapped again.
    ids = torch.randint(0, VOCAB, (29,), generator=torch.Generator().manual_seed(0))
    lens = [20, 9]
    pos = torch.cat([torch.arange(n) for n in lens])
    ref = hf_model("mistral")
    lm = PrefillLM(copy.deepcopy(ref))
    for model in (ref, lm.hf_model):
        model.config.sliding_window = 4
    with pytest.raises(UnsupportedModel, match="config changed since PrefillLM wrapped"):
        graphcap.capture(lm, "full", max_tokens=32, max_requests=2)
    with pytest.raises(UnsupportedModel, match="wrap the model again"):
        graphcap.LLM(lm, max_batch=1, max_len=16, prefill_tokens=8, progress=False)
    lm = PrefillLM(lm.hf_model)
    runner = graphcap.capture(lm, "full", max_tokens=32, max_requests=2)
    with torch.no_grad():
        torch.testing.assert_close(runner(ids, pos, seq_lens=lens),
                                   stock_logits(ref, ids, lens), atol=1e-5, rtol=1e-5)
    assert "window" in lm.graphcap_attention_options


@pytest.mark.parametrize("vocab", [160, 100])
def test_a_vocabulary_resized_after_wrapping_is_refused_until_wrapped_again(vocab):
    # Token ids are checked against the vocabulary of wrapping (an eager call,
    # check_inputs, an LLM's prompts): grown, its new ids were refused as out of range;
    # shrunk, ids past its end passed and faulted in the embedding.
    ref = hf_model("llama")
    lm = PrefillLM(copy.deepcopy(ref))
    runner = graphcap.capture(lm, "full", max_tokens=16, max_requests=2)
    for model in (lm.hf_model, ref):
        model.resize_token_embeddings(vocab, mean_resizing=False)
    ref.load_state_dict(lm.hf_model.state_dict())  # the same new rows
    with torch.no_grad(), pytest.raises(UnsupportedModel, match=r"vocabulary changed since "
                                        r"PrefillLM wrapped it .*wrap the model again"):
        lm(IDS, POS, seq_lens=LENS)
    with pytest.raises(UnsupportedModel, match="vocabulary changed"):
        runner(IDS, POS, seq_lens=LENS)  # it captures again: the model changed
    with pytest.raises(UnsupportedModel, match="vocabulary changed"):
        graphcap.LLM(lm, max_batch=1, max_len=16, prefill_tokens=8, progress=False)
    lm = PrefillLM(lm.hf_model)
    ids = IDS % vocab
    ids[1] = vocab - 1
    with torch.no_grad():
        got = lm(ids, POS, seq_lens=LENS)
    assert got.shape == (8, vocab) and lm.vocab_size == vocab
    torch.testing.assert_close(got, stock_logits(ref, ids), atol=1e-5, rtol=1e-5)


def _halve_frequencies(rotary):
    rotary.inv_freq.mul_(0.5)  # e.g. a linear rope scale applied by hand


def _scale_attention(rotary):
    rotary.attention_scaling = 2.0  # e.g. a YaRN-style mscale set by hand


@pytest.mark.parametrize("edit", [_halve_frequencies, _scale_attention])
def test_rotary_frequencies_or_scaling_changed_after_wrapping_reach_the_kernels(edit):
    # The stock forward reads inv_freq and attention_scaling on every call.
    ref = hf_model("llama")
    lm = PrefillLM(copy.deepcopy(ref))
    with torch.no_grad():
        for model in (ref, lm.hf_model):
            edit(model.model.rotary_emb)
        runner = graphcap.capture(lm, "full", max_tokens=16, max_requests=2)
        torch.testing.assert_close(runner(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


def test_a_model_made_under_inference_mode_wraps_and_runs():
    # Its buffers are inference tensors, which keep no version counter.
    with torch.inference_mode():
        ref = hf_model("llama")
        lm = PrefillLM(copy.deepcopy(ref))
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "top"), [("llama", 4), ("qwen3", 8), ("gpt2", 4)])
def test_a_model_of_fewer_positions_than_the_probes_tokens_wraps_and_runs(family, top):
    # The probes run 16 tokens (the K/V shape probe 8): their positions stay below
    # max_position_embeddings, the rotary cache's length (GPT-2's position table's).
    ref = hf_model(family, **{"n_positions" if family == "gpt2" else
                              "max_position_embeddings": top})
    lm = PrefillLM(copy.deepcopy(ref))
    lm = PrefillLM(lm.hf_model)  # a second wrapper probes the substituted model
    if family != "gpt2":
        assert "0/" not in lm.kernels.summary(), lm.kernels.table()
    lens = [top, top - 1]
    ids = torch.randint(0, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    runner = graphcap.capture(lm, "full", max_tokens=16, max_requests=2)
    with torch.no_grad():
        for got in (lm(ids, pos, seq_lens=lens), runner(ids, pos, seq_lens=lens)):
            torch.testing.assert_close(got, stock_logits(ref, ids, lens), atol=1e-5,
                                       rtol=1e-5)


def test_a_rotary_pairing_the_structure_cannot_show_is_caught_by_the_probe():
    # Helium's layers look like Llama's, but rotate interleaved pairs of q and k.
    config = transformers.HeliumConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=16,
                                       max_position_embeddings=256)
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    lm = PrefillLM(copy.deepcopy(ref.eval()))
    assert "the attention half's q: the probe differs" in \
        lm.kernels.table()["model.layers.0.self_attn"]
    assert lm.kernels.table()["model.layers.0.mlp"].startswith("graphcap: ")
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), stock_logits(ref),
                                   atol=1e-5, rtol=1e-5)


def _storages(model) -> dict[int, int]:
    return {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
            for p in model.parameters()}


def test_fused_weights_are_the_model_s_own_memory_not_a_copy():
    hf = hf_model("qwen2")
    before = sum(_storages(hf).values())
    PrefillLM(hf)
    attn, mlp = hf.model.layers[0].self_attn, hf.model.layers[0].mlp
    for group in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
        storage = {m.weight.untyped_storage().data_ptr() for m in group}
        assert len(storage) == 1  # views of one fused tensor
    assert len({m.bias.untyped_storage().data_ptr() for m in
                (attn.q_proj, attn.k_proj, attn.v_proj)}) == 1
    assert sum(_storages(hf).values()) == before
    assert set(hf.state_dict()) == set(hf_model("qwen2").state_dict())


def test_weights_loaded_in_place_reach_the_kernels_and_the_graphs():
    ref, other = hf_model("qwen3"), hf_model("qwen3")
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.5)
    lm = PrefillLM(copy.deepcopy(ref))
    r = graphcap.capture(lm, "full", buckets=[8, 16], max_requests=2)
    r(IDS, POS, seq_lens=LENS)
    lm.hf_model.load_state_dict(other.state_dict())  # copies into the fused views
    want = stock_logits(other)
    with torch.no_grad():
        torch.testing.assert_close(lm(IDS, POS, seq_lens=LENS), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(r(IDS, POS, seq_lens=LENS), want, atol=1e-4, rtol=1e-4)
    assert r.report()["recaptures"] == 0


@pytest.mark.parametrize("strategy", GRAPHED)
def test_a_weight_assigned_anew_is_fused_again_and_the_runner_recaptures(strategy):
    ref = hf_model("llama")
    lm = PrefillLM(copy.deepcopy(ref))
    r = graphcap.capture(lm, strategy, buckets=[8, 16], max_requests=2)
    r(IDS, POS, seq_lens=LENS)
    new = torch.randn_like(ref.model.layers[1].self_attn.k_proj.weight)
    for model in (ref, lm.hf_model):
        model.model.layers[1].self_attn.k_proj.weight = nn.Parameter(new.clone())
    got = r(IDS, POS, seq_lens=LENS)
    assert r.report()["recaptures"] == 1
    torch.testing.assert_close(got, stock_logits(ref), atol=1e-4, rtol=1e-4)
    attn = lm.hf_model.model.layers[1].self_attn
    assert attn.k_proj.weight.untyped_storage().data_ptr() == \
        attn.q_proj.weight.untyped_storage().data_ptr()  # a view of the fused weight again


def test_a_model_cast_after_wrapping_runs_its_kernels_in_the_new_dtype():
    ref = hf_model("qwen3_moe")
    lm = PrefillLM(copy.deepcopy(ref))
    lm.hf_model.to(torch.bfloat16)  # every parameter a new tensor: no view of the fused
    ref.to(torch.bfloat16)
    with torch.no_grad():
        got = lm(IDS, POS, seq_lens=LENS)
    assert got.dtype == torch.bfloat16
    assert all(f.intact() and f.tensor.dtype == torch.bfloat16
               for _, layer in lm.kernels.layers for f in layer.fused())
    torch.testing.assert_close(got, stock_logits(ref), atol=0.05, rtol=0.05)


def test_a_mask_or_a_kv_cache_given_to_substituted_layers_is_refused():
    lm = PrefillLM(hf_model("llama"))
    ids = IDS[None, :4]
    with graphcap.packed([4], "cpu"), torch.no_grad():
        with pytest.raises(UnsupportedModel, match="attention mask"):
            lm.hf_model(input_ids=ids, use_cache=False,
                        attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))
        with pytest.raises(UnsupportedModel, match="KV cache"):
            lm.hf_model(input_ids=ids, use_cache=True)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_moe", "qwen2", "mistral",
                                    "mixtral", "phi3"])
def test_bf16_kernels_on_the_gpu_are_no_further_from_float32_than_stock_sdpa(family):
    # The truth: the same weights in float32 (stock, SDPA). Stock bf16 SDPA and graphcap's
    # bf16 kernels are each some distance from it; graphcap's must not be further.
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    shape = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 vocab_size=4096, max_position_embeddings=4096)
    if family == "qwen3_moe":
        shape.update(num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512)
    if family == "mixtral":
        shape.update(num_local_experts=8, num_experts_per_tok=2)
    if family in ("mistral", "mixtral", "phi3"):
        shape.update(sliding_window=None)
    if family == "phi3":
        del shape["head_dim"]  # hidden / heads: 64
        shape.update(pad_token_id=0)  # its default, 32000, is past this vocabulary
    config = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig,
              "qwen3_moe": transformers.Qwen3MoeConfig, "qwen2": transformers.Qwen2Config,
              "mistral": transformers.MistralConfig, "mixtral": transformers.MixtralConfig,
              "phi3": transformers.Phi3Config}[family](**shape)
    torch.manual_seed(0)
    with torch.device("cuda"):
        truth = transformers.AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa").eval()
    stock = copy.deepcopy(truth).to(torch.bfloat16)
    lm = PrefillLM(copy.deepcopy(stock))
    assert "0/" not in lm.kernels.summary(), lm.kernels.table()
    lens = [300, 200, 12]
    ids = torch.randint(0, config.vocab_size, (sum(lens),), device="cuda")
    pos = torch.cat([torch.arange(n) for n in lens]).cuda()
    with torch.inference_mode():
        want = torch.cat([truth(r[None]).logits[0] for r in ids.split(lens)])
        sdpa = torch.cat([stock(r[None]).logits[0] for r in ids.split(lens)]).float()
        ours = lm(ids, pos, seq_lens=lens).float()
    stock_err = float((sdpa - want).norm() / want.norm())
    ours_err = float((ours - want).norm() / want.norm())
    # Within 10% of stock's distance: which attention kernel runs (Triton, or FlashInfer
    # and FlashAttention-4 where installed) moves graphcap's by a few per cent.
    assert ours_err <= stock_err * 1.10, (ours_err, stock_err)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_a_moe_config_asking_for_router_logits_wraps_and_gives_the_stock_logits(family):
    # A checkpoint trained with the auxiliary loss may keep output_router_logits=True:
    # transformers then computed that loss over the routers' logits, which the MoE
    # kernels never produce (IndexError from inside transformers, when wrapping).
    ref = hf_model(family, output_router_logits=True)
    lm = PrefillLM(copy.deepcopy(ref))
    assert ops_of(lm)["moe_experts"] == 2
    runner = graphcap.capture(lm, "full", max_tokens=16, max_requests=2)
    with torch.no_grad():
        for got in (lm(IDS, POS, seq_lens=LENS), runner(IDS, POS, seq_lens=LENS)):
            torch.testing.assert_close(got, stock_logits(ref), atol=1e-4, rtol=1e-4)
