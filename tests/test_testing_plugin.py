"""graphcap's pytest plugin: the device to test on, the gpu marker, and the environment a
conftest sets."""

from __future__ import annotations

import torch


def test_the_plugin_gives_the_device_to_test_on(graphcap_device):
    assert graphcap_device.type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_the_plugin_skips_by_the_gpu_marker_not_by_a_directory_named_gpu(pytester):
    pytester.makepyfile(**{"gpu/test_plain": "def test_math():\n    assert 1 + 1 == 2\n"})
    result = pytester.runpytest()  # the plugin, loaded by its entry point
    result.assert_outcomes(passed=1)


def test_the_plugin_reads_the_variables_a_conftest_sets_after_graphcap_was_imported(
        pytester, environ):
    environ.set("GRAPHCAP_PDL", "1")  # the plugin imported graphcap, which read this
    pytester.makeconftest("import os\nos.environ['GRAPHCAP_PDL'] = '0'\n")
    pytester.makepyfile(test_pdl="import graphcap.env\n\ndef test_pdl_is_off():\n"
                                 "    assert graphcap.env.settings().pdl is False\n")
    pytester.runpytest().assert_outcomes(passed=1)  # a conftest setting TRITON_INTERPRET too
