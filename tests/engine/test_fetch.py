"""A launched step's tokens, read on the host (``graphcap.engine.llm._Fetch``), wait for
their copy where it runs: on the current stream of the tokens' GPU, which need not be the
current device (a model on ``cuda:1`` in a process whose current device is ``cuda:0``).
CUDA's parts are stood in for here, so that it runs on any machine."""

from __future__ import annotations

import torch

from graphcap.engine import llm as llm_module


class _Event:
    """torch.cuda.Event's stand-in: where it was recorded, as the real one resolves it."""

    streams: list[str] = []

    def record(self, stream=None):
        self.streams.append(stream if stream is not None else torch.cuda.current_stream())

    def synchronize(self) -> None:
        pass


class _Pinned:
    """Pinned host memory's stand-in: the values copied into it."""

    def copy_(self, source, non_blocking: bool = False):
        self.values = source.values
        return self

    def tolist(self) -> list[int]:
        return self.values


class _OnSecondGPU:
    """A step's drawn tokens on cuda:1."""

    device, shape, dtype, values = torch.device("cuda", 1), (2,), torch.long, [7, 9]


def _current_stream(device=None) -> str:
    """Each device's current stream, by name; no device: the current device's, cuda:0."""
    return f"stream of {torch.device(device) if device is not None else 'cuda:0'}"


def test_a_steps_tokens_wait_for_their_copy_on_their_own_gpus_stream(monkeypatch):
    _Event.streams = []
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", _current_stream)
    monkeypatch.setattr(torch, "empty", lambda *args, **kwargs: _Pinned())
    fetch = llm_module._Fetch(_OnSecondGPU())
    # the current device's stream (cuda:0's) would not wait for the copy on cuda:1's: the
    # host read the pinned buffer before the step's tokens were in it
    assert _Event.streams == ["stream of cuda:1"]
    assert fetch.tokens() == [7, 9]
