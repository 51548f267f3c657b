"""tc_piecewise: what the compiled forward raises says what went wrong."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from graphcap.piecewise import CompiledForward, PiecewiseCompiler


class RefusesHidden(nn.Module):
    """Raises an error of its own under a keyword option only (paged inputs pass
    ``hidden=True`` so)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, hidden=False):
        if hidden:
            raise ValueError("hidden states need a final norm")
        return self.lin(x)


def test_the_models_own_error_under_a_keyword_option_is_raised_as_it_is():
    forward = CompiledForward(RefusesHidden(), PiecewiseCompiler({"capture_sizes": [8]}))
    with torch.inference_mode(), pytest.raises(ValueError, match="need a final norm"):
        forward(torch.randn(8, 4), hidden=True)
