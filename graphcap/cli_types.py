"""The types of the ``graphcap`` command line's arguments: each parses one argument's text
or refuses it with an ``argparse.ArgumentTypeError`` naming what to give."""

from __future__ import annotations

import argparse

import torch


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, not {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, not {value}")
    return value


def window(text: str) -> int:
    """A window of ``bench decode --window``: positive, or 0 for none (the default)."""
    return 0 if text.strip() == "0" else positive(text)


def strategy(text: str) -> str:
    """A strategy of ``check --strategies`` (the choices check it): a factory there (the
    option takes every word after it) is named as the factory it is."""
    if ":" in text:
        raise argparse.ArgumentTypeError(
            f"{text!r} is the factory, not a strategy: give it before --strategies "
            f"(graphcap check {text} --strategies ...)")
    return text


def positives(text: str) -> str:
    """Comma-separated positive whole numbers, each once, as the text bench's suites split."""
    values = [positive(item) for item in text.split(",")]
    if twice := repeated(values):
        raise argparse.ArgumentTypeError(f"{twice} is given twice: give each value once")
    return ",".join(map(str, values))


def repeated(items: list):
    """The first item that comes twice in ``items``, else None."""
    seen = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


def device(text: str) -> str:
    try:
        torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is no torch device (cpu, cuda, cuda:1, "
                                         "...)") from None
    return text
