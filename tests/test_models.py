"""Reference models: presets as data, and the MoE decoder under every strategy."""

from __future__ import annotations

import pytest

from graphcap.models import PRESETS, build_model
from graphcap.testing import assert_replay_equivalent


@pytest.mark.parametrize(("name", "billions"), [
    ("qwen3-0.6b", 0.596), ("llama3-8b", 8.03), ("qwen3-30b-a3b-4l", 3.11)])
def test_presets_have_the_shapes_of_the_models_they_name(name, billions):
    model = build_model(name, device="meta")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions,
                                                                              abs=0.01)


def test_an_unknown_preset_lists_the_known_ones():
    with pytest.raises(KeyError, match="tiny-moe"):
        build_model("qwen9")


def test_the_moe_decoder_with_qk_norm_replays_like_eager_under_every_strategy():
    assert PRESETS["tiny-moe"].experts and PRESETS["tiny-moe"].qk_norm
    model = build_model("tiny-moe")
    reports = assert_replay_equivalent(model, ("breakable", "full", "tc_piecewise"),
                                       buckets=[8, 16, 32], max_requests=3,
                                       attention="torch_masked", examples=6, sequences=2)
    assert all(r["max_error"] < 1e-4 for r in reports.values())


def test_tied_embeddings_share_one_matrix():
    model = build_model("qwen3-0.6b", device="meta")
    assert model.lm_head.weight is model.embed.weight
