"""An LLM whose build fails lets its K/V cache and graphs go at once, inside the caller's
``except``: the retry with smaller sizes that a capture's out-of-memory note advises finds
the memory free."""

from __future__ import annotations

import weakref

import pytest

import graphcap.engine.llm as llm_module
from graphcap import LLM
from graphcap.errors import GraphcapError
from tests.engine.test_generate import model
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


def test_a_failed_build_holds_no_cache_inside_the_callers_except(monkeypatch):
    caches = []

    def kept(*args, **kwargs):
        cache = make(*args, **kwargs)
        caches.append(weakref.ref(cache))
        return cache

    make = llm_module.llm_cache
    monkeypatch.setattr(llm_module, "llm_cache", kept)
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
