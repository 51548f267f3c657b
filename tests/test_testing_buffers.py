"""assert_replay_equivalent compares what a forward writes in its buffers, not only its
outputs."""

from __future__ import annotations

import pytest
import torch

from graphcap.testing import assert_replay_equivalent


class _FillsTable(torch.nn.Module):
    """A table the forward fills by position (a cache), which its output does not read."""

    graphcap_inputs = "prefill"
    vocab_size = 50

    def __init__(self, padding_too: bool):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 8)
        self.padding_too = padding_too
        self.register_buffer("table", torch.zeros(64, 8))

    def forward(self, input_ids, positions):
        h = self.emb(input_ids)
        if self.padding_too:  # a replay's padding rows write at their position too
            self.table.index_copy_(0, positions, h)
        else:  # the first token's row: a real one, replayed or not
            self.table[0].copy_(h[0])
        return h


def test_what_a_forward_writes_in_its_buffers_is_compared_too():
    # Its output equals eager's; its table did not, and the check passed.
    with pytest.raises(AssertionError, match=r"\[\d+\], replayed the \d+-token graph: the "
                       r"forward writes its buffer 'table'"):
        assert_replay_equivalent(_FillsTable(True), ("full",), buckets=[4, 8, 16],
                                 max_requests=1, examples=5, sequences=2)


def test_buffers_a_forward_writes_alike_pass():
    report = assert_replay_equivalent(_FillsTable(False), ("full", "breakable"),
                                      buckets=[4, 8, 16], max_requests=1, examples=5,
                                      sequences=2)
    assert all(r["max_error"] == 0.0 for r in report.values())
