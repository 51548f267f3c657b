"""Reference models: presets as data, and the MoE and gpt-oss decoders under every
strategy."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from graphcap.api import GRAPHED, STRATEGIES
from graphcap.models import PRESETS, Decoder, build_model
from graphcap.testing import assert_replay_equivalent


@pytest.mark.parametrize(("name", "billions"), [
    ("qwen3-0.6b", 0.596), ("llama3-8b", 8.03), ("qwen3-30b-a3b-4l", 3.11),
    ("gpt-oss-20b", 20.91), ("gpt-oss-120b-4l", 14.01)])
def test_presets_have_the_shapes_of_the_models_they_name(name, billions):
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions,
                                                                              abs=0.01)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_builds_on_the_meta_device(name):
    # Shapes only: nothing reads a value (MXFP4 experts' scales included).
    model = build_model(name, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())


def test_the_gpt_oss_120b_slice_has_its_layers_and_their_pattern():
    """All 36 layers of the slice's shape are gpt-oss-120b's 116.83 B parameters (bf16
    experts; the published checkpoint's are MXFP4); windows alternate with full layers."""
    whole = dataclasses.replace(PRESETS["gpt-oss-120b-4l"], layers=36)
    with torch.device("meta"):
        model = Decoder(whole)
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(116.83,
                                                                              abs=0.01)
    assert [whole.window_of(i) for i in range(4)] == [128, 0, 128, 0]
    assert whole.attention_options == ("window", "sinks")


def test_the_gpt_oss_decoder_replays_like_eager_under_every_strategy():
    model = build_model("tiny-gpt-oss")
    assert_replay_equivalent(model, GRAPHED, buckets=[8, 16, 32], max_requests=3,
                             attention="torch_masked", examples=4, sequences=2)


def test_an_unknown_preset_lists_the_known_ones():
    with pytest.raises(KeyError, match="tiny-moe"):
        build_model("qwen9")


def test_the_moe_decoder_with_qk_norm_replays_like_eager_under_every_strategy():
    assert PRESETS["tiny-moe"].experts and PRESETS["tiny-moe"].qk_norm
    model = build_model("tiny-moe")
    reports = assert_replay_equivalent(model, GRAPHED,
                                       buckets=[8, 16, 32], max_requests=3,
                                       attention="torch_masked", examples=6, sequences=2)
    assert all(r["max_error"] < 1e-4 for r in reports.values())


def test_tied_embeddings_share_one_matrix():
    model = build_model("qwen3-0.6b", device="meta")
    assert model.lm_head.weight is model.embed.weight


def test_last_token_logits_are_the_last_rows_of_the_full_logits_under_every_strategy():
    import torch

    import graphcap

    last, every = build_model("tiny", logits="last"), build_model("tiny")
    lens = [5, 1, 9]
    ids = torch.randint(1, 256, (sum(lens),), generator=torch.Generator().manual_seed(0))
    pos = torch.cat([torch.arange(n) for n in lens])
    want = every(ids, pos, seq_lens=lens)[torch.tensor([4, 5, 14])]
    for strategy in STRATEGIES:
        runner = graphcap.capture(last, strategy, buckets=[8, 16, 32], max_requests=4,
                                  attention="torch_masked")
        for n_req in (3, 1):  # three requests, then one: the rest are sentinel slots
            got = runner(ids[: sum(lens[:n_req])], pos[: sum(lens[:n_req])],
                         seq_lens=lens[:n_req])
            torch.testing.assert_close(got, want[:n_req], atol=1e-5, rtol=1e-5)
    reports = assert_replay_equivalent(last, GRAPHED,
                                       buckets=[8, 16, 32], max_requests=3,
                                       attention="torch_masked", examples=6, sequences=2)
    assert all(r["max_error"] < 1e-4 for r in reports.values())


def test_a_bad_logits_choice_and_per_request_rows_on_a_generic_model_are_refused():
    import graphcap
    from graphcap.models import MLP

    with pytest.raises(ValueError, match="choose 'all'"):
        build_model("tiny", logits="first")
    mlp = MLP()
    mlp.output_rows = "requests"
    with pytest.raises(graphcap.errors.UnsupportedStrategy, match="prefill models only"):
        graphcap.capture(mlp, "full")


def test_per_request_outputs_refuse_empty_requests_and_fall_back_without_recapturing():
    import torch

    import graphcap
    from graphcap.errors import BadBatch

    last, every = build_model("tiny", logits="last"), build_model("tiny")
    r = graphcap.capture(last, "tc_piecewise", buckets=[4, 8, 16], max_requests=2,
                         attention="torch_masked")
    with pytest.raises(BadBatch, match="zero-length request, which has no last token"):
        r(torch.ones(3, dtype=torch.long), torch.arange(3), seq_lens=[3, 0])
    # More requests than slots at a bucket's token count: eager fallbacks, every time
    # with the right rows (these once recompiled and captured inside the fallback).
    for lens in ([3, 3, 2], [3, 3, 2], [3, 3, 2], [1] * 8, [2] * 4):
        ids = torch.randint(1, 256, (8,), generator=torch.Generator().manual_seed(len(lens)))
        pos = torch.cat([torch.arange(n) for n in lens])
        ends = torch.tensor(lens).cumsum(0) - 1
        torch.testing.assert_close(r(ids, pos, seq_lens=lens),
                                   every(ids, pos, seq_lens=lens)[ends])
    assert r.report()["fallbacks"] == {"too_many_requests": 5}
    assert r.model.compiler.stats["graphs"] == 1  # no recompilation for the fallbacks


@pytest.mark.parametrize("grad", ["inference_mode", "no_grad"])
def test_a_compiled_decoder_preparing_its_own_metadata_matches_eager(grad):
    # Dynamo traces AttentionMetadata.update here: the offsets must reach the device
    # through ops it sees (a numpy view of the host buffer was taken for another tensor).
    import torch

    m = build_model("tiny")
    ids, pos = torch.randint(1, 200, (16,)), torch.cat([torch.arange(9), torch.arange(7)])
    with torch.no_grad():
        want = m(ids, pos, seq_lens=[9, 7])
    torch._dynamo.reset()
    try:
        with getattr(torch, grad)():
            got = torch.compile(m, backend="aot_eager")(ids, pos, seq_lens=[9, 7])
    finally:  # its graph breaks leave Decoder.forward's automatic-dynamic record behind
        torch._dynamo.reset()
    torch.testing.assert_close(got, want)


def test_the_old_graphcap_models_tiny_import_still_works_and_says_where_it_went():
    import importlib
    import sys

    from graphcap.models import Decoder

    sys.modules.pop("graphcap.models.tiny", None)
    with pytest.warns(DeprecationWarning, match="graphcap.models.decoder"):
        old = importlib.import_module("graphcap.models.tiny")
    assert old.Decoder is Decoder


def test_an_eager_call_for_last_token_logits_refuses_an_empty_request_as_a_runner_does():
    from graphcap.errors import BadBatch

    last = build_model("tiny", logits="last")
    ids, pos = torch.randint(0, 256, (10,)), torch.cat([torch.arange(4), torch.arange(6)])
    with pytest.raises(BadBatch, match=r"seq_lens \[4, 0, 6\] has a zero-length request"):
        last(ids, pos, seq_lens=[4, 0, 6])  # its row would be another request's logits
    assert build_model("tiny")(ids, pos, seq_lens=[4, 0, 6]).shape[0] == 10


def test_an_eager_call_refuses_positions_past_the_rotary_table_and_ids_past_the_vocabulary():
    """As PrefillLM's eager call and a runner checking its inputs: a position at
    max_position (the rotary table's rows) is refused naming it, the limit and what to
    do, not a bare IndexError; a negative id does not wrap around the embedding table."""
    from graphcap.errors import BadBatch

    m = Decoder(dataclasses.replace(PRESETS["tiny"], max_position=16))
    ids = torch.randint(0, 256, (6,))
    with pytest.raises(BadBatch, match=r"positions range over \[0, 16\], outside \[0, 16\): "
                       r"position 16 reaches past the model's max_position 16 .* end "
                       "before position 16"):
        m(ids, torch.cat([torch.arange(2), torch.arange(13, 17)]), seq_lens=[2, 4])
    with pytest.raises(BadBatch, match=r"input_ids range over \[-1, .*outside the vocab"):
        m(torch.tensor([-1, 3]), torch.arange(2), seq_lens=[2])
    assert m(ids, torch.cat([torch.arange(2), torch.arange(12, 16)]),
             seq_lens=[2, 4]).shape == (6, 256)


def test_a_blocks_hooks_see_its_call_and_the_forward_is_the_same_without_them():
    """The decoder runs a block without hooks half by half (freeing its input after the
    attention half), one with hooks as a module call, so its hooks see every call."""
    m = build_model("tiny", logits="last")
    ids, positions = torch.randint(1, 256, (9,)), torch.arange(9)
    with torch.inference_mode():
        plain = m(ids, positions, seq_lens=[9])
        seen = []
        handle = m.blocks[1].register_forward_hook(lambda mod, args, out: seen.append(
            (args[0].shape, out.shape)))
        hooked = m(ids, positions, seq_lens=[9])
        handle.remove()
    assert seen == [(torch.Size([9, m.args.hidden]), torch.Size([9, m.args.hidden]))]
    torch.testing.assert_close(hooked, plain, rtol=0, atol=0)


@pytest.mark.parametrize("how", ["instance forward", "subclass forward", "block.compile()"])
def test_a_block_given_another_forward_or_compiled_is_called_as_a_module(how):
    import types

    from graphcap.models.decoder import Block

    m = build_model("tiny", logits="last")
    block, called = m.blocks[0], []

    def forward(self, h, positions, cos_sin):
        called.append(h.shape)
        return Block.forward(self, h, positions, cos_sin)

    if how == "instance forward":
        block.forward = types.MethodType(forward, block)
    elif how == "subclass forward":
        block.__class__ = type("Counted", (Block,), {"forward": forward})
    else:
        block.compile(backend=lambda gm, example: called.append("compiled") or gm)
    ids, positions = torch.randint(1, 256, (9,)), torch.arange(9)
    with torch.inference_mode():
        m(ids, positions, seq_lens=[9])
    assert called, "the block's call was bypassed"


@pytest.mark.parametrize("cast", ["build", "to", "half"])
def test_rotary_cache_stays_float32_through_a_cast(cast):
    """The rotary cache is float32 however the model came to its dtype (built in bf16, cast
    with .to() or .half()), with the bits of one computed in float32: a cast never rounds
    it, so a built model and a loaded one rotate alike."""
    exact = build_model("tiny").cos_sin
    if cast == "build":
        model = build_model("tiny", dtype=torch.bfloat16)
    elif cast == "to":
        model = build_model("tiny").to(torch.bfloat16)
    else:
        model = build_model("tiny").half()
    assert model.cos_sin.dtype == torch.float32
    assert torch.equal(model.cos_sin, exact)
    assert next(model.parameters()).dtype != torch.float32


def test_a_model_built_on_the_meta_device_gets_its_rotary_cache_with_memory():
    """to_empty() gives the parameters uninitialised memory (the weights are loaded next);
    the rotary cache, derived and never loaded, is computed."""
    model = build_model("tiny", device="meta").to_empty(device="cpu")
    assert torch.equal(model.cos_sin, build_model("tiny").cos_sin)
