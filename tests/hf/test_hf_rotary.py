"""PhiMoE's rotary embedding computes its frequencies on the host in every forward and
copies them to the device, a copy CUDA graph capture refuses. Wrapped, it reads them from
the device: no host computation per forward, the same cos and sin bits, and the stock
function back on release."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from graphcap.errors import UnsupportedModel  # noqa: E402
from graphcap.hf import PrefillLM, rotary  # noqa: E402  (needs transformers)
from tests.support.hf_families import hf_model  # noqa: E402
from tests.support.runner_helpers import DEVICE  # noqa: E402

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


class Counting:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def phimoe():
    model = hf_model("phimoe", initializer_range=0.5).to(DEVICE)
    module = model.model.rotary_emb
    module.rope_init_fn = Counting(module.rope_init_fn)
    return model, module


def test_a_wrapped_phimoe_computes_no_frequencies_on_the_host_per_forward():
    model, module = phimoe()
    stock = copy.deepcopy(model)
    x = torch.zeros(1, dtype=torch.float32, device=DEVICE)
    pos = torch.arange(19, device=DEVICE)[None]
    want = stock.model.rotary_emb(x, pos)
    assert stock.model.rotary_emb.rope_init_fn.calls == 1  # the stock forward, each call
    lm = PrefillLM(model)
    counting = module.rope_init_fn.stock
    before = counting.calls
    ids = torch.randint(0, 128, (19,), device=DEVICE)
    with torch.no_grad():
        lm(ids, pos[0], seq_lens=[19])
        got = module(x, pos)
    assert counting.calls == before
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_release_gives_the_stock_function_back_and_a_second_wrapper_keeps_one_patch():
    model, module = phimoe()
    counting = module.rope_init_fn
    lm = PrefillLM(model)
    PrefillLM(model)
    assert isinstance(module.rope_init_fn, rotary.Frequencies)
    assert module.rope_init_fn.stock is counting
    lm.release()
    assert module.rope_init_fn is counting


def test_a_rope_type_scaled_by_the_batchs_largest_position_is_refused():
    model, module = phimoe()
    module.rope_type = "linear"  # its scale comes from the largest position, on the host
    with pytest.raises(UnsupportedModel, match="rope_type 'linear'.*largest position"):
        PrefillLM(model)
    assert isinstance(module.rope_init_fn, Counting)  # left as it came


def test_a_capture_sees_the_config_as_it_is_and_a_rotary_module_put_in_since():
    model, module = phimoe()
    lm = PrefillLM(model)
    model.config.rope_parameters["rope_theta"] = 500.0
    lm.graphcap_before_capture()
    want = module.rope_init_fn.stock(model.config)[0].to(DEVICE)
    assert torch.equal(module.rope_init_fn(model.config)[0], want)
    fresh = type(module)(model.config).to(DEVICE)
    model.model.rotary_emb = fresh
    lm.graphcap_before_capture()
    assert isinstance(fresh.rope_init_fn, rotary.Frequencies)
    assert torch.equal(fresh.rope_init_fn(model.config)[0], want)


def test_the_frequencies_graphs_read_stay_the_same_tensors_capture_after_capture():
    # generate() captures a prefill runner, then a decode runner: the second capture's
    # set-up must not replace (and free) the tensor the first runner's graphs read.
    model, module = phimoe()
    lm = PrefillLM(model)
    lm.graphcap_before_capture()
    read = module.rope_init_fn(model.config)[0]
    lm.graphcap_before_capture()
    assert module.rope_init_fn(model.config)[0] is read
    model.config.rope_parameters["rope_theta"] = 500.0  # a change: the same tensor, rewritten
    lm.graphcap_before_capture()
    assert module.rope_init_fn(model.config)[0] is read
    assert torch.equal(read, module.rope_init_fn.stock(model.config)[0].to(DEVICE))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_rotary_table_is_computed_in_spans_with_the_bits_of_one_call(family, monkeypatch):
    """The table graphcap's kernels read is computed a span of positions at a time (a
    million positions at once would take 2 GB beside it), with the bits of the model's
    rotary embedding called on every position at once."""
    model = hf_model(family, max_position_embeddings=100)
    module = model.model.rotary_emb
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, torch.arange(100)[None])
    half = cos.shape[-1] // 2
    whole = torch.cat([cos[0, :, :half], sin[0, :, :half]], dim=-1)
    monkeypatch.setattr(rotary, "ROTARY_SPAN", 7)
    spans, stock = [], module.forward
    monkeypatch.setattr(module, "forward",
                        lambda x, pos: spans.append(pos.shape[-1]) or stock(x, pos))
    table = rotary.rotary_cache(model)
    assert max(spans) == 7 and sum(spans) == 100
    assert table.shape == (100, 2 * half) and table.dtype == torch.float32
    assert torch.equal(table, whole)
