"""graphcap.hf on the paths a user takes after wrapping a stock model: shared and tied
weights, two wrappers of one model, modules swapped in later (an adapter, another rotary
embedding), the model switched back to its own attention (and its wrapper then refused),
transformers' generate() on the wrapped model, a refused model, gradients,
another library's forward hooks and bad eager calls. Each gives the stock model's result
or a clear error, and leaves the model as the user's."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import graphcap

transformers = pytest.importorskip("transformers")
from graphcap.errors import BadBatch, GraphcapError  # noqa: E402
from graphcap.hf import PrefillLM, UnsupportedModel  # noqa: E402  (needs transformers)
from graphcap.hf.kernels import restore  # noqa: E402
from tests.support.hf_families import VOCAB, hf_model  # noqa: E402

IDS = torch.randint(0, VOCAB, (8,), generator=torch.Generator().manual_seed(5))
POS = torch.cat([torch.arange(5), torch.arange(3)])
LENS = [5, 3]


def stock_logits(ref, ids=IDS, lens=LENS):
    with torch.no_grad():
        return torch.cat([ref(r[None], use_cache=False).logits[0] for r in ids.split(lens)])


def assert_stock(got, ref):
    torch.testing.assert_close(got, stock_logits(ref), atol=1e-5, rtol=1e-5)


def eager_and_full(lm):
    """The wrapper's eager logits and a full runner's."""
    with torch.no_grad():
        eager = lm(IDS, POS, seq_lens=LENS)
    runner = graphcap.capture(lm, "full", buckets=[8, 16], max_requests=2)
    return eager, runner(IDS, POS, seq_lens=LENS)


class Adapter(nn.Linear):
    """A LoRA-style layer: the base projection plus a low-rank update."""

    def __init__(self, base: nn.Linear, rank: int = 2):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None)
        self.weight, self.bias = base.weight, base.bias
        self.a = nn.Parameter(torch.randn(rank, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, rank) * 0.1)

    def forward(self, x):
        return super().forward(x) + x @ self.a.T @ self.b.T


@pytest.mark.parametrize("share", ["one layer twice", "one gate_proj in two layers"])
def test_layers_sharing_a_module_stay_stock_and_keep_the_users_weights(share):
    ref = hf_model("llama")
    if share == "one layer twice":
        ref.model.layers[1] = ref.model.layers[0]
    else:
        ref.model.layers[1].mlp.gate_proj = ref.model.layers[0].mlp.gate_proj
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    layer = 0 if share == "one layer twice" else 1  # a module is named by its first path
    assert "shared with another part of the model" in lm.kernels.table()[
        f"model.layers.{layer}.mlp"]
    for got in eager_and_full(lm):
        assert_stock(got, ref)
    for name, p in ref.state_dict().items():
        torch.testing.assert_close(hf.state_dict()[name], p, atol=0, rtol=0)


def test_tied_weights_stay_tied_after_wrapping():
    ref = hf_model("llama")
    ref.model.layers[1].mlp.up_proj.weight = ref.model.layers[0].mlp.up_proj.weight
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    assert hf.model.layers[1].mlp.up_proj.weight is hf.model.layers[0].mlp.up_proj.weight
    assert "tied to another parameter" in lm.kernels.table()["model.layers.0.mlp"]
    with torch.no_grad():
        for model in (hf, ref):
            model.model.layers[0].mlp.up_proj.weight.mul_(3.0)
    for got in eager_and_full(lm):
        assert_stock(got, ref)


def test_two_wrappers_of_one_model_share_its_kernels_and_see_its_updates():
    ref, hf = hf_model("llama"), hf_model("llama")
    every, last = PrefillLM(hf), PrefillLM(hf, logits="last")
    assert every.kernels is last.kernels
    # New weights at the model's scale (std-1 weights round past the tolerance).
    new = {k: v + 0.02 * torch.randn_like(v) for k, v in hf.state_dict().items()}
    hf.load_state_dict(new)
    ref.load_state_dict(new)
    with torch.no_grad():
        assert_stock(every(IDS, POS, seq_lens=LENS), ref)
        torch.testing.assert_close(last(IDS, POS, seq_lens=LENS),
                                   stock_logits(ref)[[4, 7]], atol=1e-5, rtol=1e-5)
    PrefillLM(hf, kernels="stock")  # switches the model, so every wrapper of it says so
    assert every.kernels.summary() == "no module on graphcap kernels"


def test_a_second_wrapper_of_a_model_on_graphcap_kernels_generates_as_the_first():
    # The second finds the K/V shapes the cache takes on the first's substituted layers.
    hf = hf_model("llama")
    first = PrefillLM(hf, logits="last")
    second = PrefillLM(hf, logits="last")
    assert second.kv_shapes == first.kv_shapes == {0: (2, 16), 1: (2, 16)}
    prompts = [[5, 9, 2], [3, 4]]
    assert graphcap.generate(second, prompts, 3, strategy="eager").tokens == \
        graphcap.generate(first, prompts, 3, strategy="eager").tokens


@pytest.mark.parametrize("swap", ["q_proj: a new nn.Linear", "o_proj: an adapter",
                                  "down_proj: an adapter", "another rotary embedding"])
def test_modules_replaced_after_wrapping_are_recognised_again(swap):
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    for model in (hf, ref):
        torch.manual_seed(1)
        layer = model.model.layers[0]
        if swap.startswith("q_proj"):
            layer.self_attn.q_proj = nn.Linear(64, 64, bias=False)
        elif swap.startswith("o_proj"):
            layer.self_attn.o_proj = Adapter(layer.self_attn.o_proj)
        elif swap.startswith("down_proj"):
            layer.mlp.down_proj = Adapter(layer.mlp.down_proj)
        else:
            config = copy.deepcopy(model.config)
            config.rope_parameters = {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 10000.0}
            model.model.rotary_emb = type(model.model.rotary_emb)(config)
    for got in eager_and_full(lm):
        assert_stock(got, ref)
    if "adapter" in swap:  # a subclass of nn.Linear may compute otherwise: stock
        half = "self_attn" if swap.startswith("o_proj") else "mlp"
        assert lm.kernels.table()[f"model.layers.0.{half}"].startswith("stock")


@pytest.mark.parametrize("attribute", ["input_layernorm.variance_epsilon",
                                       "self_attn.scaling"])
def test_a_modules_python_value_set_after_wrapping_is_recognised_again(attribute):
    """The kernels standing in for a half read its Python values (an eps, a scale) at
    recognition: one set since is a change, as a module replaced is."""
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    owner, name = attribute.split(".")
    for model in (hf, ref):
        setattr(getattr(model.model.layers[1], owner), name, 0.5)
    for got in eager_and_full(lm):
        assert_stock(got, ref)


def _torch_rms_norm(model):
    """The final norm as torch's own nn.RMSNorm, of the same weight and eps."""
    stock = model.model.norm
    model.model.norm = nn.RMSNorm(stock.weight.shape[0], eps=stock.variance_epsilon)
    model.model.norm.weight = stock.weight


@pytest.mark.parametrize("attribute", ["embed_tokens.max_norm", "norm.eps"])
def test_a_torch_modules_python_value_set_after_wrapping_is_recognised_again(attribute):
    """torch's own modules graphcap stands in for (nn.Embedding's gather, nn.RMSNorm's
    rms_norm) read their values at recognition too: a max_norm or eps set since is a
    change (the gather ignored a max_norm set after wrapping: logits 0.47 off)."""
    ref = hf_model("llama")
    if attribute == "norm.eps":
        _torch_rms_norm(ref)
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    owner, name = attribute.split(".")
    assert lm.kernels.table()[f"model.{owner}"].startswith("graphcap"), lm.kernels.table()
    for model in (hf, ref):
        setattr(getattr(model.model, owner), name, 0.01 if name == "max_norm" else 0.5)
    for got in eager_and_full(lm):
        assert_stock(got, ref)


def test_the_wrapper_is_in_eval_mode_so_its_eval_after_capture_changes_nothing():
    # A runner compares the captured model's train flag on every call: the wrapper's own,
    # left in train mode, made lm.eval() a change (ModelChanged here, else a recapture).
    lm = PrefillLM(hf_model("llama"))
    assert not lm.training and not lm.hf_model.training
    runner = graphcap.capture(lm, "full", buckets=[8, 16], max_requests=2,
                              on_change="error")
    want = runner(IDS, POS, seq_lens=LENS)
    lm.eval()
    torch.testing.assert_close(runner(IDS, POS, seq_lens=LENS), want)
    assert runner.report()["recaptures"] == 0


def test_the_model_switched_back_to_its_own_attention_runs_as_stock():
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    PrefillLM(hf)
    hf.set_attn_implementation("eager")
    ids = IDS[None, :5]
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids).logits, atol=1e-5, rtol=1e-5)
        mask = torch.ones(2, 5, dtype=torch.long)
        torch.testing.assert_close(hf(ids.expand(2, 5), attention_mask=mask).logits,
                                   ref(ids.expand(2, 5), attention_mask=mask).logits,
                                   atol=1e-5, rtol=1e-5)
    assert hf.generate(ids, max_new_tokens=3, do_sample=False).tolist() == \
        ref.generate(ids, max_new_tokens=3, do_sample=False).tolist()


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_transformers_generate_on_a_wrapped_model_says_how_to_generate(kernels):
    # Neither call can work on graphcap attention; the error says what does.
    hf = hf_model("llama")
    PrefillLM(hf, kernels=kernels)
    ids = IDS[None, :5]
    for call in (lambda: hf.generate(ids, max_new_tokens=3, do_sample=False),
                 lambda: hf(ids), lambda: hf(ids, use_cache=False)):
        with pytest.raises(UnsupportedModel, match=r"graphcap\.generate\(PrefillLM\(model, "
                           r"logits='last'\).*model\.set_attn_implementation\('sdpa'\)"):
            call()


@pytest.mark.parametrize("strategy", ["eager", "full", "breakable"])
def test_a_wrapped_model_switched_to_another_attention_is_refused_naming_it(strategy):
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    hf.set_attn_implementation("sdpa")
    with pytest.raises(UnsupportedModel, match=r"LlamaForCausalLM's attention implementation "
                       r"is 'sdpa', not graphcap's.*set_attn_implementation\('graphcap'\)"):
        graphcap.capture(lm, strategy, buckets=[8, 16], max_requests=2)(IDS, POS,
                                                                        seq_lens=LENS)
    hf.set_attn_implementation("graphcap")  # as the message says
    runner = graphcap.capture(lm, strategy, buckets=[8, 16], max_requests=2)
    assert_stock(runner(IDS, POS, seq_lens=LENS), ref)


def test_a_wrapped_moe_model_switched_to_eager_experts_is_refused_at_capture():
    ref = hf_model("qwen3_moe")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    hf.set_experts_implementation("eager")
    with torch.no_grad():  # eager calls are exact with any experts
        assert_stock(lm(IDS, POS, seq_lens=LENS), ref)
    with pytest.raises(UnsupportedModel, match=r"experts implementation is 'eager', not "
                       r"'batched_mm'.*set_experts_implementation\('batched_mm'\)"):
        graphcap.capture(lm, "full", buckets=[8, 16], max_requests=2)


@pytest.mark.parametrize(("family", "config", "dtype", "match"), [
    ("llama", {"layer_types": ["chunked_attention", "full_attention"],
               "attention_chunk_size": 4}, torch.float32, "chunked_attention"),
    ("llama", {}, torch.float64, "float64"),
])
def test_a_refused_model_is_left_as_it_came(family, config, dtype, match):
    hf = hf_model(family, dtype=dtype, **config)
    before = hf.config._attn_implementation
    with pytest.raises(UnsupportedModel, match=match):
        PrefillLM(hf)
    assert hf.config._attn_implementation == before
    assert not any("forward" in m.__dict__ for m in hf.modules())
    with torch.no_grad():
        hf(IDS[None, :5].clone())


def test_gradients_in_grad_mode_are_the_stock_models():
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf)
    lm(IDS, POS, seq_lens=LENS).square().sum().backward()
    torch.cat([ref(r[None]).logits[0] for r in IDS.split(LENS)]).square().sum().backward()
    for (name, p), q in zip(hf.named_parameters(), ref.parameters(), strict=True):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_another_librarys_forward_hooks_are_left_in_place():
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    calls = []
    hooked = [hf.model.norm, hf.model.layers[0], hf.model.embed_tokens]
    def hook(module):  # what accelerate's add_hook_to_module does
        old, name = module.forward, type(module).__name__

        def forward(*args, **kwargs):
            calls.append(name)
            return old(*args, **kwargs)

        module.forward = functools.update_wrapper(forward, old)

    for module in hooked:
        hook(module)
    lm = PrefillLM(hf)
    assert lm.kernels.table()["model.layers.0.self_attn"].startswith("stock")
    calls.clear()
    with torch.no_grad():
        assert_stock(lm(IDS, POS, seq_lens=LENS), ref)
    assert sorted(calls) == ["Embedding", "LlamaDecoderLayer", "LlamaRMSNorm"]
    restore(hf)
    assert all("forward" in m.__dict__ for m in hooked)


@pytest.mark.parametrize(("ids", "pos", "lens", "logits", "match"), [
    (IDS[:4], torch.arange(4), [0, 4], "last", "zero-length request"),
    (torch.tensor([-1, 3, 4]), torch.arange(3), [3], "all", r"input_ids range over \[-1"),
    (IDS[:3], torch.arange(255, 258), [3], "all", r"positions range over \[255, 257\]"),
    (IDS[:0], IDS[:0], [0, 0], "all", "empty batch"),
])
def test_bad_eager_calls_are_refused_with_what_was_wrong(ids, pos, lens, logits, match):
    lm = PrefillLM(hf_model("llama"), logits=logits)
    with pytest.raises(BadBatch, match=match), torch.no_grad():
        lm(ids, pos, seq_lens=lens)


@pytest.mark.parametrize("family", ["laguna", "mellum"])
def test_a_rotary_embedding_of_another_call_leaves_its_layers_stock_and_matches(family):
    # These call their rotary embedding with a layer type: no probe can run their layers,
    # so neither half takes graphcap's kernels (the wrap raised TypeError), and the model
    # still computes what it computes stock.
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if family not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    config = AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                          dtype=torch.float32).eval()
    ids = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids[None], position_ids=torch.arange(9)[None]).logits[0]
    lm = PrefillLM(copy.deepcopy(hf))
    parts = [p for p in lm.kernels.parts if p.kind in ("attention", "mlp")]
    assert parts and not any(p.graphcap for p in parts)
    assert all("rotary embedding is called otherwise" in p.what for p in parts)
    with torch.no_grad():
        torch.testing.assert_close(lm(ids, torch.arange(9), seq_lens=[9]), want,
                                   atol=1e-4, rtol=1e-4)


class Doubled(nn.Linear):
    """An nn.Linear whose output is doubled: what a module's class swapped in place gives."""

    def forward(self, x):
        return super().forward(x) * 2


def _change(module, how: str, calls: list) -> None:
    """Make calling ``module`` more than its weights: ``how`` it is changed."""
    def record(*_):
        calls.append(type(module).__name__)

    if how == "a steering forward hook":
        module.register_forward_hook(lambda m, args, out: out + 1.0)
    elif how == "a pre-hook":
        module.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    elif how == "a recording forward hook":
        module.register_forward_hook(record)
    elif how == "a forward set on the instance":
        old = module.forward
        module.forward = lambda x: (record(), old(x))[1]
    else:
        module.__class__ = Doubled


# (A class swapped before wrapping is no nn.Linear, which recognition refuses already.)
@pytest.mark.parametrize(("how", "when"), [
    (how, when) for how in ("a steering forward hook", "a pre-hook",
                            "a recording forward hook", "a forward set on the instance")
    for when in ("before wrapping", "after wrapping")] + [
    ("its class swapped", "after wrapping")])
def test_a_module_inside_a_half_called_with_more_than_its_weights_keeps_the_half_stock(
        how, when):
    # graphcap's kernels read a half's weights and call none of its modules: a hook on
    # q_proj or down_proj (steering, activation patching, recording) never ran, and one
    # added after wrapping went unseen too.
    ref = hf_model("llama")
    hf = copy.deepcopy(ref)
    lm = PrefillLM(hf) if when == "after wrapping" else None
    calls = []
    for model in (ref, hf):
        _change(model.model.layers[0].self_attn.q_proj, how, calls)
        _change(model.model.layers[1].mlp.down_proj, how, calls)
    if lm is None:
        lm = PrefillLM(hf)
    with torch.no_grad():
        lm(IDS, POS, seq_lens=LENS)  # recognised again (probes run the hooks too)
        calls.clear()
        got = lm(IDS, POS, seq_lens=LENS)
    assert len(calls) == (2 if "record" in how or "instance" in how else 0)
    assert_stock(got, ref)
    for half in ("model.layers.0.self_attn", "model.layers.1.mlp"):
        assert lm.kernels.table()[half].startswith("stock"), lm.kernels.table()
    for half in ("model.layers.1.self_attn", "model.layers.0.mlp"):
        assert lm.kernels.table()[half].startswith("graphcap"), lm.kernels.table()


def test_transformers_output_capturing_hooks_leave_the_kernels_in():
    # The first call asking for hidden states or attentions hooks every attention module
    # for good; they capture nothing in graphcap's calls.
    ref = hf_model("llama")
    lm = PrefillLM(copy.deepcopy(ref))
    with torch.no_grad(), graphcap.packed(LENS, "cpu"):
        lm.hf_model(input_ids=IDS[None], position_ids=POS[None], use_cache=False,
                    output_hidden_states=True, output_attentions=True)
    assert lm.hf_model.model.layers[0].self_attn._forward_hooks
    with torch.no_grad():
        assert_stock(lm(IDS, POS, seq_lens=LENS), ref)
    assert "0/" not in lm.kernels.summary(), lm.kernels.table()


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_a_model_cast_to_a_dtype_graphcap_does_not_run_after_wrapping_is_refused(kernels):
    # Refused when wrapped; cast after, a call failed inside an op ("attention: q has
    # dtype torch.float64") or a backend's choice, not naming the model or the way back.
    lm = PrefillLM(hf_model("llama"), kernels=kernels)
    lm.hf_model.to(torch.float64)
    with pytest.raises(UnsupportedModel, match=r"LlamaForCausalLM is in float64; .*"
                       r"hf_model.to\(torch.float32\)"), torch.no_grad():
        lm(IDS, POS, seq_lens=LENS)
    with pytest.raises(GraphcapError, match="float64"):  # a backend's choice says so first
        graphcap.capture(lm, "full", max_tokens=16, max_requests=2)
    lm.hf_model.to(torch.float32)
    with torch.no_grad():
        assert lm(IDS, POS, seq_lens=LENS).dtype == torch.float32


def test_a_model_cast_after_wrapping_is_probed_again_in_its_new_dtype():
    # Probed in bf16 (2e-2) and cast to float32, its kernels were never held to float32's
    # 1e-5 nor its logits to the stock model's; and a later recognition probed under an
    # attention backend picked for bf16 (on a GPU, FlashAttention's: bf16 and fp16 only).
    ref = hf_model("llama").to(torch.bfloat16)
    lm = PrefillLM(copy.deepcopy(ref))
    for model in (ref, lm.hf_model):
        model.to(torch.float32)
    with torch.no_grad():
        assert_stock(lm(IDS, POS, seq_lens=LENS), ref)
    assert lm.kernels.dtype == torch.float32
    lm.hf_model.model.layers[0].self_attn.q_proj.register_forward_hook(lambda *_: None)
    with torch.no_grad():
        lm(IDS, POS, seq_lens=LENS)  # recognised again: the hook
    assert lm.kernels.dtype == torch.float32
