"""Draft heads on the target's hidden states (:class:`graphcap.engine.heads.HeadProposer`):
the verify steps hand each request's hidden state at its last accepted token to the head,
its k steps replay one graph per step, and the greedy tokens stay the target's whatever
the head proposes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphcap
from graphcap import LLM
from graphcap.engine.heads import HeadProposer
from graphcap.models import PRESETS, Decoder, build_model
from tests.engine.test_generate import NEW, PROMPTS, model
from tests.engine.test_llm import truth
from tests.support.runner_helpers import DEVICE

pytestmark = [pytest.mark.gpu] if DEVICE == "cuda" else []
K = 3
HIDDEN, VOCAB = PRESETS["tiny"].hidden, PRESETS["tiny"].vocab_size


class TinyHead(nn.Module):
    """A randomly initialised head: the hidden state and the next token's embedding,
    mixed, give the logits of the token after and the next hidden state."""

    def __init__(self, vocab: int = VOCAB, record: bool = False, width: int = HIDDEN):
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(2 * width, width)
        self.out = nn.Linear(width, vocab)
        self.calls = [] if record else None  # eager only: what each call was given

    def forward(self, hidden, tokens):
        if self.calls is not None:
            self.calls.append((hidden.clone(), tokens.clone()))
        hidden = torch.tanh(self.mix(torch.cat([hidden, self.embed.weight[tokens]], -1)))
        return self.out(hidden), hidden


def head_llm(strategy: str, head: nn.Module, head_strategy: str | None = None) -> LLM:
    proposer = HeadProposer(head.to(DEVICE), K, HIDDEN,
                            strategy=head_strategy or strategy)
    return LLM(model(), strategy=strategy, max_batch=3, max_len=32, prefill_tokens=8,
               progress=False, speculative=proposer)


# tc_piecewise: the verify steps' hidden states in tests/inputs/test_verify.py
@pytest.mark.parametrize("strategy", ["full", "breakable"])
def test_a_random_head_proposes_on_one_replay_a_step_and_the_tokens_stay_the_targets(
        strategy):
    llm = head_llm(strategy, TinyHead())
    assert [c.tokens for c in llm.generate(PROMPTS, NEW)] == [t[:NEW] for t in truth()]
    spec = llm.report()["speculative"]
    head = spec["proposer"]
    assert sum(head["runner"]["replays"].values()) == head["head_steps"] + 1  # + bind's
    assert not head["runner"]["fallbacks"] and head["runner"]["recaptures"] == 0
    assert spec["verify_steps"] == head["head_steps"]


@pytest.mark.parametrize("prompts", [[[5, 9, 2, 7, 1], [3]],
                                     [[8, 8, 4, 11, 6, 2, 9, 10, 13, 1, 2]]],
                         ids=["two-prompts", "one-in-chunks"])
def test_the_head_starts_from_the_targets_hidden_state_at_the_last_accepted_token(prompts):
    """Each step's first head call gets, per request, the token the target chose last
    and the target's hidden state at the token before it (recomputed here by an eager
    forward over the request's tokens): at first the prefill's (for an 11-token prompt,
    the last chunk's, on the extend graphs), then each verify step's."""
    head = TinyHead(record=True)
    llm = head_llm("full", head, head_strategy="eager")
    head.calls.clear()  # bind's probe
    gained: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    for delta in llm.stream(prompts, 8):  # without a tokenizer: a delta per step
        gained[delta.index].append(delta.tokens)
    target = model()
    for step, (hidden, tokens) in enumerate(head.calls[::K]):
        live = [i for i in gained if len(gained[i]) > step + 1]  # it had a step here
        assert tokens.tolist() == [gained[i][step][-1] for i in live]
        for row, i in enumerate(live):
            seq = prompts[i] + sum(gained[i][:step + 1], [])
            ids = torch.tensor(seq[:-1], device=DEVICE)
            _, h = target(ids, torch.arange(len(seq) - 1, device=DEVICE),
                          seq_lens=[len(seq) - 1], hidden=True)
            torch.testing.assert_close(hidden[row], h[-1], rtol=1e-4, atol=1e-4)
    assert head.calls


def test_a_model_without_hidden_states_or_a_head_of_other_token_ids_is_refused():
    class Opaque(Decoder):
        graphcap_hidden = False

    torch.manual_seed(0)
    opaque = Opaque(PRESETS["tiny"]).to(DEVICE).eval()
    with pytest.raises(graphcap.UnsupportedModel, match="does not declare graphcap_hidden"):
        LLM(opaque, max_batch=2, max_len=16, progress=False,
            speculative=HeadProposer(TinyHead().to(DEVICE), K, HIDDEN))
    with pytest.raises(ValueError, match=f"its logits must be \\[n, {VOCAB}\\]"):
        head_llm("full", TinyHead(vocab=VOCAB + 50))


def test_a_head_of_another_hidden_width_or_a_hidden_proposer_without_batches_is_refused():
    llm = LLM(model(), max_batch=2, max_len=32, prefill_tokens=8, progress=False,
              speculative=HeadProposer(TinyHead(width=32).to(DEVICE), K, 32))
    for _ in range(2):  # at the prefill of each call, which reads the hidden states
        with pytest.raises(ValueError, match=f"hidden_size is 32, but the target's hidden "
                                             f"states are {HIDDEN} wide"):
            llm.generate(PROMPTS[:1], NEW)
    assert llm.cache.owned() == {}

    class OnlyPropose:
        k, hidden, hidden_size = 2, True, HIDDEN

        def propose(self, tokens):
            return [1, 2]

    with pytest.raises(ValueError, match=r"reads hidden states .*needs propose_batch"):
        LLM(model(), max_batch=2, max_len=32, progress=False, speculative=OnlyPropose())
    OnlyPropose.propose_batch, OnlyPropose.hidden_size = OnlyPropose.propose, None
    with pytest.raises(ValueError, match="the proposer's hidden_size"):
        LLM(model(), max_batch=2, max_len=32, progress=False, speculative=OnlyPropose())
    with pytest.raises(ValueError, match="the HeadProposer's strategy='nope': unknown"):
        HeadProposer(TinyHead(), K, HIDDEN, strategy="nope")


def test_a_head_of_its_own_dtype_takes_the_targets_hidden_states_cast():
    # A float32 head (as EAGLE and MTP heads are often kept) on a bf16 target.
    target = build_model("tiny", device=DEVICE, dtype=torch.bfloat16)
    llm = LLM(target, max_batch=2, max_len=32, prefill_tokens=8, progress=False,
              speculative=HeadProposer(TinyHead().to(DEVICE), K, HIDDEN))
    want = [c.tokens for c in llm.generate(PROMPTS[:2], NEW, speculate=False)]
    got = [c.tokens for c in llm.generate(PROMPTS[:2], NEW)]
    assert [len(t) for t in got] == [NEW, NEW]
    if DEVICE == "cpu":  # on CUDA bf16 verify and decode kernels may part on a near-tie
        assert got == want
