"""torch.library custom ops used by the graph semantics suite."""

from __future__ import annotations

import torch


@torch.library.custom_op("graphcap_test::axpy", mutates_args=())
def axpy(x: torch.Tensor, y: torch.Tensor, a: float) -> torch.Tensor:
    return a * x + y


@axpy.register_fake
def _(x, y, a):
    return torch.empty_like(x)


@torch.library.custom_op("graphcap_test::axpy_out", mutates_args=["out"])
def axpy_out(x: torch.Tensor, y: torch.Tensor, a: float, out: torch.Tensor) -> None:
    torch.mul(x, a, out=out)
    out.add_(y)


@torch.library.custom_op("graphcap_test::double_and_accumulate", mutates_args=["acc"])
def double_and_accumulate(x: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    acc.add_(x)
    return x * 2


@double_and_accumulate.register_fake
def _(x, acc):
    return torch.empty_like(x)
