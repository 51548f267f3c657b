"""An LLM whose build fails lets its K/V cache and graphs go at once, inside the caller's
``except``: the retry with smaller sizes that a capture's out-of-memory note advises finds
the memory free."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import graphcap.engine.llm as llm_module
from graphcap import LLM
from graphcap.core import hostsync
from graphcap.core.emulated import EmulatedGraph
from graphcap.core.graphs import capturing
from graphcap.errors import CaptureError, GraphcapError
from tests.engine.test_generate import model
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


@pytest.fixture
def caches(monkeypatch):
    """Weak references to the caches the LLMs built here make."""
    made = []

    def kept(*args, **kwargs):
        cache = make(*args, **kwargs)
        made.append(weakref.ref(cache))
        return cache

    make = llm_module.llm_cache
    monkeypatch.setattr(llm_module, "llm_cache", kept)
    return made


def test_a_failed_build_holds_no_cache_inside_the_callers_except(caches):
    m = model()
    try:  # refused inside the engine's build, the cache already made
        LLM(m, max_batch=2, max_len=32, attention="no-such-backend", progress=False)
    except GraphcapError as error:
        assert "no-such-backend" in str(error)
        assert error.__traceback__ is not None  # the traceback is kept, its lines with it
        assert len(caches) == 1 and caches[0]() is None
    else:
        raise AssertionError("the unknown attention backend was not refused")
    llm = LLM(m, max_batch=2, max_len=32, progress=False)  # and the model builds again
    assert llm.generate([[1, 2, 3]], max_new_tokens=2)


def _translating_abort(self, exc, abort=EmulatedGraph.abort):
    """The emulator's abort as CUDA's: a failure of the capture is translated and raised
    from it."""
    abort(self, exc)
    if hostsync.is_capture_failure(exc) and not isinstance(exc, CaptureError):
        error = hostsync.translate_cuda_failure(exc)
        error.__cause__ = exc
        return error
    return exc


@pytest.mark.parametrize("where", ["warm-up", "capture", "refused in capture"])
def test_a_build_failing_in_the_forward_holds_no_cache_inside_the_callers_except(
        caches, monkeypatch, where):
    # Out of memory in the first warm-up or inside a capture, or an operation CUDA
    # refuses there (raised from the translation): the cache goes all the same, though
    # the traceback's frames ran the captured forward, a closure over the cache's state.
    m = model()
    forward = type(m).forward

    def failing(self, *args, **kwargs):
        if where == "warm-up" or capturing():
            if where == "refused in capture":
                raise RuntimeError("operation not permitted when stream is capturing")
            raise torch.OutOfMemoryError("out of memory")
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(type(m), "forward", failing)
    monkeypatch.setattr(EmulatedGraph, "abort", _translating_abort)
    try:
        LLM(m, max_batch=2, max_len=32, progress=False)
    except (torch.OutOfMemoryError, CaptureError) as error:
        gc.collect()  # nothing but reference cycles left
        assert isinstance(error, CaptureError) == (where == "refused in capture")
        assert error.__traceback__ is not None
        assert len(caches) == 1 and caches[0]() is None
    else:
        raise AssertionError("the failing forward built")
    monkeypatch.undo()
    assert LLM(m, max_batch=2, max_len=32, progress=False).generate([[1, 2, 3]], 2)


def test_a_failed_build_keeps_the_locals_of_the_error_its_caller_handles(caches):
    def raising():
        kept = "the caller's"
        raise ValueError(kept)

    try:
        raising()
    except ValueError as handled:
        with pytest.raises(GraphcapError) as info:  # raised from the caller's error
            LLM(model(), max_batch=2, max_len=32, attention="no-such-backend", progress=False)
        assert info.value.__context__ is handled and caches[0]() is None
        assert handled.__traceback__.tb_next.tb_frame.f_locals["kept"] == "the caller's"


def test_an_llm_of_max_len_1_is_refused_as_it_holds_no_request():
    """A request is a prompt token and a new token at least: an LLM of max_len 1 could
    serve nothing (every call refused, advising prompts of fewer than 1 token)."""
    with pytest.raises(ValueError, match="max_len 1 holds no request.*at least 2"):
        LLM(model(), max_batch=2, max_len=1, progress=False)
    assert LLM(model(), max_batch=1, max_len=2, progress=False).generate([[1]], 1)
