"""A byte-level tokenizer built in the test (no download): token ``b`` is byte ``b``, for
the tiny models' vocabularies (the first ``vocab`` bytes; ids 0, 1, 2 double as pad, bos
and eos, as the tiny transformers models' configs say)."""

from __future__ import annotations

import pytest


def byte_tokenizer(vocab: int = 256):
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    chars = _byte_chars()
    table = {chars[b]: b for b in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=chars[0], bos_token=chars[1], eos_token=chars[2])


def _byte_chars() -> dict[int, str]:
    """The character ByteLevel pre-tokenization shows for each byte: printable Latin-1
    bytes as themselves, the rest moved past 255 in order."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
             *range(ord("\xae"), ord("\xff") + 1)]
    moved = [b for b in range(256) if b not in shown]
    table = {b: chr(b) for b in shown}
    table.update({b: chr(256 + i) for i, b in enumerate(moved)})
    return table
