"""tc_piecewise under a runner that captures again (``recapture()``, a changed model): the
report counts the graphs each shape replays, those kept from before included."""

from __future__ import annotations

import torch

import graphcap
from graphcap.models import Decoder, ModelArgs

SIZES = [8, 16]


def _runner(layers: int = 2):
    torch.manual_seed(0)
    m = Decoder(ModelArgs(layers=layers)).eval()
    # torch_varlen reads host lengths: every shape is captured piece by piece.
    return m, graphcap.capture(m, "tc_piecewise", buckets=SIZES, max_requests=2,
                               attention="torch_varlen")


def test_a_recapture_reports_every_piece_graph_a_shape_replays():
    _, r = _runner()
    before = r.report()["segments"]
    assert before == {n: 3 for n in SIZES}
    r.recapture()  # nothing changed: the pieces replay the graphs they have
    assert r.report()["segments"] == before


def test_a_changed_weight_recaptures_its_pieces_and_the_report_counts_them_all():
    m, r = _runner()
    lin = m.blocks[0].mlp.down
    lin.weight = torch.nn.Parameter(torch.randn_like(lin.weight))
    ids, pos = torch.randint(1, 256, (12,)), torch.arange(12)
    with torch.inference_mode():
        want = m(ids, pos, seq_lens=[12])
    torch.testing.assert_close(r(ids, pos, seq_lens=[12]), want)
    assert r.model.compiler.stats["recaptures"] > 0
    assert r.report()["segments"] == {n: 3 for n in SIZES}
