"""Generate with your model (docs/models.md): a hand-written decoder whose attention keeps
its keys and values in graphcap's paged cache (``graphcap::cached_attention`` with the
layer's index) and that declares what it caches generates with ``graphcap.LLM``, its
greedy tokens those of recomputing every sequence; a model that declares nothing, or
whose attention writes no K/V, is refused, naming what is missing."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphcap
from graphcap.opsdb.attention import ATTENTION
from graphcap.opsdb.cached import CACHED_ATTENTION


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, layer: int, cached: bool = True):
        super().__init__()
        self.heads, self.head_dim, self.layer, self.cached = heads, hidden // heads, layer, \
            cached
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))

    def forward(self, h):
        t = h.shape[0]
        q, k, v = (x.contiguous() for x in
                   self.qkv(h).view(t, 3, self.heads, self.head_dim).unbind(1))
        out = torch.empty_like(q)
        if self.cached:  # K/V into the forward's cache (if any), attention over it
            CACHED_ATTENTION(q, k, v, out, self.head_dim ** -0.5, self.layer)
        else:
            ATTENTION(q, k, v, out, self.head_dim ** -0.5)
        h = h + self.o(out.reshape(t, -1))
        return h + self.mlp(h)


class MyDecoder(nn.Module):
    graphcap_inputs = "prefill"  # packed requests: forward(input_ids, positions)
    vocab_size = 128
    max_position = 256  # its learned position table

    def __init__(self, hidden: int = 64, heads: int = 4, layers: int = 2, cached=True):
        super().__init__()
        self.graphcap_kv = (layers, heads, hidden // heads)  # what each layer caches
        self.embed = nn.Embedding(self.vocab_size, hidden)
        self.pos = nn.Embedding(self.max_position, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, i, cached) for i in range(layers))
        self.head = nn.Linear(hidden, self.vocab_size)

    def forward(self, input_ids, positions):
        h = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def recomputed(model, prompt: list[int], new: int, device) -> list[int]:
    """Greedy tokens, the whole sequence run again (eagerly, no cache) at every step."""
    seq = list(prompt)
    for _ in range(new):
        with torch.no_grad(), graphcap.packed([len(seq)], device):
            logits = model(torch.tensor(seq, device=device),
                           torch.arange(len(seq), device=device))
        seq.append(int(logits[-1].argmax()))
    return seq[len(prompt):]


def test_a_hand_written_decoder_generates_what_recomputing_gives(graphcap_device):
    torch.manual_seed(0)
    model = MyDecoder().to(graphcap_device).eval()
    llm = graphcap.LLM(model, strategy="full", max_batch=2, max_len=32, prefill_tokens=16,
                       progress=False)
    prompts = [[5, 9, 2, 7, 1], [3], [8, 8, 4, 11, 6, 2, 9]]
    done = llm.generate(prompts, 6)
    assert [c.tokens for c in done] == [recomputed(model, p, 6, graphcap_device)
                                        for p in prompts]


def test_a_model_that_cannot_generate_is_refused_naming_what_is_missing(graphcap_device):
    torch.manual_seed(0)
    silent = MyDecoder().to(graphcap_device).eval()
    del silent.graphcap_kv
    with pytest.raises(graphcap.UnsupportedModel, match="does not declare graphcap_kv"):
        graphcap.LLM(silent, progress=False)
    uncached = MyDecoder(cached=False).to(graphcap_device).eval()
    with pytest.raises(graphcap.UnsupportedModel, match="graphcap::attention .* ran in a "
                                                        "forward over a paged K/V cache"):
        graphcap.LLM(uncached, max_batch=2, max_len=32, prefill_tokens=16, progress=False)
