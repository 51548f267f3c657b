"""``compat.imports.sigint_held``: a Ctrl-C that lands in the block is delivered once,
when it ends, to whatever was listening: the handler that was installed, and the wakeup
fd through which an event loop (asyncio's ``loop.add_signal_handler``) learns of signals.
Each case sends a real SIGINT to its own thread, the main one, where it is delivered
before the send returns."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest

from graphcap.compat.imports import _read_some, sigint_held

pytestmark = pytest.mark.skipif(not hasattr(signal, "set_wakeup_fd") or os.name != "posix",
                                reason="POSIX signals")


def send(signum: int) -> None:
    signal.pthread_kill(threading.get_ident(), signum)
    time.sleep(0.001)  # Python runs the handler between bytecodes, after the send


def ctrl_c() -> None:
    send(signal.SIGINT)


@pytest.fixture
def calls():
    """The handler of the test: it counts, where the default one would raise."""
    seen: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def wakeup():
    """A wakeup fd as an event loop sets one: the read end, non-blocking."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    yield r
    signal.set_wakeup_fd(previous)
    os.close(r)
    os.close(w)


def woken(fd: int) -> bytes:
    """Every byte waiting in ``fd`` (non-blocking)."""
    return b"".join(iter(lambda: _read_some(fd), b""))


def test_a_ctrl_c_held_back_reaches_the_handler_once_when_the_block_ends(calls):
    with sigint_held():
        ctrl_c()
        ctrl_c()
        assert calls == []  # held
    time.sleep(0.001)
    assert calls == [signal.SIGINT]  # two Ctrl-Cs held, one delivered


def test_the_wakeup_fd_hears_one_ctrl_c_held_back_and_every_other_signal(calls, wakeup):
    usr = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: usr.append(signum))
    try:
        with sigint_held():
            ctrl_c()
            send(signal.SIGUSR1)
        time.sleep(0.001)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert calls == [signal.SIGINT] and usr == [signal.SIGUSR1]
    assert sorted(woken(wakeup)) == sorted([signal.SIGINT, signal.SIGUSR1])


def test_nested_blocks_deliver_one_ctrl_c_after_the_outer_one(calls, wakeup):
    with sigint_held():
        with sigint_held():
            ctrl_c()
        time.sleep(0.001)
        assert calls == []
    time.sleep(0.001)
    assert calls == [signal.SIGINT] and woken(wakeup) == bytes([signal.SIGINT])


def test_an_event_loops_ctrl_c_callback_runs_once_for_one_ctrl_c_held_back():
    async def main() -> int:
        loop = asyncio.get_running_loop()
        seen = []
        loop.add_signal_handler(signal.SIGINT, lambda: seen.append(1))
        try:
            with sigint_held():
                ctrl_c()
            await asyncio.sleep(0.05)
        finally:
            loop.remove_signal_handler(signal.SIGINT)
        return len(seen)

    assert asyncio.run(main()) == 1


def test_off_the_main_thread_it_is_a_plain_block(calls):
    installed = []

    def worker():
        with sigint_held():
            installed.append(signal.getsignal(signal.SIGINT))

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert installed == [signal.getsignal(signal.SIGINT)]  # nothing swapped


def test_a_wakeup_fd_closed_inside_the_block_leaks_nothing_and_masks_nothing(calls):
    r, w = os.pipe()
    os.set_blocking(w, False)
    previous = signal.set_wakeup_fd(w)
    fds = set(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    try:
        with pytest.raises(RuntimeError, match="the block's own"), sigint_held():
            os.close(w)  # the event loop that owned it shut down meanwhile
            raise RuntimeError("the block's own error")
        assert signal.set_wakeup_fd(-1) == -1  # no fd of the block's left behind
        if fds is not None:
            assert set(os.listdir("/proc/self/fd")) <= fds  # its pipe closed
    finally:
        signal.set_wakeup_fd(previous)
        os.close(r)


def test_a_full_wakeup_fd_set_not_to_warn_stays_quiet_after_the_block(calls, capfd):
    import socket

    a, b = socket.socketpair()
    a.setblocking(False)
    while True:  # fill its buffer, as a loop that fell behind leaves it
        try:
            a.send(b"x" * 4096)
        except BlockingIOError:
            break
    previous = signal.set_wakeup_fd(a.fileno(), warn_on_full_buffer=False)
    try:
        with sigint_held():
            pass
        send(signal.SIGINT)
    finally:
        signal.set_wakeup_fd(previous)
        a.close()
        b.close()
    assert calls == [signal.SIGINT]
    assert "wakeup fd" not in capfd.readouterr().err
