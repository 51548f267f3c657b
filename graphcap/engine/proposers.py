"""Proposers for speculative decoding: what a verify step
(``PagedInputs(tokens_per_request=1 + k, accept=...)``) checks.

:class:`NgramProposer` is prompt lookup: no weights, only the request's own tokens. The
last ``n`` tokens (longest ``n`` first, from ``max_ngram`` down to ``min_ngram``) are
looked up earlier in the request, most recent occurrence first, and the ``k`` tokens
that followed it are proposed. It pays on repetitive and retrieval-heavy text (code
edits, summaries quoting their source) and costs only a rejected verify step elsewhere.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from graphcap.core.checks import positive_int

_WORD = 8  # bytes of a token id in the search


class NgramProposer:
    """``propose(tokens)``: ``k`` proposed next tokens of a request whose tokens so far
    (prompt and generated) are ``tokens`` (a sequence of ids, or a 1-d numpy array or
    tensor of them). Where no n-gram recurs, or fewer than ``k``
    tokens followed it, the proposal is padded by repeating its last token (the request's
    last token where nothing was found): a verify step takes exactly ``k``."""

    def __init__(self, k: int, max_ngram: int = 3, min_ngram: int = 1):
        self.k = positive_int(k, "k")
        self.max_ngram = positive_int(max_ngram, "max_ngram")
        self.min_ngram = positive_int(min_ngram, "min_ngram")
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram {min_ngram} is above max_ngram {max_ngram}")

    def find(self, tokens: Sequence[int]) -> list[int]:
        """The tokens that followed the most recent earlier occurrence of the longest
        recurring suffix (at most ``k``; empty where none recurs). The search is a bytes
        search over the tokens as 8-byte words (C speed: a step's lookup over thousands
        of tokens takes microseconds), a match counted only where it starts on a word."""
        tokens = _listed(tokens)
        end = len(tokens)
        data = array("q", tokens).tobytes()
        for n in range(min(self.max_ngram, end - 1), self.min_ngram - 1, -1):
            suffix = data[(end - n) * _WORD:]
            stop = (end - 1) * _WORD  # an occurrence ending before the last token
            while (at := data.rfind(suffix, 0, stop)) >= 0:
                if at % _WORD == 0:
                    follows = at // _WORD + n
                    return tokens[follows:follows + self.k]
                stop = at + len(suffix) - 1  # off the word grid: look further back
        return []

    def propose(self, tokens: Sequence[int]) -> list[int]:
        tokens = _listed(tokens)
        if not tokens:
            raise ValueError("a request with no token has nothing to look up")
        found = self.find(tokens)
        pad = found[-1] if found else tokens[-1]
        return found + [pad] * (self.k - len(found))


def _listed(tokens) -> list[int]:
    """A request's tokens as a list (a list as it is: read only): a sequence of ids, or a
    1-d numpy array or tensor (whose truth value, asked of several ids, raises), as its
    ints."""
    if isinstance(tokens, list):
        return tokens
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


__all__ = ["NgramProposer"]
