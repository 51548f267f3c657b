"""A user's own prefill model, built from graphcap's ops, checked under every strategy:
captured output must equal eager for random batches and for sequences of calls."""

from __future__ import annotations

import torch
from torch import nn

from graphcap.models.decoder import Block, ModelArgs
from graphcap.opsdb.norm import RMS_NORM
from graphcap.opsdb.reference import rope_cache
from graphcap.testing import assert_replay_equivalent


class TinyTagger(nn.Module):
    """Token ids of packed requests -> per-token tag scores: embed, one decoder block,
    a norm and a linear head."""

    def __init__(self, args: ModelArgs, tags: int = 5):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden)
        self.block = Block(args)
        self.norm = nn.Parameter(torch.ones(args.hidden))
        self.head = nn.Linear(args.hidden, tags)
        self.register_buffer("cos_sin", rope_cache(args.head_dim, args.max_position,
                                                   args.rope_theta), persistent=False)

    def forward(self, input_ids, positions):
        h = self.block(self.embed(input_ids), positions, self.cos_sin)  # h + attn, + mlp
        return self.head(RMS_NORM(h, self.norm, self.args.eps))


def test_my_module_replays_like_eager_under_every_strategy(graphcap_device):
    torch.manual_seed(0)
    model = TinyTagger(ModelArgs()).to(graphcap_device).eval()
    reports = assert_replay_equivalent(
        model, buckets=[8, 16, 32],
        max_requests=3, attention="torch_masked", examples=8, sequences=3)
    assert set(reports) == {"breakable", "full", "tc_piecewise"}
