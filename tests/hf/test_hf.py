"""Stock transformers causal LMs under graphcap (``graphcap.hf``): packed requests give the
logits transformers gives each request alone, every strategy replays like eager, and
models or inputs that cannot run fail naming what was wrong."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import graphcap
from graphcap.api import GRAPHED, STRATEGIES
from graphcap.core.context import forward_context
from graphcap.errors import BadBatch, GraphcapError
from graphcap.opsdb.attention import get_backend
from graphcap.testing import assert_replay_equivalent, prefill_batches

transformers = pytest.importorskip("transformers")
from graphcap.hf import PrefillLM, UnsupportedModel  # noqa: E402  (needs transformers)
from tests.support.hf_families import FAMILIES, VOCAB, hf_model  # noqa: E402
from tests.support.runner_helpers import DEVICE  # noqa: E402

BUCKETS = [8, 16, 32]
SLOTS = 3
QUICK = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))


@functools.cache
def pair(family: str):
    """(transformers' model, PrefillLM over an identical copy of it)."""
    ref = hf_model(family)
    return ref, PrefillLM(copy.deepcopy(ref))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_packed_requests_give_the_logits_of_each_request_run_alone_in_transformers(family):
    # The semantic check: tokens of one request never see another's (transformers' own
    # eager attention, one request at a time, is the truth).
    ref, lm = pair(family)
    runner = graphcap.capture(lm, "eager")

    @settings(max_examples=6, **QUICK)
    @given(batch=prefill_batches(32, 4, VOCAB))
    def check(batch):
        ids, pos, lens = batch
        with torch.no_grad():
            want = torch.cat([ref(request[None]).logits[0]
                              for request in ids.split(lens) if request.numel()])
        torch.testing.assert_close(runner(ids, pos, seq_lens=lens), want, atol=1e-5,
                                   rtol=1e-5, msg=lambda m: f"{family} {lens}: {m}")

    check()


# tc_piecewise compiles each family's model (5-10 s a family on a CPU): here a family of
# each kind (q/k norms with experts, Gemma's scaled embedding and norms, GPT-2's fused
# q/k/v; llama's plain layers are tests/hf/test_hf_generate.py's); on CUDA, every family
# (and the CUDA-graph test below runs them all).
TC_PIECEWISE_ON_CPU = {"qwen3_moe", "gemma", "gpt2"}


def family_strategies() -> list:
    return [pytest.param(family, strategy, id=f"{family}-{strategy}")
            for family in sorted(FAMILIES) for strategy in GRAPHED
            if strategy != "tc_piecewise" or DEVICE == "cuda" or family in TC_PIECEWISE_ON_CPU]


@pytest.mark.parametrize(("family", "strategy"), family_strategies())
def test_every_family_replays_like_eager_under_every_strategy(family, strategy):
    _, lm = pair(family)
    # Each tc_piecewise runner compiles the model: fewer call sequences keep it quick.
    sequences = 1 if strategy == "tc_piecewise" else 2
    reports = assert_replay_equivalent(lm, [strategy], buckets=BUCKETS, max_requests=SLOTS,
                                       vocab=VOCAB, examples=4, sequences=sequences)
    assert reports[strategy]["shapes"] == BUCKETS


def test_a_compiled_packed_view_is_copied_only_where_its_static_strides_are_not_contiguous():
    from graphcap.compat.guards import contiguous

    projected = torch.randn(1, 5, 4 * 8).view(1, 5, 4, 8).transpose(1, 2)  # [1, H, T, D]
    rotated = torch.randn(1, 4, 5, 8)
    kept, copied = contiguous(projected[0].transpose(0, 1)), contiguous(rotated[0].transpose(0, 1))
    assert kept.data_ptr() == projected.data_ptr()
    assert copied.is_contiguous() and copied.data_ptr() != rotated.data_ptr()
    torch.testing.assert_close(copied, rotated[0].transpose(0, 1))


def test_one_tc_piecewise_compile_of_a_stock_model_serves_every_bucket_one_token_included():
    # GPT-2's attention hands graphcap [1, H, T, D] views: made contiguous without a guard
    # on T (graphcap.compat.guards.contiguous), else the one-token bucket compiled again.
    ref, lm = pair("gpt2")
    r = graphcap.capture(lm, "tc_piecewise", buckets=[1, 2, 8], max_requests=2)
    for lens in ([1], [2], [3, 4]):
        ids = torch.randint(1, VOCAB, (sum(lens),))
        pos = torch.cat([torch.arange(n) for n in lens])
        with torch.no_grad():
            want = torch.cat([ref(request[None]).logits[0] for request in ids.split(lens)])
        torch.testing.assert_close(r(ids, pos, seq_lens=lens), want, atol=1e-5, rtol=1e-5)
    assert r.model.compiler.stats["graphs"] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_replays_like_eager_on_cuda_graphs(family):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    lm = PrefillLM(hf_model(family, dtype=torch.bfloat16).cuda())
    reports = assert_replay_equivalent(lm, GRAPHED,
                                       buckets=BUCKETS, max_requests=SLOTS, vocab=VOCAB,
                                       examples=4, sequences=1)
    assert all(r["graph_kind"] == "cuda" for r in reports.values())


def test_positions_drive_the_rotary_embedding_as_position_ids_do_in_transformers():
    # Rotary is shift-invariant, so packing alone cannot tell positions from an arange:
    # gaps can.
    ref, lm = pair("qwen3")
    ids, pos = torch.tensor([5, 6, 7, 8, 9]), torch.tensor([0, 3, 4, 9, 20])
    with torch.no_grad():
        want = ref(ids[None], position_ids=pos[None]).logits[0]
        shifted = ref(ids[None]).logits[0]
    got = graphcap.capture(lm, "full", buckets=[8], max_requests=1)(ids, pos, seq_lens=[5])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, shifted, atol=1e-3)


def test_calling_the_wrapper_eagerly_needs_seq_lens_or_a_runner():
    _, lm = pair("llama")
    ids, pos = torch.tensor([5, 6, 7]), torch.arange(3)
    with pytest.raises(GraphcapError, match=r"graphcap\.packed\(seq_lens"):
        lm(ids, pos)
    assert lm(ids, pos, seq_lens=[3]).shape == (3, VOCAB)


def test_input_ids_with_a_batch_dim_are_rejected_naming_both_shapes():
    _, lm = pair("llama")
    with pytest.raises(BadBatch, match=r"\(1, 3\) and \(3,\)"):
        lm(torch.tensor([[5, 6, 7]]), torch.arange(3), seq_lens=[3])


def test_an_attention_mask_is_refused_not_ignored():
    # Request boundaries come from seq_lens; a mask graphcap would drop must not pass.
    _, lm = pair("llama")
    meta = get_backend(None, "cpu").prepare([4], "cpu")
    with forward_context(attention=meta), pytest.raises(UnsupportedModel, match="mask"):
        lm.hf_model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_cache=False,
                    attention_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_a_module_that_is_not_a_transformers_model_is_rejected():
    with pytest.raises(UnsupportedModel, match="not a transformers PreTrainedModel"):
        PrefillLM(torch.nn.Linear(4, 4))


def test_a_model_without_an_lm_head_is_rejected_naming_its_class():
    base = transformers.AutoModel.from_config(FAMILIES["llama"]())
    with pytest.raises(UnsupportedModel, match="LlamaModel is not a decoder-only causal LM"):
        PrefillLM(base)


def test_a_qwen2_sliding_window_layer_attends_as_transformers_does():
    config = dict(use_sliding_window=True, sliding_window=4, max_window_layers=1,
                  layer_types=["full_attention", "sliding_attention"])
    ref = hf_model("qwen2", **config)
    lm = PrefillLM(copy.deepcopy(ref))
    assert lm.graphcap_attention_options == ("window",)
    ids = torch.randint(0, VOCAB, (15,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.cat([ref(r[None]).logits[0] for r in ids.split([9, 6])])
        got = lm(ids, torch.cat([torch.arange(9), torch.arange(6)]), seq_lens=[9, 6])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_rotary_scaled_from_the_batch_s_largest_position_is_rejected():
    # Dynamic NTK rescales from max(position_ids): packed requests would change each other.
    model = hf_model("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                               "rope_theta": 10000.0})
    with pytest.raises(UnsupportedModel, match="rope_type 'dynamic'"):
        PrefillLM(model)


def test_a_rotary_whose_config_says_dynamic_but_whose_frequencies_are_fixed_is_served():
    # HunYuan's checkpoints label NTK-alpha scaling "dynamic"; with a fixed alpha its
    # rotary embedding runs rope_type "ntk_alpha", which no position of the batch rescales.
    config = transformers.HunYuanDenseV1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, rope_parameters={"rope_type": "dynamic", "alpha": 1000.0,
                                                      "factor": 1.0, "rope_theta": 10000.0})
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config,
                                                        attn_implementation="eager").eval()
    assert ref.model.rotary_emb.rope_type == "ntk_alpha"
    lm = PrefillLM(copy.deepcopy(ref))
    ids = torch.randint(0, VOCAB, (15,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.cat([ref(r[None]).logits[0] for r in ids.split([9, 6])])
        got = lm(ids, torch.cat([torch.arange(9), torch.arange(6)]), seq_lens=[9, 6])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_model_whose_attention_cannot_be_switched_is_rejected():
    # Bloom's attention does not go through transformers' AttentionInterface.
    bloom = transformers.AutoModelForCausalLM.from_config(
        transformers.BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=1, n_head=4))
    with pytest.raises(UnsupportedModel, match="BloomForCausalLM cannot switch"):
        PrefillLM(bloom)


def test_an_experts_implementation_that_syncs_is_rejected_before_anything_changes():
    model = hf_model("qwen3_moe")
    with pytest.raises(UnsupportedModel, match="experts='eager' cannot be captured"):
        PrefillLM(model, experts="eager")
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_an_experts_implementation_of_no_name_is_refused_on_any_model(family):
    with pytest.raises(UnsupportedModel, match="experts='grouped' cannot be captured "
                                               r"\(no experts implementation of that name"):
        PrefillLM(hf_model(family), experts="grouped")


@pytest.mark.gpu
def test_a_qwen3_0_6b_shaped_model_replays_like_eager_on_cuda_graphs():
    config = transformers.Qwen3Config(
        vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
        rope_theta=1e6, max_position_embeddings=40960, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lm = PrefillLM(model)
    # 28 bf16 layers: a padded bucket's matmuls round differently from eager's unpadded
    # ones. On the H200 batch [31, 42] (bucket 128) differed from eager by 0.0625 in its
    # logits under all three strategies alike, each bit for bit equal to the others.
    reports = assert_replay_equivalent(lm, GRAPHED,
                                       buckets=[64, 128, 256], max_requests=4,
                                       vocab=config.vocab_size, examples=4, sequences=1,
                                       atol=0.1)
    for strategy, report in reports.items():
        assert report["graph_kind"] == "cuda", strategy
        assert report["shapes"] == [64, 128, 256], strategy


@pytest.mark.gpu
def test_a_qwen3_moe_model_replays_its_grouped_mm_experts_like_eager_on_cuda_graphs():
    config = transformers.Qwen3MoeConfig(
        vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, num_experts=32,
        num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    lm = PrefillLM(model)
    assert model.config._experts_implementation == "grouped_mm"
    reports = assert_replay_equivalent(lm, GRAPHED,
                                       buckets=[64, 128, 256], max_requests=4,
                                       vocab=config.vocab_size, examples=4, sequences=1)
    assert all(r["graph_kind"] == "cuda" for r in reports.values())


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_gives_last_token_logits_under_full(family):
    every = PrefillLM(hf_model(family))
    last = PrefillLM(hf_model(family), logits="last")
    r = graphcap.capture(last, "full", buckets=BUCKETS, max_requests=SLOTS,
                         attention="torch_masked")
    lens = [5, 3, 9]
    ids = torch.randint(1, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(2))
    pos = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        want = every(ids, pos, seq_lens=lens)[torch.tensor(lens).cumsum(0) - 1]
    torch.testing.assert_close(r(ids, pos, seq_lens=lens), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_last_token_logits_are_the_last_rows_of_every_token_s_logits(strategy):
    # logits="last": one row per request through the LM head, never [T, vocab].
    every = PrefillLM(hf_model("qwen3"))
    last = PrefillLM(hf_model("qwen3"), logits="last")
    r = graphcap.capture(last, strategy, buckets=BUCKETS, max_requests=SLOTS,
                         attention="torch_masked")
    for lens in ([5, 3], [16], [2, 9, 4], [7, 7, 7, 7]):  # the last: more than the slots
        ids = torch.randint(1, VOCAB, (sum(lens),), generator=torch.Generator().manual_seed(1))
        pos = torch.cat([torch.arange(n) for n in lens])
        rows = torch.tensor(lens).cumsum(0) - 1
        with torch.no_grad():
            want = every(ids, pos, seq_lens=lens)[rows]
        got = r(ids, pos, seq_lens=lens)
        assert got.shape == (len(lens), VOCAB)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="choose 'all'"):
        PrefillLM(hf_model("qwen3"), logits="first")


def _came_as(hf):
    config = hf.config
    return (config._attn_implementation, getattr(config, "_experts_implementation", None),
            hf.training)


def test_release_gives_the_model_back_as_it_came_to_its_first_wrapper():
    hf = hf_model("llama").to(DEVICE).train()
    came = _came_as(hf)
    ids = torch.tensor([[5, 9, 2, 7]], device=DEVICE)
    first, second = PrefillLM(hf), PrefillLM(hf)
    second.release()  # the second came on graphcap's attention: the model goes back as
    assert _came_as(hf) == came  # it came to the first
    with pytest.raises(UnsupportedModel, match="was released .*wrap it again"):
        first(ids[0], torch.arange(4, device=DEVICE), seq_lens=[4])
    with pytest.raises(UnsupportedModel, match="was released"):
        first.kernels.summary()
    hf.eval()
    with torch.no_grad():
        stock = hf(ids).logits
        lm = PrefillLM(hf)  # wrapped again: serves
        torch.testing.assert_close(lm(ids[0], torch.arange(4, device=DEVICE), seq_lens=[4]),
                                   stock[0], atol=1e-5, rtol=1e-5)


def test_a_refused_model_keeps_its_experts_implementation_and_train_mode():
    hf = hf_model("deepseek_v3").to(DEVICE).train()  # MLA: keys and values of two head dims
    came = _came_as(hf)
    with pytest.raises(UnsupportedModel):
        PrefillLM(hf)
    assert _came_as(hf) == came




@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])  # refused, wrapped
def test_each_module_gets_its_own_train_mode_back(family):
    """A model in train mode with a part in eval (frozen, say) comes back so: refused,
    or released."""
    hf = hf_model(family).to(DEVICE).train()
    hf.model.layers[0].eval()
    modes = [m.training for m in hf.modules()]
    try:
        PrefillLM(hf).release()
    except UnsupportedModel:  # MLA: keys and values of two head dims
        pass
    assert [m.training for m in hf.modules()] == modes

@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_gpt2_naming_a_pad_token_captures_and_gets_its_padding_warning_back(strategy):
    """GPT-2's forward, given no attention mask, looks for pad_token_id among the ids on
    the host (to warn of padding): packed requests hold none, so a wrapped model skips
    the look and captures; release() gives the model its warning back."""
    ref = hf_model("gpt2", pad_token_id=0).to(DEVICE)
    model = copy.deepcopy(ref)
    lm = PrefillLM(model)
    runner = graphcap.capture(lm, strategy, max_tokens=16, max_requests=2)
    lens = [7, 5]
    ids = torch.randint(0, VOCAB, (12,), generator=torch.Generator().manual_seed(3))
    ids, pos = ids.to(DEVICE), torch.cat([torch.arange(n) for n in lens]).to(DEVICE)
    with torch.no_grad():
        want = torch.cat([ref(r[None]).logits[0] for r in ids.split(lens)])
        torch.testing.assert_close(runner(ids, pos, seq_lens=lens), want, atol=1e-5,
                                   rtol=1e-5)
    lm.release()
    assert not any("warn_if_padding_and_no_attention_mask" in vars(m)
                   for m in model.modules())
