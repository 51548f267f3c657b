"""A named attention backend that does not compute an option the model's layers use (a
sliding window, soft-capped scores, sinks: its ``graphcap_attention_options``) is refused
when the inputs meet the model, before anything is built or runs: the error names the
model, the option, the backend and those that would serve, from the backends' own
``options`` (the table ``graphcap ops`` prints), and the cache, the inputs object and any
runner already made of the model stay as they were."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

import graphcap
from graphcap.errors import BackendUnavailable
from graphcap.inputs import CachePrefillInputs, DecodeInputs, PagedInputs, PrefillInputs
from graphcap.kv import PagedKVCache
from graphcap.models import PRESETS, Decoder
from graphcap.opsdb.attention import BACKENDS, DECODE_BACKENDS, OpsdbDecode, TorchMasked

SINKS = "Decoder's layers use attention sinks \\('sinks'\\), which"


class PlainOnly(TorchMasked):
    name = "plain_only"
    options = frozenset()


class PlainDecode(OpsdbDecode):
    name = "plain_decode"
    options = frozenset()


@pytest.fixture
def registered(monkeypatch):
    monkeypatch.setitem(BACKENDS, PlainOnly.name, PlainOnly)
    monkeypatch.setitem(DECODE_BACKENDS, PlainDecode.name, PlainDecode)


def sinks_model():
    torch.manual_seed(0)
    return Decoder(dataclasses.replace(PRESETS["tiny"], sinks=True)).eval()


def cache_of(m) -> PagedKVCache:
    a = m.args
    return PagedKVCache(a.layers, a.kv_heads, a.head_dim, max_requests=2, max_len=16,
                        page_size=4)


def never_called(m) -> list:
    calls = []
    m.register_forward_pre_hook(lambda module, args: calls.append(1))
    return calls


@pytest.mark.parametrize("strategy", ["eager", "full"])
def test_a_named_prefill_backend_without_an_option_of_the_layers_is_refused_at_capture(
        registered, strategy):
    m = sinks_model()
    calls = never_called(m)
    with pytest.raises(BackendUnavailable, match=SINKS + " prefill attention backend "
                       "'plain_only' does not compute; pick one that does: .*torch_masked"):
        graphcap.capture(m, strategy, buckets=[8], attention="plain_only")
    assert calls == []  # no warm-up, no forward: refused before anything ran


def test_flash_attention_2_or_3_is_refused_for_sinks_from_its_options_alone(monkeypatch):
    """The one installed backend that lacks an option (FlashAttention without FA4 has no
    sinks) is refused at capture from what it says it computes, never imported."""
    from graphcap.opsdb.attention import flash_attn_backend

    monkeypatch.setattr(flash_attn_backend, "_fa2_or_fa3_only", lambda: True)
    monkeypatch.setattr(flash_attn_backend.FlashAttention, "devices", ("cuda", "cpu"))
    monkeypatch.setattr(flash_attn_backend.FlashAttention, "requires", ())
    with pytest.raises(BackendUnavailable, match=SINKS + " prefill attention backend "
                       "'flash_attn' does not compute; pick one that does: .*torch_masked"):
        graphcap.capture(sinks_model().to(torch.bfloat16), "full", buckets=[8],
                         attention="flash_attn")
    assert "flash_attn" not in sys.modules


def test_a_prefill_inputs_object_is_checked_when_bound_to_the_model(registered):
    inputs = PrefillInputs(torch.device("cpu"), PlainOnly(), slots=2)
    with pytest.raises(BackendUnavailable, match=SINKS + " prefill attention backend "
                       "'plain_only'"):
        graphcap.capture(sinks_model(), "full", buckets=[8], inputs=inputs)
    assert inputs.buffers == [] and inputs.check_free() is None


def test_decode_inputs_are_refused_when_bound_and_leave_the_cache_and_runners_as_they_were(
        registered):
    m = sinks_model()
    cache = cache_of(m)
    runner = graphcap.capture(m, "full", buckets=[1, 2], inputs=DecodeInputs(cache))
    cache.admit(0, 8)
    step = dict(positions=[0], slots=[0])
    before = runner(torch.tensor([3]), **step)
    cache.unwrite([(0, 0)])
    kept = (cache.written(0), cache.free_pages, cache.pages_of(0), cache.k.clone())
    refused = DecodeInputs(cache, attention="plain_decode")
    with pytest.raises(BackendUnavailable, match=SINKS + " decode attention backend "
                       "'plain_decode' does not compute; pick one that does: graphcap"):
        graphcap.capture(m, "full", buckets=[1, 2], inputs=refused)
    assert refused.buffers == [] and refused.check_free() is None
    now = (cache.written(0), cache.free_pages, cache.pages_of(0), cache.k)
    assert now[:3] == kept[:3] and torch.equal(now[3], kept[3])
    torch.testing.assert_close(runner(torch.tensor([3]), **step), before)


def test_a_prefill_into_the_cache_is_checked_against_its_prefill_backend(registered):
    m = sinks_model()
    with pytest.raises(BackendUnavailable, match=SINKS + " prefill attention backend "
                       "'plain_only'"):
        graphcap.capture(m, "breakable", buckets=[8],
                         inputs=CachePrefillInputs(cache_of(m), "plain_only", slots=2))


def test_an_extend_is_checked_against_the_decode_backend_it_attends_with(registered):
    """An extend attends over the pages: its prefill backend only packs the requests, so
    one without the options serves; its decode backend must compute them."""
    m = sinks_model()
    cache = cache_of(m)
    graphcap.capture(m, "full", buckets=[8],
                     inputs=CachePrefillInputs(cache, "plain_only", slots=1, extend=True))
    with pytest.raises(BackendUnavailable, match=SINKS + " decode attention backend "
                       "'plain_decode'"):
        graphcap.capture(m, "full", buckets=[8], inputs=PagedInputs(
            cache, None, attention="torch_masked", slots=1, extend=True,
            decode_attention=PlainDecode()))


def test_an_llm_is_refused_before_it_captures_anything(registered, monkeypatch):
    from graphcap.engine import engine

    captured = []
    monkeypatch.setattr(engine, "capture", lambda *a, **k: captured.append(a))
    with pytest.raises(BackendUnavailable, match=SINKS + " prefill attention backend "
                       "'plain_only'"):
        graphcap.LLM(sinks_model(), strategy="full", max_batch=2, max_len=16,
                     prefill_tokens=8, attention="plain_only", progress=False)
    assert captured == []
