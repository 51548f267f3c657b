"""Deprecated: the eager prefill and decode steps are :mod:`graphcap.engine.eager`
(``from graphcap.engine import decode_step, prefill``)."""

import warnings

from graphcap.engine.eager import decode_step, last_token_logits, prefill

warnings.warn("graphcap.cache.steps is deprecated: import decode_step and prefill from "
              "graphcap.engine", DeprecationWarning, stacklevel=2)

__all__ = ["decode_step", "last_token_logits", "prefill"]
