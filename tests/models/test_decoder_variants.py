"""The reference decoder with attention variants (windowed layers with some global ones,
soft-capped scores, sink logits): greedy generation under every strategy gives the tokens
of recomputing each sequence whole, with prompts past the window prefilled in chunks, and
the variants change what it generates."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

import graphcap
from graphcap.models import PRESETS, Decoder, build_model
from tests.support.runner_helpers import DEVICE, stream_counting_freed

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []  # CUDA graphs there

PROMPTS = [[5, 9, 2, 7, 1, 8, 8, 4, 11, 6, 3], [3, 4], [8, 8, 4, 11, 6, 2, 9, 10, 13, 1]]
NEW = 8
VARIANT = dict(window=4, global_every=2, softcap=3.0, sinks=True)


def model(**variant) -> Decoder:
    torch.manual_seed(0)
    m = Decoder(dataclasses.replace(PRESETS["tiny"], **variant)).to(DEVICE).eval()
    with torch.no_grad():
        for block in m.blocks:
            if block.attn.sinks is not None:
                block.attn.sinks.normal_()
    return m


def recomputed(m: Decoder, prompt: list[int]) -> list[int]:
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            logits = m(torch.tensor(seq, device=DEVICE),
                       torch.arange(len(seq), device=DEVICE), seq_lens=[len(seq)])
            seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]


def test_the_layers_say_which_options_they_use():
    m = model(**VARIANT)
    assert m.graphcap_attention_options == ("window", "softcap", "sinks")
    assert [b.attn.spec.window for b in m.blocks] == [4, 0]  # every 2nd layer global
    assert model().graphcap_attention_options == ()


@pytest.mark.parametrize("strategy", ["eager", "full", "breakable", "tc_piecewise"])
def test_generation_is_recomputing_every_sequence(strategy):
    m = model(**VARIANT)
    got = graphcap.generate(m, PROMPTS, NEW, strategy=strategy, max_batch=2,
                            prefill_tokens=4)
    assert got.tokens == [recomputed(m, p) for p in PROMPTS]


@pytest.mark.parametrize("strategy", ["eager", "full", "breakable"])
def test_a_model_windowed_in_every_layer_frees_pages_behind_the_window_and_generates_the_same(
        strategy):
    """Every layer windowed: the LLM's cache frees the pages behind the window while its
    requests run (prompts past the window prefilled in chunks, pages of 2 tokens), and
    the tokens are those of recomputing each sequence whole. With one global layer in
    two, every page is kept."""
    m = model(window=4, softcap=3.0, sinks=True)
    assert m.graphcap_kv_window == 4 and model(**VARIANT).graphcap_kv_window == 0
    llm = graphcap.LLM(m, strategy=strategy, max_batch=2, max_len=32, prefill_tokens=4,
                       page_size=2, progress=False)
    tokens, freed = stream_counting_freed(llm, PROMPTS, NEW)
    assert tokens == [recomputed(m, p) for p in PROMPTS]
    assert freed >= 3  # the 11-token prompt alone: tokens 0..5 behind at 11 written
    assert llm.cache.free_pages == llm.cache.pages


def test_the_variants_change_what_it_generates():
    plain = model(sinks=True)  # the same weights, sinks included, no window nor cap
    varied = model(**VARIANT)
    assert [recomputed(plain, p) for p in PROMPTS] != [recomputed(varied, p) for p in PROMPTS]


@pytest.mark.parametrize("preset", ["tiny-gpt-oss", "tiny-gpt-oss-mxfp4"])
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_the_gpt_oss_decoder_generates_what_recomputing_gives(strategy, preset):
    """gpt-oss's layers together: alternating windows, sinks, biased clamped-GLU experts
    on the MoE kernels (in the model's dtype, or MXFP4 as gpt-oss ships them), YaRN;
    prompts past the window, prefilled in chunks."""
    m = build_model(preset, device=DEVICE)
    prompts = PROMPTS + [list(range(1, 20))]
    got = graphcap.generate(m, prompts, NEW, strategy=strategy, max_batch=2,
                            prefill_tokens=8)
    assert got.tokens == [recomputed(m, p) for p in prompts]


@pytest.mark.skipif(DEVICE != "cuda" or importlib.util.find_spec("flashinfer") is None,
                    reason="FlashInfer on a CUDA device")
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_flashinfers_prefill_computes_windowed_and_soft_capped_layers_as_triton(strategy,
                                                                                sinks):
    """Alternating windowed and global layers, soft-capped scores, bf16 (FlashInfer's),
    head dim 64: each (window, softcap) pair planned per shape, the windowless twin for
    a shape no longer than the window (bucket 4), against Triton's attention eagerly;
    with sinks, folded in from the kernel's log-sum-exp."""
    m = model(window=4, global_every=2, softcap=3.0, head_dim=64, sinks=sinks).to(
        torch.bfloat16)
    want = graphcap.capture(m, "eager", attention="triton")
    runner = graphcap.capture(m, strategy, attention="flashinfer", buckets=[32, 4],
                              max_requests=3)
    for lengths in ([3, 9, 11], [2, 2], [17, 0, 15], [4]):
        ids = torch.randint(1, m.args.vocab_size, (sum(lengths),), device=DEVICE)
        positions = torch.cat([torch.arange(n, device=DEVICE) for n in lengths])
        got = runner(ids, positions, seq_lens=lengths)
        torch.testing.assert_close(got.float(), want(ids, positions, seq_lens=lengths).float(),
                                   atol=0.05, rtol=0.05, msg=f"lengths {lengths}")
    assert sum(runner.report()["replays"].values()) == 4
