"""Shared fixtures: graph pools of every kind this machine can run."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

pytest_plugins = ["pytester"]  # tests of graphcap's own pytest plugin

# Without a GPU, Triton kernels run in Triton's interpreter (numpy on the CPU). It is read
# when a kernel is defined, so it must be set before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import graphcap.env  # read at import, perhaps before this line (the pytest plugin)

    graphcap.env.reload()

# Under pytest-xdist the workers share the cores: one intra-op thread each, or their
# OpenMP threads spin on each other's cores. The processes a test starts (the README's
# snippet, interrupted captures, bench ranks, the stand-in suite) share them too: they
# read the variable when torch starts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The suite's profiles draw the same examples on every run (a seed from each test's code):
# a run fails only where the code or the test changed, never by the draw. "dev" draws
# new ones, many more of them: the search for what the fixed draw does not reach. "ci"
# draws 18 where a test sets no count (25 took the quiet CI run to 429 of its 480 s;
# 18 saved about 30 s of the suite's 367).
settings.register_profile(
    "ci", max_examples=18, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("gpu", max_examples=10, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
if settings.default.derandomize:
    # Hypothesis also draws numbers and strings it finds in the project's loaded modules
    # (6.1xx), and which are loaded depends on the tests a worker ran before: with none,
    # a test's draw follows its code alone.
    from hypothesis.internal.conjecture import providers as _providers

    if hasattr(_providers, "_get_local_constants") and \
            hasattr(_providers, "_local_constants"):
        _providers._get_local_constants = lambda: _providers._local_constants

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def pytest_addoption(parser):
    parser.addoption(
        "--graph-standin", choices=["rerun"], default=None,
        help="replace the CPU graph with a stand-in (proves the semantics suite can fail)")


def _pool(kind: str, request):
    from graphcap.core import new_pool

    standin = request.config.getoption("--graph-standin")
    if standin:
        if kind != "emulated-cpu":
            pytest.skip("stand-ins replace the CPU emulator only")
        from tests.support.standins import RerunPool

        return RerunPool("cpu")
    if kind == "emulated-cpu":
        return new_pool("cpu", kind="emulated")
    if kind == "emulated-cuda":
        return new_pool("cuda", kind="emulated")
    return new_pool("cuda", kind="cuda")


@pytest.fixture(
    params=[
        "emulated-cpu",
        pytest.param("cuda", marks=[pytest.mark.gpu, requires_cuda]),
        pytest.param("emulated-cuda", marks=[pytest.mark.gpu, requires_cuda]),
    ]
)
def pool(request):
    """A graph pool: the CPU emulator everywhere, real CUDA graphs and the emulator on
    CUDA tensors where a GPU is present."""
    return _pool(request.param, request)


@pytest.fixture(autouse=True)
def _seeded(request):
    """torch's and Python's global generators seeded from the test's id before each test:
    the tensors a test draws without a generator of its own are the same on every run,
    whichever tests ran before it in its worker."""
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    random.seed(seed)


@pytest.fixture
def environ(monkeypatch):
    """``set(name, value)`` and ``unset(name)`` of environment variables, graphcap's
    settings read again after each change and after the test (graphcap reads them once,
    at import)."""
    import graphcap.env

    class Environ:
        def set(self, name: str, value: str) -> None:
            monkeypatch.setenv(name, value)
            graphcap.env.reload()

        def unset(self, name: str) -> None:
            monkeypatch.delenv(name, raising=False)
            graphcap.env.reload()

    yield Environ()
    monkeypatch.undo()
    graphcap.env.reload()


def pytest_configure(config):
    """``--dist loadgroup`` sends the tests of an ``xdist_group`` to one worker by a suffix
    pytest-xdist 3.8 writes into a field pytest 9.2 no longer reads a test's id from: the
    marks would be ignored without a word, a group's tests spread over the workers."""
    if config.getoption("dist", "no") != "loadgroup" or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    version = tuple(int(p) for p in pytest.__version__.split(".")[:2] if p.isdigit())
    if version >= (9, 2):
        raise pytest.UsageError(
            f"--dist loadgroup ignores xdist_group marks under pytest {pytest.__version__} "
            "with pytest-xdist 3.8: install the pytest that pyproject.toml's test extra pins "
            "(pip install -e '.[test]', or make test, which does)")


def pytest_collection_modifyitems(config, items):
    """Tests that start processes (marked ``slow``) first, each group's order kept: the
    workers then end the run on short tests, not one on a long one while the other
    idles."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_sessionfinish(session, exitstatus):
    from tests.support import tp_world

    tp_world.stop_all()  # the processes of the session's torch.distributed worlds
