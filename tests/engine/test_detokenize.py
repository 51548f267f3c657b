"""A stream's text, decoded a few tokens at a time: the same text a whole decode gives,
cut at the same stop string, at a cost per token that does not grow with the text."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from graphcap.engine.detokenize import Detokenizer, cut, text_of
from tests.support.tokenizers import byte_tokenizer

pytest.importorskip("tokenizers")


def _streamed(tok, tokens, stops=(), context=()):
    """The deltas' text (after the prompt's last tokens ``context``), whether a stop
    string ended it, and how many tokens were decoded in all."""
    decoded = []
    real = tok.decode

    class Counting:
        def decode(self, ids, **kw):
            decoded.append(len(ids))
            return real(ids, **kw)

    text = Detokenizer(Counting(), tuple(stops), context)
    out, hit = [], False
    for i, t in enumerate(tokens):
        delta, hit = text.add([t], final=i == len(tokens) - 1)
        out.append(delta)
        if hit:
            break
    return "".join(out), hit, sum(decoded)


def _metaspace_tokenizer():
    """A sentencepiece-like tokenizer: words carry their leading space as "▁", which a
    decode drops at the start of the text."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<pad>", "<s>", "</s>", "▁the", "▁graph", "s", "▁is", "▁fast", ",", "▁a", "b",
             "▁", "é"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Metaspace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                bos_token="<s>", eos_token="</s>")


def _cleanup_tokenizer(partial: bool = False):
    """Words joined by spaces, whose decode cleans up " ." into "." (transformers'
    clean_up_tokenization_spaces): a token may change the text before it. ``partial``:
    with the two bytes of "é" (ids 10, 11) and "." then the first of them (12)."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    words = ["<pad>", "<s>", "</s>", "the", "cat", ".", "x", "Ġ", ",", "!"]
    words += ["Ã", "©", ".Ã"] * partial
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        clean_up_tokenization_spaces=True)


BYTES = byte_tokenizer()
CLEANUP = _cleanup_tokenizer()
CLEANUP_BYTES = _cleanup_tokenizer(partial=True)
WORDS = _metaspace_tokenizer()
# Bytes of text with two- to four-byte characters, stray continuation bytes and specials.
TEXT_BYTES = st.lists(st.one_of(
    st.text(alphabet="ab c,é€😀", min_size=1, max_size=3).map(lambda s: list(s.encode())),
    st.lists(st.sampled_from([0, 1, 2, 0x80, 0xC3, 0xFF]), min_size=1, max_size=2)),
    min_size=1, max_size=20).map(lambda parts: [b for p in parts for b in p])


@settings(max_examples=60)
@given(TEXT_BYTES)
def test_streamed_text_is_the_whole_decode(tokens):
    text, hit, _ = _streamed(BYTES, tokens)
    assert text == BYTES.decode(tokens, skip_special_tokens=True) and not hit


@settings(max_examples=60)
@given(st.lists(st.integers(0, 12), min_size=1, max_size=30))
def test_a_tokenizer_that_drops_a_leading_space_streams_its_whole_decode(tokens):
    text, _, _ = _streamed(WORDS, tokens)
    assert text == WORDS.decode(tokens, skip_special_tokens=True)


def _first_cut(tok, tokens, stops, context=()):
    """The text of ``tokens`` cut as at the first of them whose text shows a stop string
    (the request ends there: "a," of "a,a" ends at "," before "a,a" can appear)."""
    shown = [cut(text_of(tok, list(context), tokens[:n]), tuple(stops))
             for n in range(1, len(tokens) + 1)]
    return next((s for s in shown if s[1]), shown[-1])


@settings(max_examples=60)
@example(list(b"a,a"), [",", "a,a"])  # the later stop string would begin earlier
@given(TEXT_BYTES, st.lists(st.text(alphabet="ab c,é", min_size=1, max_size=3),
                            min_size=1, max_size=3))
def test_streamed_text_ends_where_the_whole_decode_first_shows_a_stop_string(tokens, stops):
    text, hit, _ = _streamed(BYTES, tokens, stops)
    assert (text, hit) == _first_cut(BYTES, tokens, stops)


@settings(max_examples=60)
@example([7, 9])  # " " handed out, then "!": the decode cleans " !" up into "!"
@example([3, 7, 5, 6])  # "the " handed out, then ".": "the." and "x" after it
@given(st.lists(st.integers(0, 9), min_size=1, max_size=20))
def test_a_clean_up_of_text_already_handed_out_loses_none_of_the_text_after_it(tokens):
    # What was handed out stays as it was (a space the clean-up drops included): the
    # stream is the decode without the clean-up, every later character in it.
    text, _, _ = _streamed(CLEANUP, tokens)
    assert text == CLEANUP.decode(tokens, skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False)


def test_each_token_costs_the_same_however_long_the_text():
    tokens = list(("graphs capture once, replay often. " * 40).encode())
    _, _, decoded = _streamed(BYTES, tokens, stops=["never"])
    assert decoded <= 4 * len(tokens)  # a whole decode a step: len(tokens)**2 / 2


def test_no_tokens_after_a_stop_string():
    text = Detokenizer(BYTES, ("b",))
    assert text.add(list(b"ab")) == ("a", True)
    with pytest.raises(ValueError, match="stop string"):
        text.add(list(b"c"))


@settings(max_examples=60)
@example([3, 7, 4, 7, 5, 7, 6], ["cat."])  # "the cat . x", cleaned up: "the cat. x"
@given(st.lists(st.integers(0, 9), min_size=1, max_size=20),
       st.lists(st.sampled_from(["cat.", "t.", "x,", ". x", "!"]), min_size=1, max_size=2))
def test_a_stop_string_a_clean_up_completes_is_found_where_a_whole_decode_shows_it(tokens,
                                                                                    stops):
    # The step a stop string first shows in the whole decode of the tokens so far.
    first = next((i for i in range(len(tokens)) if cut(CLEANUP.decode(
        tokens[:i + 1], skip_special_tokens=True), tuple(stops))[1]), None)
    text = Detokenizer(CLEANUP, tuple(stops))
    hits = []
    for i, t in enumerate(tokens):
        hits.append(text.add([t], final=i == len(tokens) - 1)[1])
        if hits[-1]:
            break
    assert (len(hits) - 1 if hits[-1] else None) == first


def test_a_completion_keeps_the_space_a_tokenizer_drops_where_its_decode_starts():
    # SentencePiece's decode (Llama 2's, Mistral's) drops the first token's leading
    # space: "▁graph" alone is "graph". After the prompt it is " graph", what
    # decode(prompt + new) adds to decode(prompt) (transformers' text-generation
    # pipeline's completion): the stream's text, and where stop strings are looked for.
    prompt, new = [1, 3], [4, 5, 6]  # "<s>", "▁the"; "▁graph", "s", "▁is"
    assert WORDS.decode(new) == "graphs is"
    assert text_of(WORDS, prompt, new) == " graphs is" == \
        WORDS.decode(prompt + new)[len(WORDS.decode(prompt)):]
    assert _streamed(WORDS, new, context=prompt)[0] == " graphs is"
    assert Detokenizer(WORDS, (" graph",), prompt).add([4]) == ("", True)


@settings(max_examples=60)
@given(st.lists(st.integers(0, 12), max_size=6), st.lists(st.integers(0, 12), min_size=1,
                                                           max_size=30))
def test_a_stream_after_a_prompt_is_what_its_tokens_add_to_the_prompts_decode(context,
                                                                                tokens):
    text, _, _ = _streamed(WORDS, tokens, context=context)
    before = WORDS.decode(context, skip_special_tokens=True)
    whole = WORDS.decode(context + tokens, skip_special_tokens=True)
    assert whole.startswith(before) and text == whole[len(before):] == \
        text_of(WORDS, context, tokens)


@settings(max_examples=60)
@given(TEXT_BYTES, TEXT_BYTES.map(lambda b: b[:5]),
       st.lists(st.text(alphabet="ab c,é", min_size=1, max_size=3), max_size=3))
def test_bytes_streamed_after_a_prompt_end_where_their_text_after_it_shows_a_stop_string(
        tokens, context, stops):
    # a prompt that ends in a partial character its completion finishes included
    text, hit, _ = _streamed(BYTES, tokens, stops, context)
    assert (text, hit) == _first_cut(BYTES, tokens, stops, context)


def _merged_bytes_tokenizer():
    """Bytes, and tokens of an ASCII byte then a character's first byte (a byte-level
    BPE's merges): such a token's text ends in a partial character."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from tests.support.tokenizers import _byte_chars

    chars = _byte_chars()
    table = {chars[b]: b for b in range(256)}
    merges = [(chars[a], chars[b]) for a in b"ab" for b in (0xC3, 0xE2)]
    table.update({x + y: 256 + i for i, (x, y) in enumerate(merges)})
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=table, merges=merges))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok)


MERGED = _merged_bytes_tokenizer()


def _ends_where_the_whole_decode_shows_a_stop_string(tok, tokens, stops,
                                                      cleans_up: bool = False) -> None:
    """The step a stop string first shows in the whole decode, a partial character at its
    end aside, is where the text ends: the tokens after it never come. The text is the
    whole decode's up to the stop string (``cleans_up``: what was handed out before a
    clean-up stays)."""
    def shows(n: int) -> bool:
        return cut(tok.decode(tokens[:n], skip_special_tokens=True).rstrip("\ufffd"),
                   tuple(stops))[1]

    first = next((i for i in range(len(tokens)) if shows(i + 1)), None)
    text = Detokenizer(tok, tuple(stops))
    hits, out = [], []
    for i, t in enumerate(tokens):
        delta, hit = text.add([t], final=i == len(tokens) - 1)
        hits.append(hit)
        out.append(delta)
        if hit:
            break
    assert (len(hits) - 1 if hits[-1] else None) == first
    whole = tok.decode(tokens[:len(hits)], skip_special_tokens=True)
    assert cleans_up or "".join(out) == cut(whole, tuple(stops))[0]


@settings(max_examples=60)
@example([ord("a"), 257], ["ab"])  # "a", then "b" and the first byte of "é"
@given(st.lists(st.sampled_from([*b"ab ", 0xA9, 0x82, 0xAC, 256, 257, 258, 259]),
                min_size=1, max_size=12),
       st.lists(st.sampled_from(["ab", "b", "a é", "é", "€a"]), min_size=1, max_size=2))
def test_a_stop_string_before_a_partial_character_ends_the_text_at_that_token(tokens,
                                                                              stops):
    _ends_where_the_whole_decode_shows_a_stop_string(MERGED, tokens, stops)


@settings(max_examples=60)
@example([3, 4, 7, 12, 11], ["cat."])  # "the cat ." cleaned up, and "é"'s first byte
@given(st.lists(st.integers(3, 12), min_size=1, max_size=12),
       st.lists(st.sampled_from(["cat.", "t.", ". x", "é", ".é"]), min_size=1, max_size=2))
def test_a_stop_string_a_clean_up_completes_before_a_partial_character_ends_the_text_there(
        tokens, stops):
    _ends_where_the_whole_decode_shows_a_stop_string(CLEANUP_BYTES, tokens, stops, True)
