"""``graphcap.generate``: greedy generation equals recomputing every sequence from scratch;
every strategy generates exactly what eager generates, greedy and seeded, with a decode
batch smaller than the prompts (finished requests' slots take the waiting ones); stop
tokens end a request; bad arguments are refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import graphcap
from graphcap import Sampling
from graphcap.api import GRAPHED
from graphcap.errors import BadBatch
from graphcap.models import PRESETS, Decoder
from tests.engine.test_decode_steps import recomputed
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
PROMPTS = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 11, 6, 2, 9, 10, 13, 1, 2], [4, 4], [7, 7, 7]]
NEW = 7


def model(preset="tiny") -> Decoder:
    torch.manual_seed(0)
    return Decoder(PRESETS[preset]).to(DEVICE).eval()


def test_greedy_generation_is_recomputing_every_sequence():
    m = model()
    want, _ = recomputed(m.cpu(), PROMPTS, NEW)
    got = graphcap.generate(m.to(DEVICE), PROMPTS, NEW, max_batch=2)
    assert [p + t for p, t in zip(PROMPTS, got.tokens, strict=True)] == want
    assert got.report["prefills"] == 3 and not got.report["fallbacks"]


SAMPLINGS = [Sampling(), Sampling(temperature=1.0, seed=3),
             Sampling(temperature=0.7, top_k=5, seed=4), Sampling(temperature=1.5, top_p=0.8),
             Sampling(temperature=1.0, top_k=3, top_p=0.5, seed=9)]


@pytest.mark.parametrize("strategy", GRAPHED)
@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_every_strategy_generates_what_eager_generates(strategy, preset):
    m = model(preset)
    want = graphcap.generate(m, PROMPTS, NEW, strategy="eager", max_batch=3,
                             sampling=SAMPLINGS)
    got = graphcap.generate(m, PROMPTS, NEW, strategy=strategy, max_batch=3,
                            sampling=SAMPLINGS, prefill_tokens=16)
    assert got.tokens == want.tokens
    assert sum(got.report["replays"].values()) == got.report["decode_steps"] > 0
    # 5 + 1 + 11 tokens admitted first: two prefill calls of at most 16 tokens; the
    # requests end together, and the 2 + 3 tokens admitted next go in one call
    assert sum(got.report["prefill_replays"].values()) == got.report["prefills"] == 3
    assert not got.report["prefill_fallbacks"] and not got.report["fallbacks"]
    again = graphcap.generate(m, PROMPTS, NEW, strategy=strategy, max_batch=3,
                              sampling=SAMPLINGS, prefill_tokens=16)
    assert again.tokens == got.tokens  # seeded: reproducible
    other = graphcap.generate(m, PROMPTS, NEW, strategy=strategy, max_batch=3,
                              sampling=[Sampling(temperature=1.0, seed=s + 100)
                                        for s in range(len(PROMPTS))], prefill_tokens=16)
    assert other.tokens != got.tokens


def test_a_prompt_past_the_prefill_graphs_prefills_in_chunks_on_graphs():
    m = model()
    want = graphcap.generate(m, PROMPTS, NEW, strategy="eager", max_batch=2)
    got = graphcap.generate(m, PROMPTS, NEW, strategy="full", max_batch=2, prefill_tokens=8)
    assert got.tokens == want.tokens
    assert got.report["prefill_buckets"] == [1, 2, 3, 4, 6, 8]
    assert not got.report["prefill_fallbacks"]  # the 11-token prompt: 8 tokens, then 3
    assert sum(got.report["extend_replays"].values()) == 1
    assert sum(got.report["prefill_replays"].values()) == got.report["prefills"] - 1
    with pytest.raises(ValueError, match="prefill_tokens must be a positive int"):
        graphcap.generate(m, PROMPTS, NEW, prefill_tokens=0)


def test_long_prompts_false_prefills_them_eagerly_counted_without_a_warning(caplog):
    # The eager prefill was asked for: no warning naming an Engine's options (chunked=True,
    # which an LLM does not take) on the first one, as a runner's unasked fallbacks give.
    m = model()
    want = graphcap.generate(m, PROMPTS, NEW, strategy="eager", max_batch=2)
    llm = graphcap.LLM(m, max_batch=2, max_len=32, prefill_tokens=8, long_prompts=False,
                       progress=False)
    with caplog.at_level("WARNING", logger="graphcap"):
        got = llm.generate(PROMPTS, NEW)
    assert [c.tokens for c in got] == want.tokens
    assert llm.engine.report()["prefill_fallbacks"] == {"too_many_tokens": 1}  # the 11
    assert not [r for r in caplog.records if "ran eagerly" in r.getMessage()]


def test_a_stop_token_ends_its_request_and_is_kept():
    m = model()
    free = graphcap.generate(m, PROMPTS, NEW, max_batch=2).tokens
    stop = free[0][2]
    stopped = graphcap.generate(m, PROMPTS, NEW, max_batch=2, stop_tokens=[stop]).tokens
    for full, cut in zip(free, stopped, strict=True):
        end = full.index(stop) + 1 if stop in full else len(full)
        assert cut == full[:end]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"prompts": [[1, 999]]}, BadBatch, r"token ids in \[0, 256\)"),
    ({"prompts": [[1, -1]]}, BadBatch, r"token ids in \[0, 256\)"),
    ({"prompts": [[]]}, ValueError, "non-empty"),
    ({"max_new_tokens": 0}, ValueError, "positive int"),
    ({"sampling": [Sampling()]}, ValueError, "one Sampling for every prompt"),
    ({"max_new_tokens": 5000}, ValueError, "max_position 4096"),
    ({"prompts": [5, 6, 7]}, ValueError, r"list of token-id lists.*\[\[5, 6, 7\]\]"),
    ({"prompts": [[5, 6], 7]}, ValueError, r"prompt 1 .*list of token ids.*got 7"),
    ({"prompts": [torch.tensor(5)]}, ValueError, r"list of token-id lists, one per prompt"),
    # iterables of ints that are no prompt: text as bytes (its bytes are no token ids)
    # and unordered collections
    ({"prompts": [[5, 6], b"hi"]}, BadBatch, r"prompt 1 is bytes b'hi': a prompt is a list"),
    ({"prompts": [bytearray(b"hi")]}, BadBatch, r"prompt 0 is bytearray"),
    ({"prompts": [{5, 9, 2}]}, BadBatch, r"prompt 0 is set \{.*\}: a prompt is a list of "
                                         "token ids in order"),
    ({"prompts": [{5: 1}]}, BadBatch, r"prompt 0 is dict"),
    ({"stop_tokens": True}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": [3, False]}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": torch.tensor([True])}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": 2.0}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": np.bool_(True)}, ValueError, "stop_tokens must be token ids"),
    ({"stop_tokens": np.array([2.0])}, ValueError, "stop_tokens must be token ids"),
    ({"max_batch": True}, ValueError, "max_batch must be a positive int"),
    ({"page_size": True}, ValueError, "page_size must be a positive int"),
    ({"sampling": 0.5}, ValueError, "sampling must be a graphcap.Sampling"),
    ({"strategy": "fast"}, ValueError, "strategy='fast': unknown strategy"),
])
def test_bad_arguments_are_refused(kwargs, error, match):
    call = {"prompts": PROMPTS, "max_new_tokens": 3, **kwargs}
    with pytest.raises(error, match=match):
        graphcap.generate(model(), call.pop("prompts"), call.pop("max_new_tokens"), **call)


@pytest.mark.parametrize("bad", [{"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0},
                                 {"seed": 1.5}])
def test_bad_sampling_is_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        Sampling(**bad)


@pytest.mark.parametrize(("field", "value", "kind"), [
    ("temperature", "0.5", "str"), ("temperature", None, "NoneType"),
    ("temperature", True, "bool"), ("temperature", float("nan"), "float"),
    ("temperature", float("inf"), "float"), ("temperature", 1e39, "float"),
    ("top_k", "5", "str"), ("top_k", 2.0, "float"), ("top_k", True, "bool"),
    ("top_p", "0.9", "str"), ("top_p", True, "bool"), ("top_p", float("nan"), "float"),
    ("top_p", float("inf"), "float"),
    ("seed", "7", "str"), ("seed", False, "bool"), ("seed", float("inf"), "float"),
])
def test_a_sampling_field_that_is_no_valid_number_is_refused_naming_it_and_its_type(
        field, value, kind):
    with pytest.raises(ValueError, match=rf"Sampling\.{field} .*got .* \({kind}\)"):
        Sampling(**{field: value})


def test_a_top_k_past_int64_is_refused_before_it_reaches_the_device():
    with pytest.raises(ValueError, match=r"top_k must be an int in \[0, 2\*\*63\)"):
        Sampling(top_k=2**70)
    assert Sampling(top_k=2**63 - 1).top_k == 2**63 - 1  # keeps every token


def test_sampling_numbers_of_other_numeric_types_are_taken_as_python_numbers():
    import numpy as np

    s = Sampling(temperature=np.float32(0.5), top_k=np.int64(3), top_p=1, seed=np.uint8(7))
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (0.5, 3, 1.0, 7)
    assert [type(v) for v in (s.temperature, s.top_k, s.top_p, s.seed)] == \
        [float, int, float, int]


def test_one_sampling_for_all_prompts_draws_each_with_its_own_seed():
    same = [[5, 9, 2]] * 4
    out = graphcap.generate(model(), same, NEW, sampling=Sampling(temperature=1.0, seed=7))
    assert len({tuple(t) for t in out.tokens}) > 1  # four draws, not one draw four times


@pytest.mark.parametrize("stops", [lambda t: torch.tensor([t]), lambda t: [torch.tensor(t)],
                                   lambda t: t, np.int64, np.array, lambda t: np.array([t])])
def test_stop_tokens_may_be_tensors_arrays_or_one_int(stops):
    m = model()
    free = graphcap.generate(m, PROMPTS[:1], NEW).tokens[0]
    cut = graphcap.generate(m, PROMPTS[:1], NEW, stop_tokens=stops(free[1])).tokens[0]
    assert cut == free[:free.index(free[1]) + 1]


def test_seeds_count_in_every_bit_and_a_tiny_temperature_is_greedy():
    from graphcap.opsdb.sample import SAMPLE

    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    ones = torch.ones(64)
    keep = (torch.zeros(64, dtype=torch.long), torch.ones(64))
    counter = torch.zeros(64, dtype=torch.long)
    low = SAMPLE(logits, ones, *keep, torch.zeros(64, dtype=torch.long), counter)
    high = SAMPLE(logits, ones, *keep, torch.full((64,), 2**31), counter)
    assert not torch.equal(low, high)
    tiny = SAMPLE(logits, ones * 1e-8, *keep, torch.arange(64), counter)
    assert torch.equal(tiny, logits.argmax(-1))


@settings(max_examples=40, deadline=None)
@given(data=st.data(), rows=st.integers(1, 6), vocab=st.integers(1, 30))
def test_a_step_draws_what_the_sample_op_draws_greedy_batches_by_argmax_alone(
        data, rows, vocab):
    """pick: a batch of greedy rows takes the argmax alone (no ranking of the
    vocabulary), any other batch graphcap::sample; the tokens are the op's either way,
    ties in the logits included."""
    from graphcap.inputs.sampling import pick, tensors
    from graphcap.opsdb.sample import SAMPLE

    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float()  # ties likely
    params = data.draw(st.lists(st.sampled_from(
        [Sampling(), Sampling(temperature=1e-6), Sampling(temperature=0.8, seed=5),
         Sampling(temperature=1.0, top_k=2, top_p=0.6, seed=1)]), min_size=rows,
        max_size=rows))
    counters = data.draw(st.lists(st.integers(0, 10**6), min_size=rows, max_size=rows))
    want = SAMPLE(logits, *tensors(params, "cpu"), torch.tensor(counters))
    assert torch.equal(pick(logits, params, counters), want)


def test_seeds_one_and_two_to_the_31_draw_different_tokens():
    from graphcap.inputs.sampling import draw

    flat = torch.zeros(32, 1000)  # every token equally likely: the noise alone picks
    positions = list(range(32))
    one = draw(flat, [Sampling(temperature=1.0, seed=1)] * 32, positions)
    other = draw(flat, [Sampling(temperature=1.0, seed=2**31)] * 32, positions)
    assert one != other


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), bit=st.integers(0, 62),
       counter=st.integers(0, 2**40))
def test_seeds_differing_in_any_single_bit_draw_different_noise_for_every_token(
        seed, bit, counter):
    from graphcap.opsdb.sample import uniform_noise

    seeds = torch.tensor([seed, seed ^ (1 << bit)])
    noise = uniform_noise(seeds, torch.tensor([counter, counter]), 257)
    assert (noise[0] != noise[1]).all()


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), counter=st.integers(0, 2**40), bit=st.integers(0, 62))
def test_positions_differing_in_any_single_bit_draw_different_noise_for_every_token(
        seed, counter, bit):
    from graphcap.opsdb.sample import uniform_noise

    counters = torch.tensor([counter, counter ^ (1 << bit)])
    noise = uniform_noise(torch.tensor([seed, seed]), counters, 257)
    assert (noise[0] != noise[1]).all()


@settings(max_examples=60, deadline=None)
@given(seeds=st.lists(st.integers(0, 2**63 - 1), min_size=2, max_size=2, unique=True),
       counter=st.integers(0, 2**40))
def test_distinct_seeds_draw_distinct_noise(seeds, counter):
    from graphcap.opsdb.sample import uniform_noise

    noise = uniform_noise(torch.tensor(seeds), torch.tensor([counter, counter]), 64)
    assert not torch.equal(noise[0], noise[1])


def test_draws_follow_the_probabilities_over_positions_and_seeds():
    from graphcap.opsdb.sample import SAMPLE

    probs = torch.tensor([0.6, 0.25, 0.1, 0.05])
    rows = 20000
    logits = probs.log().expand(rows, 4)
    seed = torch.arange(rows) // 100 * 2**40  # 200 seeds apart in their high bits only
    counter = torch.arange(rows) % 100
    tokens = SAMPLE(logits, torch.ones(rows), torch.zeros(rows, dtype=torch.long),
                    torch.ones(rows), seed, counter)
    seen = torch.bincount(tokens, minlength=4) / rows
    assert (seen - probs).abs().max() < 0.02, seen  # 5 sigma of 20000 draws: 0.017


def test_a_long_run_shows_its_progress_and_a_short_one_stays_quiet(capsys, monkeypatch):
    from graphcap.engine import generation as module

    model = Decoder(PRESETS["tiny"]).to(DEVICE).eval()
    graphcap.generate(model, [[1, 2, 3]], 4, strategy="eager")
    assert "generating" not in capsys.readouterr().out
    monkeypatch.setattr(module, "LONG_RUN", 8)  # 2 prompts x 4 tokens: a long run
    graphcap.generate(model, [[1, 2, 3], [4, 5]], 4, strategy="eager")
    assert "generating" in capsys.readouterr().out
