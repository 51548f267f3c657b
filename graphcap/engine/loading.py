"""The model an ``LLM`` runs (:func:`resolve`): a local checkpoint directory loaded with
its tokenizer, a stock transformers causal LM wrapped in ``graphcap.hf.PrefillLM``, any
other model as it is."""

from __future__ import annotations

import torch

# Files a tokenizer's vocabulary is read from (transformers' names; Mistral's tekken.json
# and tiktoken.model, which transformers 5 converts): a directory with none of them has no
# tokenizer, tokenizer_config.json or not (unless the class it names reads no file, as
# ByT5's bytes). transformers 5 builds one from the config alone for some families
# (Qwen2/3, Llama, Gemma: an empty vocabulary, every text no ids or unknown ones, whose
# end-of-sequence id, 0 or 1, would end requests).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "merges.txt", "spiece.model", "spm.model",
                   "sentencepiece.bpe.model", "sentencepiece.model", "tokenizer.tiktoken",
                   "tekken.json", "tiktoken.model")


def resolve(model, tokenizer=None):
    """The model graphcap runs, and the tokenizer: a checkpoint directory loaded, a stock
    transformers causal LM wrapped (``PrefillLM``), any other model as it is."""
    import os

    if isinstance(model, (str, os.PathLike)):
        return _load(os.fspath(model), tokenizer)
    if hasattr(model, "generation_config") and hasattr(model, "get_output_embeddings"):
        from graphcap.hf import PrefillLM  # a stock transformers causal LM

        return PrefillLM(model, logits="last"), tokenizer
    return model, tokenizer  # cache_shape says what a model of one's own lacks


def _load(path: str, tokenizer):
    import os

    if not os.path.isdir(path):
        raise ValueError(f"LLM({path!r}): not a directory; give a local Hugging Face "
                         "checkpoint directory (config.json, safetensors, tokenizer files)")
    if not os.path.isfile(os.path.join(path, "config.json")):  # else transformers asks
        # for a model_type key in a config.json that is not there
        raise ValueError(f"LLM({path!r}): the directory has no config.json; give a local "
                         "Hugging Face checkpoint directory (config.json, safetensors, "
                         "tokenizer files)")
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, local_files_only=True, dtype="auto").to(device).eval()
    if tokenizer is None and _has_tokenizer(path):
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # a vocabulary file transformers cannot read: not JSON,
            # or JSON of another shape (KeyError, TypeError, the tokenizers library's own)
            import warnings

            said = " ".join(str(exc).split())[:300]  # one line (tokenizers' has several)
            warnings.warn(f"{path}: its tokenizer did not load ({type(exc).__name__}: "
                          f"{said}): the LLM has no tokenizer (token ids only); "
                          "repair or replace its tokenizer files, or pass LLM(path, "
                          "tokenizer)", stacklevel=4)  # the caller's line
            tokenizer = None
    from graphcap.hf import PrefillLM

    return PrefillLM(hf, logits="last"), tokenizer


def _has_tokenizer(path: str) -> bool:
    """Whether the directory ``path`` holds a tokenizer: a vocabulary file, or a
    tokenizer_config.json naming a class that reads none; a warning where it holds
    tokenizer_config.json alone, naming the files it lacks."""
    import json
    import os
    import warnings

    if any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return True
    config = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config):
        return False
    try:
        with open(config, encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
        from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

        cls = tokenizer_class_from_name(name) if isinstance(name, str) else None
    except (OSError, ValueError, AttributeError, ImportError):  # unread: no such class
        cls = None
    if cls is not None and not getattr(cls, "vocab_files_names", True):
        return True  # ByT5's, Canine's: bytes or characters, no vocabulary file
    warnings.warn(f"{path} holds tokenizer_config.json but no file a tokenizer's "
                  f"vocabulary is read from ({', '.join(TOKENIZER_FILES)}): the LLM has "
                  "no tokenizer (token ids only); copy the checkpoint's tokenizer files "
                  "there, or pass LLM(path, tokenizer)", stacklevel=5)  # the caller's line
    return False
