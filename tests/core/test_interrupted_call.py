"""A Ctrl-C wherever CPython delivers one in a runner's call (a Python function's start,
a generator's resumption, the return of a C function it called) leaves the runner usable:
its next call from the same thread replays as before, and a call from another thread is
not kept waiting for a lock nobody holds."""

from __future__ import annotations

import contextlib
import threading

import torch

import graphcap
from graphcap.core.runner import Runner
from graphcap.core.serial import Serial
from tests.support.interrupts import code_of, delivered


def calls_from_another_thread(runner, x) -> bool:
    """Whether a call of ``runner`` from another thread returns within a few seconds."""
    done = threading.Event()

    def call():
        runner(x)
        done.set()

    threading.Thread(target=call, daemon=True).start()
    return done.wait(5.0)


def test_a_ctrl_c_anywhere_cpython_delivers_one_in_a_call_leaves_the_runner_usable():
    model = torch.nn.Linear(4, 4)
    runner = graphcap.capture(model, "full", buckets=[2], example_inputs=(torch.ones(2, 4),))
    x = torch.randn(2, 4)
    want = runner(x)
    cm = contextlib._GeneratorContextManager
    codes = code_of(Runner.__call__, *(f for f in vars(Serial).values() if callable(f)),
                    cm.__enter__, cm.__exit__)
    codes |= code_of(*(getattr(f, "__wrapped__", f) for f in vars(Serial).values()
                       if callable(f)))
    count, _ = delivered(codes, None, runner, x)
    assert count > 5
    for n in range(1, count + 1):
        _, out = delivered(codes, n, runner, x)
        assert isinstance(out, KeyboardInterrupt), (n, out)
        assert torch.equal(runner(x), want), n  # this thread's next call
        assert calls_from_another_thread(runner, x), n
