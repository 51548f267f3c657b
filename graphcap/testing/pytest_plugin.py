"""graphcap's pytest plugin (entry point ``pytest11``): a ``gpu`` marker and a
``graphcap_device`` fixture, so users' tests run on CUDA graphs where a GPU is present and
on the CPU emulator elsewhere. Its import imports graphcap, which reads the environment
(:mod:`graphcap.env`) before any conftest runs: it reads it again once the tests are
collected, so that what a conftest sets (``TRITON_INTERPRET=1``) is seen."""

from __future__ import annotations

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU (skipped without one; run with -m gpu)")


def pytest_collection_finish(session):
    import graphcap.env

    graphcap.env.reload()  # what the conftests set (TRITON_INTERPRET), before a test runs


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not a directory name
            item.add_marker(skip)


@pytest.fixture
def graphcap_device() -> torch.device:
    """cuda when a GPU is present (real CUDA graphs), else cpu (the graph emulator)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
