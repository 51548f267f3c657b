"""Factories for the graphcap check tests: a good model and one with a frozen side effect."""

from __future__ import annotations

import torch

from graphcap.models import build_model


def good():
    return build_model("tiny")

class Counting(torch.nn.Module):
    """A Python side effect that capture freezes: a call counter used in the output."""
    def __init__(self):
        super().__init__()
        self.inner = build_model("tiny")
        self.args = self.inner.args
        self.calls = 0
    def forward(self, input_ids, positions):
        self.calls += 1
        return self.inner(input_ids, positions) + self.calls

def counting():
    return Counting()
