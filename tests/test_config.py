"""``capture()``'s options as one public object (``graphcap.CaptureConfig``): a config and
the same options as keywords capture the same runner, keywords replace a config's fields,
and what is not an option is refused where it is given."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import graphcap
from graphcap import CaptureConfig
from graphcap.errors import UnsupportedStrategy
from tests.support.runner_helpers import DEVICE, batch, model

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def test_a_config_and_the_same_keywords_capture_the_same_runner():
    config = CaptureConfig(buckets=[8, 16], max_requests=2, attention="torch_masked")
    by_config = graphcap.capture(model(), "full", config)
    by_keywords = graphcap.capture(model(), "full", buckets=[8, 16], max_requests=2,
                                   attention="torch_masked")
    ids, pos = batch([5, 3])
    torch.testing.assert_close(by_config(ids, pos, seq_lens=[5, 3]),
                               by_keywords(ids, pos, seq_lens=[5, 3]), atol=0, rtol=0)
    assert by_config.report()["shapes"] == by_keywords.report()["shapes"] == [8, 16]
    assert by_config.report()["attention"] == "torch_masked"


def test_keywords_replace_the_configs_fields_and_leave_the_config_as_it_was():
    config = CaptureConfig(buckets=[8, 16], max_requests=2)
    runner = graphcap.capture(model(), "breakable", config, buckets=[4, 8])
    assert runner.report()["shapes"] == [4, 8]
    assert config.buckets == [8, 16]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.buckets = [4]


def test_what_is_not_an_option_is_refused_where_it_is_given():
    with pytest.raises(TypeError, match=r"unexpected options \['max_token'\].*'max_tokens'"):
        graphcap.capture(model(), "full", max_token=64)
    with pytest.raises(TypeError, match="config must be a graphcap.CaptureConfig, got dict"):
        graphcap.capture(model(), "full", {"max_tokens": 64})
    with pytest.raises(ValueError, match="warmup='some'"):
        CaptureConfig(warmup="some")
    with pytest.raises(ValueError, match="on_change='ignore'"):
        CaptureConfig(on_change="ignore")
    # What an option means for the strategy is checked by capture, config or keyword.
    with pytest.raises(UnsupportedStrategy, match="debug= is an option of strategy"):
        graphcap.capture(model(), "full", CaptureConfig(debug=True, buckets=[8]))


@pytest.mark.parametrize("field, value", [("copy_outputs", None), ("fallback", "no"),
                                          ("debug", "no"), ("check_inputs", 1)])
def test_a_flag_takes_true_or_false_only(field, value):
    # "no" is true to Python, None and 1 are not bools: none of them says what it means.
    with pytest.raises(ValueError, match=f"{field} must be True or False, got {value!r}"):
        CaptureConfig(**{field: value})
    with pytest.raises(ValueError, match=f"{field} must be True or False"):
        graphcap.capture(model(), "full", buckets=[8], **{field: value})


@pytest.mark.parametrize("options, needle", [
    ({"progress": 1}, "progress must be True, False, None or a callable"),
    ({"example_inputs": torch.zeros(2)}, "example_inputs must be a tuple"),
    ({"example_inputs": {"x": 1}}, "example_inputs must be a tuple")])
def test_progress_and_example_inputs_of_the_wrong_kind_are_refused(options, needle):
    with pytest.raises(ValueError, match=needle):
        CaptureConfig(**options)


@pytest.mark.parametrize("progress", [False, np.False_, None, np.True_],
                         ids=["False", "np.False_", "None", "np.True_"])
def test_progress_false_captures_without_a_bar(progress, capsys):
    """False (as None) shows no progress: the capture called it as a callback
    ("'bool' object is not callable"); numpy's True shows the bar, as True does."""
    runner = graphcap.capture(model(), "full", buckets=[4, 8], progress=progress)
    assert runner.stats.capture_s > 0
    shown = capsys.readouterr()
    assert ("capturing" in shown.out + shown.err) == bool(progress)


def test_capture_names_a_model_or_strategy_of_the_wrong_kind():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got str"):
        graphcap.capture("tiny", "full")
    with pytest.raises(TypeError, match="the config came where the strategy goes"):
        graphcap.capture(model(), CaptureConfig(buckets=[8]))
    with pytest.raises(UnsupportedStrategy, match=r"unknown strategy \['full'\]"):
        graphcap.capture(model(), ["full"], buckets=[8])
