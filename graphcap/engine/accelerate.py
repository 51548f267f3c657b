"""transformers' own calls on graphcap's engine: :func:`accelerate` gives a stock causal LM a
``generate`` that runs on a :class:`~graphcap.engine.llm.LLM` of it (its graphs captured
once, here), so ``model.generate(**tokenizer(texts, return_tensors="pt", padding=True),
max_new_tokens=...)`` and ``pipeline("text-generation", model=model, tokenizer=tok)``
keep working, and :func:`restore` gives the model back as it came.

What it serves of a ``generate`` call: ``input_ids`` ``[B, T]`` with an
``attention_mask`` (left or right padding: each row's prompt is its tokens under the
mask), ``max_new_tokens`` or ``max_length`` (neither: 20 new tokens, as transformers;
within the ``max_len`` it was accelerated with; ``min_length`` where it changes nothing,
at most the input's width), ``eos_token_id``, ``pad_token_id``, greedy and ``do_sample``
with ``temperature``, ``top_k`` and ``top_p`` (drawn with a seed taken from torch's
generator, so ``torch.manual_seed`` makes them reproducible; greedy decoding leaves every
sampling option unread, as transformers does: ``min_p``, ``typical_p``, ...), the cache
options (``use_cache``, ``cache_implementation``, ``max_cache_len``, a static cache's
least size: graphcap keeps its own cache; ``"paged"``, transformers' continuous batching,
and the lossy ``"quantized"`` are refused). The call's options are merged as transformers
merges them (a ``generation_config`` given takes the model's fields it leaves unset, then
transformers' defaults: ``top_k=50``), and the call ends at its own ``eos_token_id``, not
at the model's or the tokenizer's. It returns what transformers returns: the input rows
followed by the new tokens (int64), rows that ended first padded with ``pad_token_id``
(with ``return_dict_in_generate``, as the ``sequences`` of a ``GenerateDecoderOnlyOutput``
whose ``cache`` is None, as transformers' without a cache: graphcap's cache is its own).
Anything else (beams, several sequences per prompt, logits processors, stopping criteria,
streamers, assisted generation, scores or logits returned, ...) is refused with a
``ValueError`` naming it, as is a model in training mode: ``restore(model)`` first to run
transformers' own.
"""

from __future__ import annotations

import copy
import types
import warnings

import numpy as np
import torch

from graphcap.engine.arguments import DefaultsNotApplied, eos_ids, set_defaults
from graphcap.engine.llm import LLM
from graphcap.inputs.sampling import Sampling

_LLM = "_graphcap_llm"
# A generation config's fields graphcap serves, or that change nothing here.
SERVED = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p",
          "eos_token_id", "pad_token_id", "bos_token_id", "use_cache", "min_length",
          "cache_implementation", "cache_config", "max_cache_len", "return_legacy_cache",
          "transformers_version",
          "_from_model_config", "decoder_start_token_id", "return_dict_in_generate"}
# Fields transformers keeps only in the output return_dict_in_generate asks for: without it,
# their tuples are never filled.
DICT_ONLY = {"output_scores", "output_logits"}
# Fields transformers reads only to sample (its warpers, built under do_sample alone):
# greedy decoding (do_sample=False) leaves them unread, whatever their values.
SAMPLING_ONLY = {"min_p", "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h"}
# Cache implementations that change what transformers' generate returns: "paged" switches it
# to continuous batching (a [1, batch, tokens] tensor, the attention mask unread),
# "quantized" keeps the keys and values in fewer bits (other logits).
OTHER_CACHES = ("paged", "quantized")
# Keyword arguments of generate() that change nothing when None, False or an empty list
# (no logits processors, no stopping criteria); any other value (a tensor too) is refused.
INERT = {"streamer", "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn",
         "synced_gpus", "assistant_model", "negative_prompt_ids",
         "negative_prompt_attention_mask", "use_model_defaults", "custom_generate",
         "tokenizer", "trust_remote_code"}
# ... and those that change nothing only when None (an empty cache given is filled):
# transformers 5's cache, and past_key_values, its old name.
INERT_NONE = {"cache", "past_key_values"}


def accelerate(model, tokenizer=None, **options):
    """Give ``model`` (a stock transformers causal LM) a ``generate`` on graphcap's graphs;
    ``options`` are :class:`~graphcap.engine.llm.LLM`'s (``strategy``, ``max_batch``,
    ``max_len``, ``prefill_tokens``, ...). Returns the model. Its attention and modules
    now run graphcap's (shared, not copied): call it through ``generate`` or a pipeline,
    and :func:`restore` it to run it as before."""
    if _LLM in model.__dict__:
        raise ValueError(f"{type(model).__name__} is accelerated already: restore(model) "
                         "first to accelerate it with other options")
    if not (hasattr(model, "generation_config") and hasattr(model, "get_output_embeddings")):
        raise TypeError(f"accelerate() takes a transformers causal LM, not "
                        f"{type(model).__name__}; graphcap.LLM takes graphcap's own models")
    options.setdefault("progress", False)
    if "stop_at_eos" in options:
        raise ValueError("accelerate() takes no stop_at_eos: each generate() call ends at "
                         "its own eos_token_id, as transformers' does")
    with warnings.catch_warnings():  # each generate() call applies the config, or refuses
        warnings.simplefilter("ignore", DefaultsNotApplied)
        llm = LLM(model, tokenizer, stop_at_eos=False, **options)
    model.__dict__[_LLM] = llm
    model.generate = types.MethodType(_generate, model)
    return model


def restore(model):
    """Undo :func:`accelerate`: transformers' ``generate``, the model's own attention,
    modules and mode; the graphs and cache are freed with the engine. Returns the model."""
    llm = model.__dict__.pop(_LLM, None)
    if llm is None:
        raise ValueError(f"{type(model).__name__} is not accelerated")
    model.__dict__.pop("generate", None)
    return llm.model.release()


def _generate(self, inputs=None, generation_config=None, *, input_ids=None,
              attention_mask=None, **kwargs):
    """transformers' ``generate`` on graphcap's engine (see the module's docstring)."""
    llm: LLM = self.__dict__[_LLM]
    if inputs is not None and input_ids is not None:
        raise ValueError("generate() got the prompts twice, as inputs and as input_ids: give "
                         "one")
    input_ids = inputs if input_ids is None else input_ids
    # transformers: with no max_length anywhere, 20 new tokens (within the positions)
    default_length = kwargs.get("max_length") is None and all(
        getattr(c, "max_length", None) is None for c in (generation_config,
                                                          self.generation_config))
    config, unused = _config(self, generation_config, kwargs)
    # a tensor or numpy array of ids, or a numpy int, as transformers' torch.tensor takes it
    if isinstance(config.eos_token_id, (torch.Tensor, np.ndarray)):
        config.eos_token_id = config.eos_token_id.reshape(-1).tolist()
    elif isinstance(config.eos_token_id, np.integer):
        config.eos_token_id = int(config.eos_token_id)
    if isinstance(config.pad_token_id, (torch.Tensor, np.ndarray, np.integer)):
        config.pad_token_id = int(config.pad_token_id)  # an int: compared with the eos ids
    _refuse(config, unused)
    if self.training:
        raise ValueError(f"{type(self).__name__} is in training mode: transformers' generate "
                         "would decode with its dropout, graphcap's graphs run as in eval "
                         "mode; call model.eval() first")
    if input_ids is None:
        raise ValueError("graphcap's generate needs input_ids (a [batch, tokens] tensor of "
                         "the prompts, as the tokenizer gives)")
    prompts = _prompts(input_ids, attention_mask, config.pad_token_id, config.eos_token_id)
    eos = eos_ids(config.eos_token_id)
    new = _new_tokens(self, config, default_length, input_ids.shape[-1], prompts, llm.max_len,
                      llm.bound)
    sampling = None
    if config.do_sample:
        temperature = 1.0 if config.temperature is None else config.temperature
        if not temperature > 0:
            raise ValueError(f"temperature (={temperature}) must be > 0 to sample "
                             "(do_sample=True); greedy decoding is do_sample=False")
        seed = int(torch.randint(0, 2**62, (1,)))
        top_k, top_p = config.top_k or 0, 1.0 if config.top_p is None else config.top_p
        if top_p == 0:  # transformers keeps the most likely token alone
            top_k, top_p = 1, 1.0
        top_p = min(top_p, 1.0)  # past 1 transformers applies no top-p
        sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    # an eos id outside the vocabulary is never drawn: transformers ends no row on it
    stop = sorted(t for t in eos if 0 <= t < llm.shape.vocab_size)
    _min_length(config.min_length, input_ids.shape[-1], stop)
    done = llm.generate(prompts, new, sampling=sampling, stop=stop)
    first_eos = config.eos_token_id if isinstance(config.eos_token_id, int) else \
        next(iter(config.eos_token_id or []), None)
    pad = config.pad_token_id if config.pad_token_id is not None else \
        (first_eos if first_eos is not None else 0)
    width = max(len(c.tokens) for c in done)
    rows = [c.tokens + [pad] * (width - len(c.tokens)) for c in done]
    # int64, as transformers' (its new tokens are; cat promotes int32 input rows to them)
    out = torch.tensor(rows, dtype=torch.int64, device=input_ids.device)
    sequences = torch.cat([input_ids, out], dim=-1)
    if config.return_dict_in_generate:  # no cache: graphcap's is its own (cache=None)
        from transformers.generation import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _new_tokens(model, config, default_length: bool, length: int, prompts, max_len: int,
                bound: tuple[int, str]) -> int:
    """How many new tokens transformers' ``generate`` draws after ``length`` input tokens
    (``max_new_tokens``, else ``max_length`` less them, else 20 within the model's
    positions); a ValueError where none, or where the longest prompt and they pass the
    accelerated model's ``max_len``, naming the option that asks for them (and a larger
    ``max_len`` only where the LLM's ``bound``, the largest it may have, allows one)."""
    if config.max_new_tokens is not None:
        new, asked = config.max_new_tokens, f"max_new_tokens={config.max_new_tokens}"
    elif default_length:
        top = getattr(model.config, "max_position_embeddings", None)
        new = min(length + (config.max_length or 20), top or 2**62) - length
        asked = "transformers' default of 20 new tokens (no max_length or max_new_tokens)"
    else:
        new = config.max_length - length
        asked = (f"max_length={config.max_length} (the call's, or a generation config's) "
                 f"after {length} input tokens")
    # transformers' 20 new tokens, cut at the model's positions
    if new < 1 and config.max_new_tokens is None and default_length:
        raise ValueError(f"nothing to generate: {length} input tokens fill the model's "
                         f"max_position_embeddings {top}, within which transformers' "
                         "default of 20 new tokens (no max_length or max_new_tokens) stays")
    if new < 1:
        raise ValueError(f"nothing to generate: max_length {config.max_length} leaves no new "
                         f"token after {length} input tokens; give max_new_tokens")
    longest = max(map(len, prompts), default=0)  # none: refused by generate's check
    if longest + new > max_len:
        fewer = f"max_new_tokens={max_len - longest} or fewer" if longest < max_len else \
            f"prompts of fewer than {max_len} tokens"
        top, whose = bound
        again = f", or graphcap.restore(model) and graphcap.accelerate(model, max_len=" \
            f"{longest + new}, ...)" if longest + new <= top else \
            f" ({whose} max_position {top} allows no larger max_len)"
        raise ValueError(
            f"{asked} asks {new} new tokens after a prompt of {longest}: {longest + new} "
            f"tokens pass the max_len {max_len} the model was accelerated with; give "
            f"{fewer}{again}")
    return new


def _min_length(min_length, width: int, stop) -> None:
    """A ``ValueError`` where ``min_length`` acts: transformers keeps the eos ids (those in
    the vocabulary, ``stop``) from every step whose rows, ``width`` input columns and the
    new tokens, are shorter; at most ``width``, or with no eos id, it changes nothing."""
    if stop and min_length is not None and min_length > width:
        raise ValueError(
            f"graphcap's generate does not serve min_length={min_length} past the {width} "
            f"input columns: transformers keeps the eos ids {stop} from the first "
            f"{min_length - width} new tokens; give a min_length of at most {width}, or "
            "graphcap.restore(model) for transformers' own generate")


def _config(model, generation_config, kwargs: dict):
    """The generation config a call of transformers' ``generate`` runs with, and the
    keyword arguments no field takes: the one given, else the model's, each unset field
    from the model's and then transformers' global defaults (``top_k=50``), the call's
    keyword arguments over all (transformers' own ``_prepare_generation_config``)."""
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        return prepare(generation_config, **kwargs)
    config = copy.deepcopy(generation_config if generation_config is not None
                           else model.generation_config)
    return config, config.update(**kwargs)


def _refuse(config, unused: dict) -> None:
    """A ``ValueError`` naming what graphcap's generate does not serve."""
    served = SERVED | (set() if config.do_sample else SAMPLING_ONLY) | (
        set() if config.return_dict_in_generate else DICT_ONLY)
    odd = list(set_defaults(config, served))
    if config.cache_implementation in OTHER_CACHES:
        odd.append(f"cache_implementation={config.cache_implementation!r}")
    odd += sorted(k for k, v in unused.items() if k not in odd and not (
        (k in INERT and _unset(v)) or (k in INERT_NONE and v is None)))
    if odd:
        raise ValueError(
            f"graphcap's generate does not serve {', '.join(odd)}: it serves greedy and "
            "sampled decoding (temperature, top_k, top_p) to max_new_tokens or an "
            "eos_token_id; graphcap.restore(model) gives transformers' own generate back")


def _unset(value) -> bool:
    """An ``INERT`` argument's value that changes nothing: None, False, an empty list (a
    tensor's truth is not asked: negative_prompt_ids of several ids has none)."""
    return value is None or value is False or (isinstance(value, (list, tuple)) and not value)


def _prompts(input_ids, attention_mask, pad, eos) -> list[list[int]]:
    """Each row's prompt: its tokens under the attention mask (left or right padding), or,
    without a mask, those that are not the pad token (when it is not also an eos)."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, tokens], got {tuple(input_ids.shape)}")
    if attention_mask is None:
        if pad is not None and pad not in eos_ids(eos):
            attention_mask = input_ids != pad
        else:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(),
                                                            attention_mask.cpu(), strict=True)]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"rows {empty} of input_ids have no token under the attention mask")
    return rows
