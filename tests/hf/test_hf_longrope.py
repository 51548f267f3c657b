"""LongRoPE (``rope_type`` ``"longrope"``, as Phi-3-mini-128k and Phi-3.5-mini ship):
transformers' rotary takes the short factors while a batch's positions stay below
``original_max_position_embeddings`` and the long ones, for the whole batch, past it.
graphcap serves the positions below it, where each request's rotary is the short factors
whatever is packed beside it, as transformers gives one request alone: greedy generation
equals transformers' own; a position past it is refused, naming the limit."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

import graphcap

transformers = pytest.importorskip("transformers")
from graphcap.errors import BadBatch, UnsupportedModel  # noqa: E402
from graphcap.hf import PrefillLM, rotary  # noqa: E402  (needs transformers)
from tests.hf.test_hf_generate import NEW, PROMPTS, transformers_greedy  # noqa: E402
from tests.support.hf_families import hf_model  # noqa: E402
from tests.support.runner_helpers import DEVICE  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []

SHORT = 32  # original_max_position_embeddings; max_position_embeddings is 256
HALF = 8  # rotary frequencies of a 16-wide head


def phi3_longrope(**config):
    rope = dict(rope_type="longrope", rope_theta=10000.0,
                short_factor=[1.0 + 0.25 * i for i in range(HALF)],
                long_factor=[4.0 + 2.0 * i for i in range(HALF)],
                original_max_position_embeddings=SHORT)
    return hf_model("phi3", rope_parameters=rope, original_max_position_embeddings=SHORT,
                    initializer_range=0.5, **config).to(DEVICE)


def stock_logits(model, ids):
    with torch.no_grad():
        return model(ids[None].to(DEVICE)).logits[0]


def test_transformers_switches_a_whole_batch_to_the_long_factors_past_the_short_span():
    """What graphcap must not pack across: a request's logits change when another in its
    batch reaches past the short span."""
    model = phi3_longrope()
    ids = torch.randint(3, 128, (SHORT + 8,), generator=torch.Generator().manual_seed(0))
    alone = stock_logits(model, ids[:12])
    with torch.no_grad():
        beside_long = model(ids[None].to(DEVICE)).logits[0, :12]
    assert not torch.allclose(alone, beside_long, atol=1e-3)


@pytest.mark.parametrize("kernels", ["graphcap", "stock"])
def test_packed_requests_take_the_short_factors_each_as_alone(kernels):
    ref = phi3_longrope()
    lm = PrefillLM(copy.deepcopy(ref), kernels=kernels)
    assert lm.max_position == SHORT
    lengths = [SHORT, 7, 19]
    ids = torch.randint(3, 128, (sum(lengths),), generator=torch.Generator().manual_seed(1))
    want = torch.cat([stock_logits(ref, r) for r in ids.split(lengths)])
    positions = torch.cat([torch.arange(n) for n in lengths])
    with torch.no_grad():
        got = lm(ids.to(DEVICE), positions.to(DEVICE), seq_lens=lengths)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_a_position_past_the_short_span_is_refused_naming_it():
    lm = PrefillLM(phi3_longrope())
    ids = torch.arange(3, SHORT + 4, device=DEVICE)
    with pytest.raises(BadBatch, match=f"past the model's max_position {SHORT}"):
        lm(ids, torch.arange(ids.numel(), device=DEVICE), seq_lens=[ids.numel()])
    with pytest.raises(ValueError, match=f"max_position {SHORT}"):
        graphcap.generate(lm, [[5, 9, 2]], SHORT, strategy="eager", max_batch=1)


# tc_piecewise compiles the model (the rotary's forward traced): stock kernels on a CPU.
@pytest.mark.parametrize(("strategy", "kernels"), [
    (strategy, kernels) for kernels in ("graphcap", "stock")
    for strategy in ("eager", "full", "breakable", "tc_piecewise")
    if strategy != "tc_piecewise" or kernels == "stock" or DEVICE == "cuda"])
def test_greedy_generation_equals_transformers_generate(strategy, kernels):
    ref = phi3_longrope()
    lm = PrefillLM(copy.deepcopy(ref), logits="last", kernels=kernels)
    got = graphcap.generate(lm, PROMPTS, NEW, strategy=strategy, max_batch=2,
                            stop_tokens=[2], prefill_tokens=16)
    assert got.tokens == [transformers_greedy(ref, p) for p in PROMPTS]


def test_a_rotary_left_on_the_long_factors_is_served_short_and_given_back_stock():
    ref = phi3_longrope()
    model = copy.deepcopy(ref)
    module = model.model.rotary_emb
    long_ids = torch.randint(3, 128, (SHORT + 8,), generator=torch.Generator().manual_seed(2))
    stock_logits(model, long_ids)  # transformers leaves the long frequencies in inv_freq
    assert not torch.equal(module.inv_freq, ref.model.rotary_emb.inv_freq)
    lm = PrefillLM(model, kernels="stock")
    assert torch.equal(module.inv_freq, ref.model.rotary_emb.inv_freq)
    assert isinstance(module.__dict__["forward"], rotary.ShortFactors)
    ids = long_ids[:10].to(DEVICE)
    with torch.no_grad():
        got = lm(ids, torch.arange(10, device=DEVICE), seq_lens=[10])
    torch.testing.assert_close(got, stock_logits(ref, ids), atol=1e-4, rtol=1e-4)
    lm.release()
    assert "forward" not in module.__dict__  # the class's decorated forward again
    torch.testing.assert_close(stock_logits(model, long_ids), stock_logits(ref, long_ids))


def test_longrope_of_each_layer_type_is_refused():
    model = phi3_longrope()
    rope = dict(model.config.rope_parameters)
    model.config.rope_parameters = {"full_attention": rope}
    with pytest.raises(UnsupportedModel, match="rope_type 'longrope'"):
        PrefillLM(model)


def test_a_wrapped_model_saved_loads_and_generates_what_its_wrapper_does(tmp_path):
    ref = phi3_longrope()
    model = copy.deepcopy(ref)
    lm = PrefillLM(model, logits="last")
    torch.save(model, tmp_path / "model.pt")  # the short-factor forward pickles too
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert isinstance(loaded.model.rotary_emb.__dict__["forward"], rotary.ShortFactors)
    want = graphcap.generate(lm, PROMPTS, NEW, strategy="eager", stop_tokens=[2]).tokens
    assert graphcap.generate(loaded, PROMPTS, NEW, strategy="eager",
                             stop_tokens=[2]).tokens == want
    assert "forward" not in loaded.model.rotary_emb.__dict__  # given back
    assert [transformers_greedy(loaded, p) for p in PROMPTS] == want


def test_accelerated_generation_past_the_short_span_names_it_not_a_larger_max_len():
    ref = phi3_longrope()
    fast = graphcap.accelerate(copy.deepcopy(ref), strategy="eager", max_batch=1)
    ids = torch.tensor([PROMPTS[0]], device=DEVICE)
    new = SHORT - ids.shape[1]  # prompt and new tokens fill the short span: served
    args = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    assert torch.equal(fast.generate(ids, max_new_tokens=new, **args),
                       ref.generate(ids, max_new_tokens=new, **args))
    # accelerate(max_len=SHORT + 1) would be refused past max_position: not offered
    with pytest.raises(ValueError, match=rf"give max_new_tokens={new} or fewer \(the model's "
                                         rf"max_position {SHORT} allows no larger max_len\)"):
        fast.generate(ids, max_new_tokens=new + 1, **args)


def test_the_forward_served_is_found_under_any_decorator_above_the_per_batch_switch():
    """Some transformers versions put ``torch.no_grad()`` above ``dynamic_rope_update``:
    the forward served is the one under the switch, whatever decorates it."""
    stock = type(phi3_longrope().model.rotary_emb)

    class NoGradAbove(stock):
        forward = torch.no_grad()(stock.forward)

    raw = inspect.unwrap(stock.forward)  # (transformers 5.17 has torch.no_grad above too)
    assert rotary.undecorated(stock) is raw and rotary.undecorated(NoGradAbove) is raw
