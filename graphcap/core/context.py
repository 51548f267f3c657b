"""The forward context: per-forward state that ops read instead of taking it as arguments.

A captured forward cannot take host metadata as arguments (it would be baked), and split
ops run eagerly between graph pieces, so per-batch state such as attention metadata is set
here around each forward (eager, capture or replay) by whoever runs the model.

    with forward_context(attention=meta):
        model(input_ids, positions)
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any

from graphcap.errors import GraphcapError, UnsupportedModel


@dataclass(frozen=True)
class ForwardContext:
    attention: Any = None  # an AttentionMetadata prepared outside any graph
    kv: Any = None  # a graphcap.kv.CacheBatch: this forward's K/V cache, or None


_CURRENT: contextvars.ContextVar[ForwardContext | None] = contextvars.ContextVar(
    "graphcap_forward_context", default=None)


@contextlib.contextmanager
def forward_context(**fields):
    """Set the forward context for the duration of the block (nests; restores on exit)."""
    token = _CURRENT.set(ForwardContext(**fields))
    try:
        yield _CURRENT.get()
    finally:
        _CURRENT.reset(token)


def current_attention():
    """The attention metadata of the running forward, with a clear error when unset."""
    ctx = _CURRENT.get()
    if ctx is not None and ctx.attention is None and ctx.kv is not None:
        raise UnsupportedModel(
            "graphcap::attention (attention among a prefill's packed tokens) ran in a "
            "forward over a paged K/V cache, which keeps no prefill metadata: a model that "
            "decodes or prefills into the cache routes each attention half through "
            "graphcap.models.blocks.attention_half (or graphcap::cached_attention) with its "
            "layer index, which writes the K/V and reads the cache")
    if ctx is None or ctx.attention is None:
        raise GraphcapError(
            "graphcap::attention needs the attention metadata of this forward's packed "
            "requests, and none was prepared: call the model through a prefill runner, "
            "runner(input_ids, positions, seq_lens=[...]) (declare a model of packed "
            "requests with graphcap.capture(model, inputs='prefill')), or eagerly inside "
            "graphcap.packed(seq_lens, device)")
    return ctx.attention


def attention_if_any():
    """The attention metadata of the running forward, or None."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.attention


def current_kv():
    """The paged K/V cache state of the running forward (a ``CacheBatch``), or None when
    the forward keeps no cache."""
    ctx = _CURRENT.get()
    return None if ctx is None else ctx.kv

