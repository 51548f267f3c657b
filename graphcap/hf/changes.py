"""What ``PrefillLM`` takes from a model when it wraps it, and refuses once changed.

A wrapper and what it feeds read some of the model once, at wrapping: the config fields
the stock modules read on every call (a window) or that size the rotary cache, which
set the attention options and an ``LLM``'s cache window, and the vocabulary, which token
ids are checked against (an eager call, ``check_inputs=True``, an ``LLM``'s prompts and
stop tokens). Changed after wrapping, the model is refused (a call, a capture, an
``LLM`` sizing its cache) until it is wrapped again, naming what changed.
"""

from __future__ import annotations

import torch
from torch import nn

# Config fields stock modules read on every call (Mistral's, Mixtral's and Phi-3's
# attention pass config.sliding_window) or that size the rotary cache.
CALL_TIME_CONFIG = ("sliding_window", "max_position_embeddings")
AGAIN = ("wrap the model again, PrefillLM(hf_model) (one given graphcap.accelerate: "
         "graphcap.restore(hf_model), then accelerate it again)")


def module_values(module: nn.Module) -> tuple:
    """The Python numbers, flags and names a module holds (``variance_epsilon``,
    ``scaling``, ``head_dim``, ``sliding_window``, ``top_k``; torch's own modules' too: an
    ``nn.Embedding``'s ``max_norm``, an ``nn.RMSNorm``'s ``eps``): the kernels standing in
    for it read them at recognition, so one set since is a change (not ``training``: a
    call in train mode runs the stock forward)."""
    return tuple((k, v) for k, v in module.__dict__.items()
                 if type(v) in _VALUES and k != "training")


_VALUES = frozenset((bool, int, float, str, type(None)))


def call_time_config(model: nn.Module) -> tuple:
    """The values of ``CALL_TIME_CONFIG`` in ``model``'s config."""
    return tuple(repr(getattr(model.config, f, None)) for f in CALL_TIME_CONFIG)


def _rows(module) -> int | None:
    weight = getattr(module, "weight", None)
    return weight.shape[0] if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None


def vocabulary(model: nn.Module) -> tuple[int | None, int | None]:
    """The rows of the input embedding (the token ids a call may give) and of the LM head
    (the logits' width): ``resize_token_embeddings`` changes both."""
    try:
        embedding = model.get_input_embeddings()
    except NotImplementedError:  # a model that does not say which it is
        embedding = None
    return _rows(embedding), _rows(model.get_output_embeddings())


def taken(model: nn.Module) -> tuple:
    """What a wrapper takes from ``model`` when it wraps it (compared by :func:`refusal`)."""
    return call_time_config(model), vocabulary(model)


def refusal(model: nn.Module, then: tuple) -> str | None:
    """Why a wrapper that took ``then`` from ``model`` (:func:`taken`) refuses it now."""
    kind, (config, vocab) = type(model).__name__, taken(model)
    if config != then[0]:
        return (f"{kind}'s config changed since PrefillLM wrapped it "
                f"({', '.join(CALL_TIME_CONFIG)}: {then[0]}, now {config}): its windows and "
                f"cache were found at wrapping; {AGAIN}")
    if vocab != then[1]:
        return (f"{kind}'s vocabulary changed since PrefillLM wrapped it (rows of the input "
                f"embedding and the LM head: {then[1]}, now {vocab}; resize_token_embeddings"
                "?): the token ids calls, check_inputs and an LLM's prompts are checked "
                f"against were taken at wrapping; {AGAIN}")
    return None
