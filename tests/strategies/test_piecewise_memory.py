"""tc_piecewise's pieces hold their arguments no longer than an eager forward would: the
split module hands each piece its arguments in a list the piece empties, so an argument
whose last use is inside the piece is freed there (the attention's output and the
residual, which the split module's frame held through the MLP after them)."""

from __future__ import annotations

import weakref

import torch

from graphcap.piecewise import PiecewiseCompiler
from graphcap.piecewise import phase as phases
from graphcap.piecewise.phase import Phase, Watch

_MADE: list = []  # weak references to what `tracked` returned
_ALIVE: list = []  # per `alive` call: whether the last tracked tensor was still alive


@torch.library.custom_op("graphcap_mem_test::tracked", mutates_args=())
def tracked(x: torch.Tensor) -> torch.Tensor:
    big = x.repeat(1, 4)
    _MADE.append(weakref.ref(big))
    return big


@tracked.register_fake
def _(x):
    return x.new_empty(x.shape[0], x.shape[1] * 4)


@torch.library.custom_op("graphcap_mem_test::alive", mutates_args=())
def alive(x: torch.Tensor) -> torch.Tensor:
    _ALIVE.append(_MADE[-1]() is not None)
    return x.clone()


@alive.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("graphcap_mem_test::split_b", mutates_args=("out",))
def split_b(x: torch.Tensor, out: torch.Tensor) -> None:
    out.copy_(x)


@split_b.register_fake
def _(x, out):
    return None


def forward(x, out):
    big = tracked(x)  # the first piece's output, an argument of the third
    split_b(x, out)
    s = big.sum(dim=1, keepdim=True)  # big's last use: the third piece's first op
    return alive(s) + out


def compiled():
    compiler = PiecewiseCompiler({"capture_sizes": [8],
                                  "split_ops": ["graphcap_mem_test::split_b"]})
    return torch.compile(forward, backend=compiler, fullgraph=True, dynamic=False)


def test_a_pieces_argument_is_freed_at_its_last_use_inside_the_piece_in_a_warm_up():
    fn = compiled()
    x, out = torch.randn(8, 16), torch.zeros(8, 16)
    with phases.phase(Phase.WARMUP, Watch()):
        got = fn(x, out)
    torch.testing.assert_close(got, x.repeat(1, 4).sum(dim=1, keepdim=True) + x)
    assert _ALIVE[-1] is False  # freed before `alive` ran, in the same piece


def test_a_piece_run_eagerly_by_the_runner_gives_the_same_values():
    fn = compiled()
    x, out = torch.randn(8, 16), torch.zeros(8, 16)
    with phases.phase(Phase.EAGER):
        got = fn(x, out)
    torch.testing.assert_close(got, x.repeat(1, 4).sum(dim=1, keepdim=True) + x)
