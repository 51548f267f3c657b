"""``graphcap.LLM``: graphs captured once and reused by every call; greedy tokens equal
recomputing every sequence, whatever the batch, the stops and the step at which requests
end (the loop reads each step's tokens one step late); every strategy draws what eager
draws; a long prompt prefills in chunks on graphs; streams yield exactly the final tokens;
text in and out through a tokenizer built here (no download); stock transformers models
are wrapped and give transformers' own greedy tokens."""

from __future__ import annotations

import copy
import functools
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphcap
from graphcap import LLM
from graphcap.api import GRAPHED
from graphcap.engine.proposers import NgramProposer
from graphcap.errors import BackendUnavailable, BadBatch, CacheTooLarge, UnsupportedModel
from graphcap.models import PRESETS, Decoder
from tests.engine.test_decode_steps import recomputed
from tests.engine.test_generate import NEW, PROMPTS, SAMPLINGS, model
from tests.support.runner_helpers import DEVICE
from tests.support.tokenizers import byte_tokenizer

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []


@functools.cache
def llm() -> LLM:
    """One LLM for the tests that only call it: max_batch 3, prefill graphs of 8 tokens."""
    return LLM(model(), max_batch=3, max_len=32, prefill_tokens=8, progress=False)


@functools.cache
def truth(steps: int = 12) -> list[list[int]]:
    """Each prompt's greedy continuation, every sequence recomputed at every step."""
    seqs, _ = recomputed(model().cpu(), PROMPTS, steps)
    return [s[len(p):] for s, p in zip(seqs, PROMPTS, strict=True)]


def cut(tokens: list[int], stops: set[int], new: int) -> list[int]:
    """A request's tokens: up to and with its first stop token, at most ``new``."""
    out = []
    for t in tokens[:new]:
        out.append(t)
        if t in stops:
            break
    return out


def test_greedy_tokens_are_recomputing_every_sequence_and_a_second_call_captures_nothing():
    engine = llm()
    shapes = {name: r["shapes"] for name, r in engine.report().items()}
    built = {name: r["build_s"] for name, r in engine.report().items()}
    for _ in range(2):
        done = engine.generate(PROMPTS, NEW)
        assert [c.tokens for c in done] == [t[:NEW] for t in truth()]
        assert [c.finish_reason for c in done] == ["length"] * len(PROMPTS)
        assert [c.index for c in done] == list(range(len(PROMPTS)))
    report = engine.report()
    assert {name: r["shapes"] for name, r in report.items()} == shapes
    assert {name: r["build_s"] for name, r in report.items()} == built
    assert all(r["recaptures"] == 0 for r in report.values())
    assert not report["decode"]["fallbacks"] and sum(report["decode"]["replays"].values())
    assert engine.cache.owned() == {}  # every request released


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=6),
       st.sets(st.integers(0, 255), max_size=12), st.integers(1, 10))
def test_reading_each_step_one_step_late_never_changes_a_requests_tokens(order, stops, new):
    """Random batches (prompts repeated, more than the slots), random stop sets (tokens
    that end requests at different steps) and lengths: each request's tokens are its
    greedy continuation, cut at its first stop token."""
    prompts = [PROMPTS[i] for i in order]
    done = llm().generate(prompts, new, stop=sorted(stops))
    assert [c.tokens for c in done] == [cut(truth()[i], stops, new) for i in order]
    for c in done:
        assert c.finish_reason == ("stop" if c.tokens[-1] in stops else "length")
    assert llm().cache.owned() == {}


def test_a_stream_yields_exactly_the_final_tokens():
    deltas = list(llm().stream(PROMPTS, NEW, stop=[truth()[0][3]]))
    streamed = {}
    for d in deltas:
        assert d.index not in streamed or streamed[d.index][-1] is not None
        streamed.setdefault(d.index, []).extend(d.tokens)
    want = llm().generate(PROMPTS, NEW, stop=[truth()[0][3]])
    assert [streamed[i] for i in range(len(PROMPTS))] == [c.tokens for c in want]
    last = {d.index: d.finish_reason for d in deltas}
    assert list(last.values()).count(None) == 0
    assert [last[i] for i in range(len(PROMPTS))] == [c.finish_reason for c in want]


def test_a_stream_left_unfinished_releases_its_requests_and_one_call_runs_at_a_time():
    stream = llm().stream(PROMPTS, NEW)
    next(stream)
    with pytest.raises(graphcap.GraphcapError, match="serving another call"):
        llm().generate(PROMPTS, 2)
    stream.close()
    assert llm().cache.owned() == {}
    assert [c.tokens for c in llm().generate(PROMPTS[:2], 3)] == [t[:3] for t in truth()[:2]]


def test_a_prompt_longer_than_the_prefill_graphs_prefills_in_chunks_on_graphs():
    before = llm().report()
    done = llm().generate([PROMPTS[2]], 4)  # 11 tokens: a chunk of 8, then 3 on its 8
    assert done[0].tokens == truth()[2][:4]
    after = llm().report()
    assert after["prefill"]["fallbacks"] == before["prefill"]["fallbacks"]
    assert sum(after["extend"]["replays"].values()) == \
        sum(before["extend"]["replays"].values()) + 1


def test_no_prefill_graph_is_captured_past_what_a_call_may_prefill():
    """One request of at most 32 tokens prefills 31 at most (it draws one at least): no
    prefill graph past 31 tokens, no extend graph for a prompt of 8 tokens at most; the
    longest prompt still prefills on a graph, and a longer call is refused."""
    one = LLM(model(), max_batch=1, max_len=32, progress=False)  # prefill_tokens=512
    assert one.report()["prefill"]["shapes"] == [1, 2, 3, 4, 6, 8, 12, 16, 24, 31]
    assert one.engine.report()["prefill_buckets"][-1] == 31 and "extend" not in one.report()
    prompt = PROMPTS[2] * 3  # 33 tokens: 31 of them
    assert one.generate([prompt[:31]], 1)[0].tokens == recomputed(model().cpu(), [prompt[:31]],
                                                                  1)[0][0][31:]
    assert not one.report()["prefill"]["fallbacks"]
    with pytest.raises(ValueError, match="max_len 32"):
        one.generate([prompt[:32]], 1)
    short = LLM(model(), max_batch=2, max_len=9, prefill_tokens=8, progress=False)
    assert "extend" not in short.report()  # its prompts: 8 tokens at most
    assert short.report()["prefill"]["shapes"][-1] == 8
    assert [c.tokens for c in short.generate([PROMPTS[2][:8], PROMPTS[0]], 1)] == \
        [c.tokens for c in llm().generate([PROMPTS[2][:8], PROMPTS[0]], 1)]


@pytest.mark.parametrize("strategy", GRAPHED)
def test_every_strategy_draws_what_generate_draws_eagerly(strategy):
    m = model()
    want = graphcap.generate(m, PROMPTS, NEW, strategy="eager", max_batch=3,
                             sampling=SAMPLINGS)
    engine = LLM(m, strategy=strategy, max_batch=3, max_len=24, prefill_tokens=16,
                 progress=False)
    assert [c.tokens for c in engine.generate(PROMPTS, NEW, sampling=SAMPLINGS)] == \
        want.tokens
    assert [c.tokens for c in engine.generate(PROMPTS, NEW, sampling=SAMPLINGS)] == \
        want.tokens  # seeded: the same again


def test_text_in_and_text_out_through_a_tokenizer_ending_at_a_stop_string():
    tok = byte_tokenizer()
    engine = LLM(model(), tok, max_batch=2, max_len=48, prefill_tokens=16, progress=False)
    prompts = ["graphs!", "hi"]
    plain = engine.generate(prompts, 12)
    for c, p in zip(plain, prompts, strict=True):
        assert c.tokens == engine.generate([tok(p)["input_ids"]], 12)[0].tokens
        assert c.text == tok.decode(c.tokens, skip_special_tokens=True)
    with pytest.raises(ValueError, match=r"prompt 1 is text that tokenizes to no ids \(''\)"):
        engine.generate(["hi", ""], 4)
    with pytest.raises(ValueError, match=r"mix text \(prompt 1\) and token ids \(prompt 0\)"):
        engine.generate([[5, 6], "hi"], 4)
    with pytest.raises(ValueError, match=r"prompt 0 is bytes b'hi'.*or, to an LLM with a "
                                         "tokenizer, a str"):
        engine.generate([b"hi"], 4)  # not its bytes as token ids
    text = plain[0].text
    stop = text[4:6]  # two characters from the middle of what it says
    ended = engine.generate(prompts[:1], 12, stop=[stop])[0]
    assert ended.finish_reason == "stop_string" and ended.text == text[:text.find(stop)]
    assert ended.tokens == plain[0].tokens[:len(ended.tokens)]
    streamed = "".join(d.text for d in engine.stream(prompts[:1], 12, stop=[stop]))
    assert streamed == ended.text
    once = engine.generate(prompts[:1], 12, stop=iter([stop]))[0]  # read once
    assert (once.finish_reason, once.text) == ("stop_string", ended.text)


def test_text_prompts_to_a_tokenizer_that_only_decodes_are_refused_naming_it():
    # tokenizers' own Tokenizer decodes the results, but is not called to encode
    raw = byte_tokenizer()._tokenizer
    engine = LLM(model(), raw, max_batch=1, max_len=16, progress=False)
    assert engine.generate([[5, 6]], 2)[0].text is not None
    with pytest.raises(TypeError, match="text prompts need a tokenizer that encodes.*"
                                        "this Tokenizer only decodes"):
        engine.generate(["hi"], 2)
    assert engine.cache.owned() == {}


def test_a_stop_string_completed_by_the_last_allowed_token_is_why_the_request_ended():
    tok = byte_tokenizer()
    engine = LLM(model(), tok, max_batch=2, max_len=48, prefill_tokens=16, progress=False)
    plain = engine.generate(["graphs!"], 8)[0]
    n = next(i for i in range(1, 8)  # the first new token whose text is new
             if tok.decode(plain.tokens[i:i + 1]) not in tok.decode(plain.tokens[:i]))
    stop = tok.decode(plain.tokens[n:n + 1])
    cut = engine.generate(["graphs!"], n + 1, stop=[stop])[0]  # its last token has it
    assert (cut.finish_reason, cut.tokens) == ("stop_string", plain.tokens[:n + 1])
    assert cut.text == plain.text[:plain.text.find(stop)]


def test_a_completions_text_follows_its_prompt_where_a_decode_drops_a_leading_space():
    # A SentencePiece-like tokenizer (Llama 2's, Mistral's): "▁a" decoded alone is "a".
    # A completion's text, streamed or not, is what its tokens add to its prompt's
    # decode: " a", so prompt + text reads as decode(prompt + tokens) does.
    from dataclasses import replace

    from tests.engine.test_detokenize import WORDS

    torch.manual_seed(0)
    m = Decoder(replace(PRESETS["tiny"], vocab_size=len(WORDS))).to(DEVICE).eval()
    engine = LLM(m, WORDS, max_batch=2, max_len=32, prefill_tokens=8, progress=False,
                 stop_at_eos=False)
    prompts = ["the graphs is", "a b"]
    done = engine.generate(prompts, 6)
    assert WORDS.convert_ids_to_tokens(done[0].tokens[0]).startswith("▁")  # a space
    for c, p in zip(done, prompts, strict=True):
        ids = WORDS(p)["input_ids"]
        whole, before = (WORDS.decode(t, skip_special_tokens=True)
                         for t in (ids + c.tokens, ids))
        assert c.text == whole[len(before):]
        assert "".join(d.text for d in engine.stream([p], 6)) == c.text


def test_generate_without_stop_strings_decodes_each_completions_text_once(monkeypatch):
    # Its steps need no text (nothing to find in it): the text of each completion once
    # (two decodes: its prompt's last tokens, and those with its own), not a decode a
    # step of everything drawn so far.
    tok = byte_tokenizer()
    engine = LLM(model(), tok, max_batch=2, max_len=48, prefill_tokens=16, progress=False)
    decodes = []
    real = tok.decode
    monkeypatch.setattr(tok, "decode", lambda *a, **k: decodes.append(1) or real(*a, **k))
    done = engine.generate(["graphs!", "hi"], 12)
    assert len(decodes) == 4 and all(c.text == real(c.tokens, skip_special_tokens=True)
                                     for c in done)
    assert engine.generate(["graphs!"], 12, stop=[done[0].text[4:6]])[0].finish_reason \
        == "stop_string"  # with one, each step's text is read for it


@pytest.mark.parametrize("stop", [b"H", {72: 0}, torch.tensor([[72]]), 1.5, True])
def test_a_stop_that_is_no_token_id_string_or_list_of_them_is_refused(stop):
    with pytest.raises(ValueError, match="stop must be a token id, a string, or a list"):
        llm().generate(PROMPTS[:1], 2, stop=stop)
    assert llm().generate(PROMPTS[:1], 2, stop=torch.tensor(72))[0].tokens  # 0-d: one id


@pytest.mark.parametrize(("stop", "match"), [
    ([1.0], r"^stop must be token ids \(ints\) or strings, got \[1.0\]"),
    ([10**6], r"^stop \[1000000\] must lie in \[0, ")])
def test_a_stop_holding_no_token_id_is_refused_naming_stop(stop, match):
    """Not stop_tokens: the argument of graphcap.generate, which LLM.generate lacks."""
    with pytest.raises(ValueError, match=match):
        llm().generate(PROMPTS[:1], 2, stop=stop)


def test_a_stock_transformers_model_is_wrapped_and_gives_its_own_greedy_tokens():
    pytest.importorskip("transformers")
    from tests.hf.test_hf_generate import transformers_greedy
    from tests.support.hf_families import hf_model

    ref = hf_model("llama").to(DEVICE)
    engine = LLM(copy.deepcopy(ref), max_batch=2, max_len=32, prefill_tokens=16,
                 progress=False)
    prompts = [[5, 9, 2, 7, 1], [3, 4], [8, 8, 4, 11, 6, 2, 9, 10, 13]]
    want = [transformers_greedy(ref, p) for p in prompts]  # 6 new, at its eos if any
    assert [c.tokens for c in engine.generate(prompts, 6)] == want


def test_the_decode_attention_is_named_as_the_prefill_one_is():
    named = LLM(model(), max_batch=3, max_len=32, prefill_tokens=8, progress=False,
                attention="torch_masked", decode_attention="graphcap")
    prompts = [[5, 9, 2, 7, 1], [3, 4]]
    assert [c.tokens for c in named.generate(prompts, 6)] == \
        [c.tokens for c in llm().generate(prompts, 6)]


def test_graphcap_generate_takes_a_stock_transformers_model_as_llm_does():
    pytest.importorskip("transformers")
    from tests.hf.test_hf_generate import transformers_greedy
    from tests.support.hf_families import TOKENS, hf_model

    ref = hf_model("llama").to(DEVICE)
    prompts = [[5, 9, 2, 7, 1], [3, 4]]
    got = graphcap.generate(copy.deepcopy(ref), prompts, 6, max_batch=2,
                            prefill_tokens=16, stop_tokens=[TOKENS["eos_token_id"]])
    assert got.tokens == [transformers_greedy(ref, p) for p in prompts]


def test_what_an_llm_refuses_and_says_why():
    with pytest.raises(UnsupportedModel, match="Linear cannot generate: it does not "
                                               "declare graphcap_kv and vocab_size"):
        LLM(torch.nn.Linear(2, 2), progress=False)

    class Windowed(torch.nn.Linear):
        graphcap_kv, vocab_size, graphcap_kv_window = (1, 1, 2), 8, -4

    with pytest.raises(UnsupportedModel, match="Windowed.graphcap_kv_window must be an int "
                                               ">= 0 .*got -4"):
        LLM(Windowed(2, 2), progress=False)
    with pytest.raises(ValueError, match="unknown strategy"):
        LLM(model(), strategy="fast", progress=False)
    with pytest.raises(ValueError, match="attention='fa9'.*flashinfer"):
        LLM(model(), decode_attention="fa9", progress=False)
    with pytest.raises(ValueError, match="not a directory"):
        LLM("/nonexistent/checkpoint", progress=False)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm().generate(["hello"], 2)
    with pytest.raises(ValueError, match="text prompts need a tokenizer"):
        llm().stream(["hello"], 2)  # checked when the stream is made, not at its first
    with pytest.raises(ValueError, match="stop strings .* need a tokenizer"):
        llm().generate(PROMPTS, 2, stop=["x"])
    with pytest.raises(ValueError, match="passes this LLM's max_len 32"):
        llm().generate([[1] * 30], 4)
    assert llm().cache.owned() == {}
    assert [c.tokens for c in llm().generate(PROMPTS[:1], 2)] == [truth()[0][:2]]


def test_a_long_prompt_prefills_a_chunk_between_two_decode_steps_of_the_others():
    """Admitted together, the 5-token prompt decodes while the 11-token one prefills in
    two chunks of at most 8, one between each two decode steps: the short one's second
    token comes before the long one's first, and neither's tokens change."""
    order = [d.index for d in llm().stream([PROMPTS[0], PROMPTS[2]], 6)]
    assert order.index(1) > [i for i, x in enumerate(order) if x == 0][1]
    assert [c.tokens for c in llm().generate([PROMPTS[0], PROMPTS[2]], 6)] == \
        [truth()[0][:6], truth()[2][:6]]
    report = llm().report()
    assert not report["prefill"]["fallbacks"] and not report["extend"]["fallbacks"]


def test_a_long_prompt_prefills_its_chunks_beside_requests_that_end_every_other_step():
    # Short requests of two new tokens end each decode run after one step: the long
    # prompt's chunks still go in one a step, not after the queue of short ones drains.
    engine = LLM(model(), max_batch=2, max_len=40, prefill_tokens=8, progress=False)
    long, short = list(range(10, 27)), [5, 9, 2]
    order = [d.index for d in engine.stream([long] + [short] * 6, 2)]
    assert order.index(0) < order.index(5), order
    want = engine.generate([long], 2, speculate=False)[0].tokens
    assert [c.tokens for c in engine.generate([long] + [short] * 6, 2)][0] == want


@pytest.mark.parametrize("options, error, needle", [
    ({"tokenizer": 3}, TypeError, "tokenizer must be a tokenizer object"),
    ({"stop_at_eos": "no"}, ValueError, "stop_at_eos must be True or False"),
    ({"long_prompts": None}, ValueError, "long_prompts must be True or False"),
    ({"progress": 1}, ValueError, "progress must be True, False, None or a callable"),
    ({"strategy": ["full"]}, ValueError, "unknown strategy"),
    ({"decode_attention": "nope"}, ValueError, "decode_attention='nope'"),
    ({"decode_attention": ["flashinfer"]}, ValueError, "decode_attention=['flashinfer']"),
    ({"attention": ["triton"]}, BackendUnavailable, "no attention backend ['triton']")])
def test_llm_options_of_the_wrong_kind_are_refused_by_name(options, error, needle):
    with pytest.raises(error, match=re.escape(needle)):
        LLM(model(), max_batch=1, max_len=16, **options)


@pytest.mark.parametrize("size", ["max_batch", "max_len", "prefill_tokens", "page_size"])
def test_a_size_that_is_no_positive_int_is_refused_before_a_checkpoint_is_loaded(size):
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match=f"^{size} must be a positive int, got {bad}$"):
            LLM("/nonexistent/checkpoint", progress=False, **{size: bad})


def test_an_llm_of_a_model_on_the_meta_device_is_refused_naming_the_device():
    # it was refused as a model whose attention wrote no K/V to the cache
    with torch.device("meta"):
        m = Decoder(PRESETS["tiny"])
    with pytest.raises(ValueError, match="device='meta'"):
        LLM(m, max_batch=1, max_len=16, prefill_tokens=8, progress=False)


def test_an_llm_whose_cache_the_device_cannot_hold_names_the_max_len_and_batch_that_fit(
        monkeypatch):
    # The tiny model's K and V of a page of 16 tokens: 2 layers x 16 x 2 heads x 16 x 4
    # bytes, twice (8 KiB); 4 requests of 64 tokens take 16 pages and the null page.
    page = 2 * 2 * 16 * 2 * 16 * 4
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 10 * page)
    where = next(model().parameters()).device  # cpu, or cuda:0 on a GPU
    with pytest.raises(CacheTooLarge, match=re.escape(
            "graphcap.LLM: 4 requests (max_batch) of 64 tokens (max_len) need a K/V cache of "
            f"0.13 MiB; {where} has 0.08 MiB free, room for max_len=32 at max_batch=4 or "
            "max_batch=2 at max_len=64: build the LLM with a smaller max_len or max_batch")):
        LLM(model(), strategy="eager", max_batch=4, max_len=64, progress=False)
    with pytest.raises(CacheTooLarge, match=re.escape(  # 5 pages a request of 64 + 3
            "3 requests (max_batch) of 64 tokens (max_len) (and the proposer's k = 3 past "
            f"each) need a K/V cache of 0.12 MiB; {where} has 0.08 MiB free, room for max_len=45 "
            "at max_batch=3 or max_batch=1 at max_len=64")):
        LLM(model(), strategy="eager", max_batch=3, max_len=64, progress=False,
            speculative=NgramProposer(3))
    assert LLM(model(), strategy="eager", max_batch=4, max_len=32, progress=False).cache
    assert LLM(model(), strategy="eager", max_batch=2, max_len=64, progress=False).cache
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: page)
    with pytest.raises(CacheTooLarge, match="room for not one request"):
        LLM(model(), strategy="eager", max_batch=1, max_len=16, progress=False)
    # A block table larger than what is free too: the pages are still what is named.
    monkeypatch.setattr("graphcap.kv.sizing.free_bytes", lambda device: 10 * page)
    with pytest.raises(CacheTooLarge, match=re.escape(
            "11000 requests (max_batch) of 16 tokens (max_len) need a K/V cache of 85.95 MiB; "
            f"{where} has 0.08 MiB free, room for max_batch=9 at max_len=16")):
        LLM(model(), strategy="eager", max_batch=11000, max_len=16, progress=False)


def test_a_capture_out_of_memory_says_what_the_cache_takes_and_what_leaves_more(
        monkeypatch):
    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr("graphcap.engine.engine.capture", out_of_memory)
    m = model()
    with pytest.raises(torch.OutOfMemoryError) as info:
        LLM(m, max_batch=4, max_len=64, progress=False)
    assert info.value.__notes__ == [
        "graphcap: the paged K/V cache the graphs are captured over takes 0.13 MiB of "
        f"{next(m.parameters()).device} "
        "(4 requests of 64 tokens): a smaller max_batch or max_len leaves the graphs more"]

    def draft_cache_too_large(*args, **kwargs):  # a draft model's own cache, say
        raise CacheTooLarge("a K/V cache of 9 pages ...", need=1, free=0, pages=0)

    monkeypatch.setattr("graphcap.engine.engine.capture", draft_cache_too_large)
    with pytest.raises(CacheTooLarge) as info:
        LLM(m, max_batch=4, max_len=64, progress=False)
    assert not getattr(info.value, "__notes__", None)  # its own message: not of our cache


def test_a_numpy_stop_id_is_one_id_and_sampling_given_as_text_is_refused():
    import numpy as np

    assert llm().generate(PROMPTS[:1], 2, stop=np.int64(72))[0].tokens
    assert llm().generate(PROMPTS[:1], 2, stop=np.array(72))[0].tokens  # 0-d: one id
    with pytest.raises(ValueError, match="stop must be a token id, a string, or a list"):
        llm().generate(PROMPTS[:1], 2, stop=np.array([[72]]))
    with pytest.raises(ValueError, match="sampling must be a graphcap.Sampling"):
        llm().generate(PROMPTS[:2], 2, sampling="greedy")


def test_speculate_takes_a_numpy_bool_as_the_other_flags_do_and_refuses_a_string():
    import numpy as np

    assert llm().generate(PROMPTS[:1], 2, speculate=np.bool_(False))[0].tokens
    with pytest.raises(ValueError, match="speculate must be True or False, got 'no'"):
        llm().generate(PROMPTS[:1], 2, speculate="no")


def test_prompts_as_numpy_or_tensor_rows_are_the_same_prompts_as_lists():
    import numpy as np

    want = [c.tokens for c in llm().generate(PROMPTS[:2], 3)]
    assert [c.tokens for c in llm().generate([np.array(p) for p in PROMPTS[:2]], 3)] == want
    assert [c.tokens for c in llm().generate(
        [[np.int64(t) for t in p] for p in PROMPTS[:2]], 3)] == want
    rows = [PROMPTS[0], PROMPTS[0]]
    assert [c.tokens for c in llm().generate(np.array(rows), 3)] == \
        [c.tokens for c in llm().generate(torch.tensor(rows), 3)] == [want[0]] * 2
    with pytest.raises(ValueError, match="must be 2-d, a prompt a row; got 1-d"):
        llm().generate(np.array(PROMPTS[0]), 3)
    with pytest.raises(ValueError, match="prompt 0 must be a non-empty list of token ids"):
        llm().generate([np.array(PROMPTS[0], dtype=np.float32)], 3)


def test_token_ids_as_tensors_are_read_as_numpy_ones_are():
    """A 1-d tensor of one token is a prompt, as a numpy array of one is (not a flat list
    of ids); a 0-d bool tensor is no id, as True is not; a tensor of several ids among
    the stops is refused naming stop, as an array of them is."""
    import numpy as np

    want = [c.tokens for c in llm().generate([[5], [6]], 2)]
    assert [c.tokens for c in llm().generate([np.array([5]), np.array([6])], 2)] == want
    assert [c.tokens for c in llm().generate([torch.tensor([5]), torch.tensor([6])], 2)] == \
        want
    assert [c.tokens for c in llm().generate([[torch.tensor(5)], [torch.tensor(6)]], 2)] \
        == want
    with pytest.raises(BadBatch, match="prompt 0 must be a non-empty list of token ids"):
        llm().generate([[torch.tensor(True), 5]], 2)
    for stop in ([torch.tensor([1, 2])], [np.array([1, 2])]):
        with pytest.raises(ValueError, match="stop must be token ids"):
            llm().generate([[5]], 2, stop=stop)
    with pytest.raises(ValueError, match="stop_tokens must be token ids"):
        graphcap.generate(model(), [[5]], 2, stop_tokens=[torch.tensor([1, 2])])
    assert llm().generate([[5]], 2, stop=[torch.tensor(want[0][0])])[0].tokens == want[0][:1]


@pytest.mark.parametrize("where", ["cache.admit", "cache.release"])
def test_a_ctrl_c_inside_the_engines_bookkeeping_leaves_the_llm_serving(where, monkeypatch):
    # A KeyboardInterrupt right after the cache admitted or released a slot, before the
    # engine recorded it: the next calls are served, token for token.
    fresh = LLM(model(), max_batch=2, max_len=32, prefill_tokens=8, progress=False)
    cache = fresh.engine.cache
    real = getattr(cache, where.split(".")[1])

    def interrupted(*args):
        monkeypatch.setattr(cache, real.__name__, real)
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(cache, real.__name__, interrupted)
    with pytest.raises(KeyboardInterrupt):
        fresh.generate(PROMPTS[:2], NEW)
    for _ in range(2):
        assert [c.tokens for c in fresh.generate(PROMPTS[:2], NEW)] == \
            [t[:NEW] for t in truth()[:2]]


@pytest.mark.parametrize("where", ["serving", "admitting", "releasing"])
def test_a_ctrl_c_at_any_instruction_of_a_call_leaves_nothing_held(where):
    # At each instruction in turn of generate and its stream, of the engine's and the
    # cache's admission, or of their releases: the call lets go of the LLM, every slot
    # and every page, and the next call is served, token for token.
    from graphcap.engine.engine import Engine
    from graphcap.kv import PagedKVCache
    from tests.support.interrupts import code_of, instructions, interrupted

    codes = code_of(*{"serving": (LLM.generate, LLM._serve),
                      "admitting": (Engine.admit, PagedKVCache.admit),
                      "releasing": (Engine.release, Engine.clear,
                                    PagedKVCache.release)}[where])
    fresh = LLM(model(), max_batch=2, max_len=32, prefill_tokens=8, progress=False)
    cache, want = fresh.cache, [t[:1] for t in truth()[:2]]
    count = instructions(codes, fresh.generate, PROMPTS[:2], 1)  # each ends at its prefill
    assert count > 50
    for n in range(1, count + 1):
        _, out = interrupted(codes, n, fresh.generate, PROMPTS[:2], 1)
        assert isinstance(out, KeyboardInterrupt), (n, out)
        assert not fresh.engine.live and cache.owned() == {}, n
        assert cache.free_pages == cache.pages, n
        assert [c.tokens for c in fresh.generate(PROMPTS[:2], 1)] == want, n


def test_a_call_past_max_len_names_the_prompt_and_what_fits_not_a_max_len_past_the_model():
    # An LLM whose max_len is the model's max_position cannot be built larger: the error
    # says how many new tokens fit (or that the prompt leaves room for none) instead.
    import dataclasses

    torch.manual_seed(0)
    bounded = Decoder(dataclasses.replace(PRESETS["tiny"], max_position=24)).eval()
    full = LLM(bounded.to(DEVICE), max_batch=1, prefill_tokens=8, progress=False)
    with pytest.raises(ValueError, match=r"prompt 1 of 23 tokens plus 2 new ones passes "
                       r"this LLM's max_len 24: generate at most 1 new token \(the model's "
                       r"max_position allows no larger max_len\)"):
        full.generate([[1] * 3, [1] * 23], 2)
    with pytest.raises(ValueError, match=r"give prompts of fewer than 24 tokens \(the"):
        full.generate([[1] * 24], 1)
    with pytest.raises(ValueError, match=r"max_len 32: generate at most 2 new tokens, or "
                       r"build it with a larger max_len \(at most 4096\)"):
        llm().generate([[1] * 30], 4)
