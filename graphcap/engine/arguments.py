"""What ``graphcap.generate`` is given, checked before anything runs: prompts, stop
tokens, sampling parameters; and what a transformers model's generation config sets."""

from __future__ import annotations

import dataclasses
import operator
import warnings

import numpy as np
import torch

from graphcap.core.checks import boolean, progress_option
from graphcap.errors import BadBatch
from graphcap.inputs.sampling import Sampling


def check_strategy(strategy, what: str = "strategy") -> str:
    """A strategy's name (:data:`graphcap.api.STRATEGIES`); ValueError naming ``what``."""
    from graphcap.api import STRATEGIES

    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise ValueError(f"{what}={strategy!r}: unknown strategy, choose one of "
                         f"{sorted(STRATEGIES)}")
    return strategy


def check_options(strategy, tokenizer, stop_at_eos, long_prompts, progress) -> None:
    """``LLM``'s options that need no model: a strategy's name, a tokenizer object (one
    with ``decode``), True or False where a flag is asked, a bar or a callback."""
    check_strategy(strategy)
    if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
        raise TypeError(f"tokenizer must be a tokenizer object (transformers' "
                        f"AutoTokenizer.from_pretrained(...)), got {tokenizer!r}")
    boolean(stop_at_eos, "stop_at_eos")
    boolean(long_prompts, "long_prompts")
    progress_option(progress)


def check_encodes(tokenizer) -> None:
    """A tokenizer text prompts may be given to: one there is, called to encode (a
    ``tokenizers.Tokenizer`` decodes an LLM's results, but is not called so)."""
    if tokenizer is None:
        raise ValueError("text prompts need a tokenizer: LLM(model, tokenizer), or give "
                         "lists of token ids")
    if not callable(tokenizer):
        raise TypeError(f"text prompts need a tokenizer that encodes, tokenizer(text)"
                        f"['input_ids'] (transformers'); this {type(tokenizer).__name__} "
                        "only decodes: give lists of token ids")


def ends_on(token: int, made: int, stops: set[int], max_new: int) -> str | None:
    """Why a request ends on ``token``, its ``made``-th new one: a stop token, its length,
    or not (None)."""
    return "stop" if token in stops else "length" if made == max_new else None


def max_len_of(max_len, bound: int, room: int, default: int) -> int:
    """``LLM``'s ``max_len`` (a positive int, checked by the caller; None: the model's
    ``bound``, its max_position, less the ``room`` a proposer's ``k`` proposals take past
    a request's last token, at most ``default``), checked against ``bound``; ValueError
    naming what fits."""
    if room >= bound:
        raise ValueError(f"the proposer's k = {room} leaves no room under the model's "
                         f"max_position {bound} (a verify step writes k tokens past a "
                         "request's last): give it a smaller k")
    derived = max_len is None
    if derived:
        max_len = min(bound - room, default)
    elif max_len + room > bound:
        k, why = (f" plus the proposer's k = {room}", "a verify step writes k tokens past "
                  "a request's last; ") if room else ("", "")
        raise ValueError(f"max_len {max_len}{k} passes the model's max_position {bound}: "
                         f"{why}build the LLM with max_len at most {bound - room}")
    if max_len < 2:  # a request is a prompt token and a new one at least
        raise ValueError(f"max_len {max_len} holds no request (a prompt token and a new "
                         "token at least): build the LLM with max_len at least 2"
                         + (f" (the model's max_position {bound} less the proposer's k = "
                            f"{room} leaves {bound - room}: a smaller k)" if derived else ""))
    return max_len


def check_length(ids: list[list[int]], max_new: int, max_len: int, bound: int,
                 whose: str = "the model's") -> None:
    """The longest of a call's prompts ``ids`` plus ``max_new`` new tokens within the
    LLM's ``max_len`` (``bound``: the largest it may be built with, set by ``whose``
    max_position); ValueError naming the prompt, and what fits: fewer new tokens, or a
    larger ``max_len`` where one may be."""
    index = max(range(len(ids)), key=lambda i: len(ids[i]))
    prompt = len(ids[index])
    if prompt + max_new <= max_len:
        return
    room = max_len - prompt
    fits = f"generate at most {room} new token{'s' * (room != 1)}" if room > 0 else \
        f"give prompts of fewer than {max_len} tokens"
    at_most = f" (at most {bound})" if bound < 2**31 else ""  # 2**31: the model has no bound
    where = f"{fits}, or build it with a larger max_len{at_most}" if max_len < bound \
        else f"{fits} ({whose} max_position allows no larger max_len)"
    raise ValueError(f"prompt {index} of {prompt} tokens plus {max_new} new ones passes "
                     f"this LLM's max_len {max_len}: {where}")


def check_prompts(prompts, vocab: int) -> list[list[int]]:
    """``prompts`` as lists of ints: a list or tuple of token-id sequences (lists, 1-d
    tensors or numpy arrays; numpy and tensor ints taken), or a 2-d tensor or array, a
    prompt a row."""
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if getattr(prompts, "ndim", None) != 2:
            raise ValueError(f"prompts given as a tensor or array must be 2-d, a prompt a "
                             f"row; got {getattr(prompts, 'ndim', '?')}-d: for one prompt "
                             "pass [ids]")
        prompts = list(prompts)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if all(_is_id(t) for t in prompts):
        head = ", ".join(map(str, prompts[:6])) + (", ..." if len(prompts) > 6 else "")
        raise ValueError(f"prompts is a list of token-id lists, one per prompt: for one "
                         f"prompt pass [[{head}]], not [{head}]")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, (bytes, bytearray, set, frozenset, dict)):  # iterable, no ids
            raise BadBatch(f"prompt {i} is {type(p).__name__} {p!r}: a prompt is a list of "
                           "token ids in order (or, to an LLM with a tokenizer, a str)")
        try:
            ids = token_ids(p)
        except TypeError:  # a number, a 0-d tensor, a float or bool among the ids
            ids = None
        if not ids or not all(0 <= t < vocab for t in ids):  # BadBatch: a ValueError
            raise BadBatch(f"prompt {i} must be a non-empty list of token ids in "
                           f"[0, {vocab}), got {p!r}")
        out.append(ids)
    return out


def _is_id(value) -> bool:
    try:
        _token_id(value)
    except TypeError:
        return False
    return True


def token_ids(values) -> list[int]:
    """``values`` (a sequence, 1-d tensor or numpy array of integers; numpy and tensor
    ints taken) as a list of ints; TypeError where one is no integer (a float, a bool)."""
    return [_token_id(t) for t in (values.tolist() if hasattr(values, "tolist") else values)]


def _token_id(value) -> int:
    """``value`` as an int; TypeError for a bool (no token id, though ``True == 1``) and
    for a tensor that is not 0-d (a prompt's or several ids, as a numpy array is)."""
    if isinstance(value, torch.Tensor):  # its value: a bool one is refused below
        if value.dim() != 0:
            raise TypeError(value)
        value = value.item()
    if isinstance(value, bool):
        raise TypeError(value)
    return operator.index(value)


def eos_ids(value) -> set[int]:
    """An ``eos_token_id`` as transformers' configs give it (an int, a list of them, or
    None) as a set of ids."""
    return {int(v) for v in ([value] if isinstance(value, int) else value or [])}


def stop_tokens_of(stop_tokens, vocab: int, name: str = "stop_tokens",
                   kinds: str = "token ids (ints)") -> set[int]:
    """``stop_tokens`` (None, an id, or a list, set or tensor or array of ids) as a set of
    ids below ``vocab``; refused as the argument ``name`` of ``kinds``."""
    if stop_tokens is None:
        return set()
    given = stop_tokens
    if isinstance(stop_tokens, (torch.Tensor, np.ndarray)):
        stop_tokens = stop_tokens.reshape(-1).tolist()
    elif isinstance(stop_tokens, (int, np.integer)):  # one id (a bool is refused below)
        stop_tokens = [stop_tokens]
    try:
        stops = {_token_id(t) for t in stop_tokens}
    except TypeError:
        raise ValueError(f"{name} must be {kinds}, got {given!r}") from None
    if any(not 0 <= t < vocab for t in stops):
        raise ValueError(f"{name} {sorted(stops)} must lie in [0, {vocab})")
    return stops


def stops_of(stop, has_tokenizer: bool, vocab: int) -> tuple[set[int], tuple[str, ...]]:
    """``generate``'s ``stop`` (a token id, a string, or a list, set or 1-d tensor or
    array of them) as its token ids and its strings (which need a tokenizer)."""
    single = isinstance(stop, (str, int, np.integer)) and not isinstance(stop, bool)
    array = isinstance(stop, (torch.Tensor, np.ndarray))  # 0-d: one id
    if isinstance(stop, (bytes, dict, bool, float)) or (array and stop.ndim > 1) or not (
            stop is None or single or array or hasattr(stop, "__iter__")):
        raise ValueError(f"stop must be a token id, a string, or a list, set or 1-d tensor "
                         f"or array of them, got {type(stop).__name__} {stop!r}")
    given = [] if stop is None else [stop] if single else \
        stop.reshape(-1).tolist() if array else list(stop)
    strings = tuple(s for s in given if isinstance(s, str))
    if strings and not has_tokenizer:
        raise ValueError(f"stop strings {list(strings)} need a tokenizer: LLM(model, "
                         "tokenizer), or stop on token ids")
    if any(not s for s in strings):
        raise ValueError("a stop string must not be empty")
    ids = [s for s in given if not isinstance(s, str)]
    return stop_tokens_of(ids, vocab, "stop", "token ids (ints) or strings"), strings


def sampling_of(sampling, count: int) -> list[Sampling]:
    """One Sampling per prompt. One given for all: each prompt draws with a seed of its
    own, derived from it and the prompt's index (the same prompt twice draws twice)."""
    if sampling is None:
        return [Sampling()] * count
    if isinstance(sampling, Sampling):
        return [dataclasses.replace(sampling, seed=(sampling.seed * 1000003 + i) % 2**63)
                for i in range(count)]
    try:
        if isinstance(sampling, (str, bytes, dict)):  # iterable, but no list of Samplings
            raise TypeError
        sampling = list(sampling)
    except TypeError:
        raise ValueError(f"sampling must be a graphcap.Sampling (one for all prompts), a "
                         f"list of them (one per prompt) or None, got {sampling!r}") from None
    if len(sampling) != count:
        raise ValueError(f"sampling: one Sampling for every prompt, or one for all; got "
                         f"{len(sampling)} for {count} prompts")
    for i, s in enumerate(sampling):
        if not isinstance(s, Sampling):
            raise ValueError(f"sampling[{i}] must be a graphcap.Sampling, got {s!r}")
    return sampling


# A generation config's fields that set no decoding choice graphcap's engine makes: ids,
# lengths (LLM.generate takes max_new_tokens), cache settings, bookkeeping.
NOT_DECODING = {"max_new_tokens", "max_length", "eos_token_id", "pad_token_id",
                "bos_token_id", "use_cache", "cache_implementation", "cache_config",
                "max_cache_len", "return_legacy_cache", "transformers_version",
                "_from_model_config", "decoder_start_token_id"}


class DefaultsNotApplied(UserWarning):
    """A transformers model's generation config sets decoding defaults ``graphcap.LLM``
    does not apply: its tokens follow ``generate``'s own ``sampling=``."""


def _neutral_values(config) -> dict:
    """Each field's values that change nothing: the class's default and transformers'
    global default (what ``generate`` fills an unset field with: ``num_beams=1``,
    ``repetition_penalty=1.0``, ...; some versions write these into the config)."""
    blank = type(config)()
    fill = getattr(type(config), "_get_default_generation_params", dict)()
    return {k: (getattr(blank, k, None), fill.get(k)) for k in config.to_dict()}


# Fields a 0 or an empty value of which transformers acts on, where the others are unset:
# it changes the decoding (id 0 forced, no guidance, no time, assisted generation from
# layer 0), or transformers refuses it (a penalty or typical_p of 0, no bad words, no stop
# strings, an empty sequence bias, ...).
ZERO_ACTS = {"forced_bos_token_id", "forced_eos_token_id", "guidance_scale", "max_time",
             "repetition_penalty", "encoder_repetition_penalty", "typical_p", "top_h",
             "bad_words_ids", "sequence_bias", "stop_strings",
             "exponential_decay_length_penalty", "prompt_lookup_num_tokens",
             "assistant_early_exit", "dola_layers", "constraints", "force_words_ids",
             "watermarking_config"}


def set_defaults(config, served: set[str]) -> dict:
    """The fields of a generation config outside ``served`` set to a value that changes
    decoding, with their values: a 0 or an empty value only where it acts (``ZERO_ACTS``;
    False never); keys that are no field of its class (``presence_penalty`` in some
    published configs) transformers never reads."""
    neutral, fields = _neutral_values(config), set(type(config)().to_dict())
    return {k: v for k, v in sorted(config.to_diff_dict().items())
            if k in fields and k not in served and v not in neutral.get(k, (None,))
            and (v or (k in ZERO_ACTS and v is not None and v is not False))}


def _generation_config(model):
    """A wrapped transformers model's generation config (None for other models)."""
    return getattr(getattr(model, "hf_model", None), "generation_config", None)


def eos_of(model, tokenizer) -> set[int]:
    """The end-of-sequence ids of a transformers model's generation config and of the
    tokenizer (none for graphcap's reference decoders without a tokenizer)."""
    config = _generation_config(model)
    return eos_ids(getattr(config, "eos_token_id", None)) | \
        eos_ids(getattr(tokenizer, "eos_token_id", None))


def warn_unapplied_defaults(model) -> None:
    """Warn (:class:`DefaultsNotApplied`) where a transformers model's generation config
    sets decoding defaults (``do_sample``, ``temperature``, ``repetition_penalty``, ...):
    ``graphcap.LLM`` follows ``generate``'s own arguments, not these."""
    config = _generation_config(model)
    unapplied = set_defaults(config, NOT_DECODING) if config is not None else {}
    if unapplied:
        given = ", ".join(f"{k}={v!r}" for k, v in unapplied.items())
        warnings.warn(f"the model's generation_config sets {given}: graphcap.LLM applies "
                      "none of these; its requests decode greedily, or as generate()'s "
                      "sampling=graphcap.Sampling(temperature, top_k, top_p) says",
                      DefaultsNotApplied, stacklevel=3)
