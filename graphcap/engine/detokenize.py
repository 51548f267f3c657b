"""Text of a request's tokens as they come, at a cost per token that does not grow with
the text: each step decodes a window of a few tokens, not the whole request.

The window holds the tokens from the one before the last text was taken to the end
(``start`` to the end, the last text from ``read``): its first token is decoded again so
that a tokenizer which drops a leading space, or joins pieces across a boundary, gives
the same text for it both times, and only what follows it is new. New text that ends in
a partial character (``"\\ufffd"``) waits for the tokens that complete it; the last call
takes it as it is, as a whole decode would. A tokenizer whose decode changes text before
the new token (a clean-up of ``" ."`` into ``"."``) has that step's text decoded whole;
what was already handed out stays as it was, and the new text follows it (none dropped).

Stop strings are looked for in the new text and the ``longest - 1`` characters before
it, so each is found at its first place (new text waiting for a character's last bytes
too, up to that character: a token that ends a stop string and begins a character ends
the request); text that may begin a stop string is held back until it cannot.

A request's text follows its prompt: it is what its tokens add to the decode of the
prompt's last ``CONTEXT`` tokens (:func:`text_of`), so a tokenizer that drops the leading
space of the first token it decodes (SentencePiece's, Llama 2's and Mistral's) keeps the
space before a completion's first word, as ``decode(prompt + new)`` shows it.
"""

from __future__ import annotations

PARTIAL = "\ufffd"  # what a tokenizer's decode shows for an incomplete UTF-8 sequence
CONTEXT = 5  # the prompt's last tokens a request's text is decoded after


def decoded(tokenizer, ids: list[int]) -> str:
    """The text of ``ids``, special tokens left out."""
    return tokenizer.decode(ids, skip_special_tokens=True)


def text_of(tokenizer, context: list[int], tokens: list[int]) -> str:
    """The text ``tokens`` add after ``context`` (a prompt's last tokens): the decode of
    both less the decode of ``context``, where the one begins with the other; else (the
    tokens complete a character the context began, or a clean-up changes its text) the
    decode of ``tokens`` alone."""
    if context:
        before = decoded(tokenizer, context)
        after = decoded(tokenizer, list(context) + list(tokens))
        if after.startswith(before):
            return after[len(before):]
    return decoded(tokenizer, tokens)


class Detokenizer:
    """One request's text: :meth:`add` its new token (or tokens) and get the text they
    add, cut at the first stop string, and whether one has appeared. ``context``: the
    prompt's last tokens, whose text the request's follows (:func:`text_of`)."""

    def __init__(self, tokenizer, stops: tuple[str, ...] = (), context=()):
        self.tokenizer, self.stops = tokenizer, stops
        self.longest = max(map(len, stops), default=0)
        self.context = list(context)
        self.tokens: list[int] = list(context)  # the context, then the request's own
        self.text = ""  # all text taken so far
        self.sent = 0  # characters of ``text`` handed out
        # the window: tokens[start:read] gave the last text (at first, the context's)
        self.start, self.read = 0, len(self.context)
        self.ended = False

    def _decode(self, tokens: list[int]) -> str:
        return decoded(self.tokenizer, tokens)

    def add(self, tokens: list[int], final: bool = False) -> tuple[str, bool]:
        """The text ``tokens`` add (none held back when ``final``), and whether a stop
        string has appeared (then the text ends before it and the request is over)."""
        if self.ended:
            raise ValueError("this request's text ended at a stop string: no tokens follow")
        self.tokens.extend(tokens)
        before = self._decode(self.tokens[self.start:self.read])
        after = self._decode(self.tokens[self.start:])
        # ``text``: the text so far, where it may end a request; with a character's
        # first bytes last, up to it (the text before it is whole), but not yet taken
        searched, text = len(self.text), None
        if not after.startswith(before):  # the decode changed earlier text (" ." to "."):
            whole = text_of(self.tokenizer, self.context,  # the whole text anew,
                            self.tokens[len(self.context):])  # searched anew
            searched = 0
            if final or not whole.endswith(PARTIAL):
                self.sent = shown(self.text[:self.sent], whole)  # in the new text
                self.text = whole
                self.start, self.read = self.read, len(self.tokens)
            else:
                text = whole.rstrip(PARTIAL)
        elif len(after) > len(before) and (final or not after.endswith(PARTIAL)):
            self.text += after[len(before):]
            self.start, self.read = self.read, len(self.tokens)
        elif len(after) > len(before):
            text = self.text + after[len(before):].rstrip(PARTIAL)
        end, hit = len(self.text), False
        if self.stops:
            begin = max(0, searched - self.longest + 1)
            text = self.text if text is None else text
            cuts = [i for i in (text.find(s, begin) for s in self.stops) if i >= 0]
            if cuts:  # the text before a partial character ends a request too
                self.sent = shown(self.text[:self.sent], text)
                self.text, end, hit = text, min(cuts), True
            elif not final:
                end -= held(self.text, self.stops)
        end = max(end, self.sent)
        delta, self.sent = self.text[self.sent:end], end
        self.ended = hit
        return delta, hit


def shown(sent: str, whole: str) -> int:
    """How much of ``whole`` the text ``sent`` (handed out before a decode changed it)
    already shows: ``sent``'s characters matched in order, those the new decode dropped
    (a clean-up's spaces) skipped. What follows is new text, to hand out."""
    at = 0
    for char in sent:
        if at < len(whole) and whole[at] == char:
            at += 1
    return at


def held(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of ``text`` that begins a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])),
               default=0)


def cut(text: str, stops: tuple[str, ...]) -> tuple[str, bool]:
    """``text`` up to the first of ``stops`` in it, and whether one was."""
    cuts = [i for i in (text.find(s) for s in stops) if i >= 0]
    return (text[:min(cuts)], True) if cuts else (text, False)
