"""Imports a capture needs, made whole before it starts.

A first capture imports modules lazily: the emulator's dispatch modes import Dynamo (and
with it sympy) at their first op; tc_piecewise's trace and compile import Dynamo's
compile machinery, and Inductor's. A Ctrl-C landing in the middle of such an import
leaves a half-initialised package in ``sys.modules``, and every later capture in the
process fails (``module 'sympy' has no attribute 'core'``, ``partially initialized
module 'torch._dynamo'``). :func:`complete` runs those imports up front, once per
process, with SIGINT held back on the main thread; a Ctrl-C that arrives meanwhile is
delivered the moment they are done, so it still stops the capture.

What a first capture imports was measured with ``sys.modules`` before and after;
tests/core/test_interrupts.py checks that after :func:`complete` a first capture under each
strategy imports nothing more.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import threading
from collections.abc import Callable

import torch


def _dynamo_compile() -> None:
    """One small ``fullgraph`` compile with dynamic shapes: Dynamo imports the modules
    of its trace and of its call of the backend lazily, at the first compile."""

    def double(x):
        return x * 2

    compiled = torch.compile(double, backend=lambda gm, example: gm.forward,
                             fullgraph=True, dynamic=True)
    try:
        compiled(torch.ones(3))
    except Exception:  # noqa: BLE001  the capture's own compile reports what fails
        pass


def _fx_interpreter() -> None:
    """One run of ``torch.fx.Interpreter`` (tc_piecewise's warm-ups and whole captures
    run each piece through one): its progress bar imports multiprocessing's locks at its
    first run."""
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    torch.fx.Interpreter(gm).run(torch.ones(1))


# torch wraps a TorchDispatchMode's __torch_dispatch__ in a Dynamo-disable that imports
# torch._dynamo at its first call: the first capture on the graph emulator.
EMULATOR = ("torch._dynamo",)
# tc_piecewise: graphcap's backend, Dynamo's compile, and what tracing a decoder brings.
COMPILE = EMULATOR + ("graphcap.piecewise", _dynamo_compile, _fx_interpreter,
                      "torch.nn.attention.flex_attention",
                      "torch.distributed.tensor.experimental")
# compiler="inductor": the packages of Inductor's compile and code generation.
INDUCTOR = ("torch._inductor.compile_fx", "torch._inductor.async_compile",
            "torch._inductor.codegen.cpp_wrapper_cpu", "torch._inductor.codegen.triton",
            "torch.utils.cpp_extension")

Step = str | Callable[[], None]  # a module to import, or a call that imports lazily
_done: set[Step] = set()
_lock = threading.RLock()  # re-entered if a step reaches an emulated capture itself


def for_capture(strategy: str, compiler: str | None = None) -> tuple[Step, ...]:
    """The steps a first capture under ``strategy`` needs done (the emulator's own are
    done by each emulated graph: :data:`EMULATOR`)."""
    if strategy != "tc_piecewise":
        return ()
    return COMPILE + (INDUCTOR if compiler == "inductor" else ())


def complete(steps: tuple[Step, ...]) -> None:
    """Import each module of ``steps`` (and run each call), once per process, with
    SIGINT held back (:func:`sigint_held`). A module that cannot be imported here is
    skipped: the capture would not import it either."""
    if _done.issuperset(steps):
        return
    with _lock, sigint_held():
        for step in steps:
            if step in _done:
                continue
            if callable(step):
                step()
            else:
                with contextlib.suppress(ImportError):
                    importlib.import_module(step)
            _done.add(step)


@contextlib.contextmanager
def sigint_held():
    """On the main thread, hold SIGINT back inside the block and deliver it, to the
    handler that was installed (put back as it was), as soon as the block ends: once,
    however many arrived. An event loop that learns of signals through the wakeup fd
    (asyncio's ``loop.add_signal_handler``) hears it once too, and every other signal
    that arrived meanwhile when the block ends.

    Elsewhere a plain block: Python runs signal handlers on the main thread only, so a
    Ctrl-C never interrupts another thread's imports. So is it where the handler was
    installed outside Python (``signal.getsignal`` gives None: it cannot be put back)."""
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous is None:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        with _wakeups_without_sigint():
            yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held:  # through the handler that was installed: KeyboardInterrupt by default
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def _wakeups_without_sigint():
    """Inside the block, the signals' wakeup bytes go to a pipe of its own; when it ends
    they are passed on to the wakeup fd that was set, SIGINT's left out (delivered again
    after the block, it writes its own)."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)  # one swap: no byte lost
    try:
        yield
    finally:
        try:
            # Python cannot say how the fd was set; restored without a warning when its
            # buffer is full (as trio sets it), so no new noise either way.
            signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
        except (OSError, ValueError):  # the fd was closed meanwhile: none, as it is gone
            signal.set_wakeup_fd(-1)
        with contextlib.suppress(OSError):  # nothing arrived; or the fd's buffer is full
            others = b"".join(iter(lambda: _read_some(r), b""))
            others = bytes(b for b in others if b != signal.SIGINT)
            if others and fd != -1:
                os.write(fd, others)
        os.close(r)
        os.close(w)


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 4096)
    except BlockingIOError:
        return b""
