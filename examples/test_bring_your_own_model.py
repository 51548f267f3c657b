"""Bring your own model (docs/models.md): a plain decoder of packed requests whose attention
is SDPA, and the same decoder with its attention routed through ``graphcap::attention``.
The first mixes its packed requests, which graphcap refuses; the second captures under
every strategy and equals eager, and its requests never see each other."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import graphcap
from graphcap.opsdb.attention import ATTENTION
from graphcap.testing import assert_replay_equivalent


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int, graphcap_attention: bool):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.o = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))
        self.graphcap_attention = graphcap_attention

    def attention(self, q, k, v):
        """q, k, v [T, heads, head_dim] of the packed requests -> [T, heads, head_dim]."""
        if not self.graphcap_attention:  # blind to where the requests begin and end
            out = F.scaled_dot_product_attention(*(t.transpose(0, 1) for t in (q, k, v)),
                                                 is_causal=True)
            return out.transpose(0, 1)
        out = torch.empty_like(q)  # the caller allocates out; the op writes it
        ATTENTION(q, k, v, out, self.head_dim ** -0.5)
        return out

    def forward(self, h):
        t = h.shape[0]
        q, k, v = self.qkv(h).view(t, 3, self.heads, self.head_dim).unbind(1)
        h = h + self.o(self.attention(q.contiguous(), k.contiguous(), v.contiguous())
                       .reshape(t, -1))
        return h + self.mlp(h)


class MyDecoder(nn.Module):
    graphcap_inputs = "prefill"  # packed requests: runner(ids, positions, seq_lens=[...])

    def __init__(self, graphcap_attention: bool, vocab: int = 128, hidden: int = 64):
        super().__init__()
        self.vocab_size = vocab
        self.embed = nn.Embedding(vocab, hidden)
        self.pos = nn.Embedding(256, hidden)
        self.blocks = nn.ModuleList(Block(hidden, 4, graphcap_attention) for _ in range(2))
        self.head = nn.Linear(hidden, vocab)

    def forward(self, input_ids, positions):
        h = self.embed(input_ids) + self.pos(positions)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def packed_batch(lens, device):
    ids = torch.randint(0, 128, (sum(lens),), generator=torch.Generator().manual_seed(0))
    return ids.to(device), torch.cat([torch.arange(n) for n in lens]).to(device)


def test_an_sdpa_decoder_mixes_packed_requests_and_graphcap_refuses_it(graphcap_device):
    torch.manual_seed(0)
    model = MyDecoder(graphcap_attention=False).to(graphcap_device).eval()
    ids, pos = packed_batch([5, 3], graphcap_device)
    runner = graphcap.capture(model, "breakable", buckets=[8, 16], max_requests=2)
    with pytest.raises(graphcap.UnsupportedModel, match="ran no graphcap attention"):
        runner(ids, pos, seq_lens=[5, 3])


def test_with_graphcap_attention_each_request_is_its_own_and_every_strategy_replays(
        graphcap_device):
    torch.manual_seed(0)
    model = MyDecoder(graphcap_attention=True).to(graphcap_device).eval()
    attention = "triton" if graphcap_device.type == "cuda" else "torch_masked"
    ids, pos = packed_batch([5, 3], graphcap_device)
    with torch.no_grad():  # eager calls, outside a runner
        with graphcap.packed([5, 3], graphcap_device, attention):
            both = model(ids, pos)
        with graphcap.packed([3], graphcap_device, attention):
            second = model(ids[5:], pos[5:])
    tol = 1e-5 if graphcap_device.type == "cpu" else 3e-2
    torch.testing.assert_close(both[5:], second, atol=tol, rtol=tol)  # as if alone
    reports = assert_replay_equivalent(model, buckets=[8, 16, 32], max_requests=3,
                                       examples=6, sequences=2, attention=attention)
    assert {r["attention"] for r in reports.values()} == {attention}
