"""A KeyboardInterrupt at a chosen bytecode instruction: :func:`interrupted` runs a call
with one raised at the ``n``-th instruction executed in the frames of the code objects
given (every instruction a Ctrl-C could land before: ``sys.monitoring`` instruction events
from Python 3.12, ``sys.settrace`` opcode events before it), so a test can try every point
of a method in turn (:func:`instructions` counts them). (From 3.12, settrace's opcode
events start only once some frame asked for them: a process's first call counted none.)"""

from __future__ import annotations

import sys


def interrupted(codes, n: int | None, call, *args):
    """``call(*args)`` with KeyboardInterrupt raised before the ``n``-th instruction of the
    frames of ``codes`` (code objects; None: none raised); returns the instructions
    counted and what ``call`` returned or raised."""
    codes, count = set(codes), 0
    if hasattr(sys, "monitoring"):
        return _monitored(codes, n, call, args)

    def local(frame, event, arg):
        nonlocal count
        if event == "opcode":
            count += 1
            if count == n:
                raise KeyboardInterrupt(f"instruction {n}")
        return local

    def enter(frame, event, arg):
        if frame.f_code not in codes:
            return None
        frame.f_trace_opcodes = True
        return local

    out = _hooked(sys.gettrace, sys.settrace, enter, call, args)
    return count, out


def _hooked(get, install, hook, call, args):
    """What ``call(*args)`` returned or raised with ``hook`` installed (``sys.settrace``,
    ``sys.setprofile``), the previous one after. (No context manager: a test may count
    contextlib's frames among those it interrupts.)"""
    previous = get()
    install(hook)
    try:
        return _outcome(call, args)
    finally:
        install(previous)


def _outcome(call, args):
    """What ``call(*args)`` returned or raised (the test looks at it)."""
    try:
        return call(*args)
    except BaseException as exc:
        return exc


def _monitored(codes, n, call, args):
    mon = sys.monitoring
    tool = next(i for i in range(6) if mon.get_tool(i) is None)
    mon.use_tool_id(tool, "graphcap tests: interrupts")
    count = 0

    def instruction(code, offset):
        nonlocal count
        count += 1
        if count == n:
            raise KeyboardInterrupt(f"instruction {n}")

    mon.register_callback(tool, mon.events.INSTRUCTION, instruction)
    for code in codes:
        mon.set_local_events(tool, code, mon.events.INSTRUCTION)
    try:
        out = _outcome(call, args)
    finally:
        for code in codes:
            mon.set_local_events(tool, code, 0)
        mon.register_callback(tool, mon.events.INSTRUCTION, None)
        mon.free_tool_id(tool)
    return count, out


def instructions(codes, call, *args) -> int:
    """The instructions ``call(*args)`` runs in the frames of ``codes``."""
    return interrupted(codes, None, call, *args)[0]


def code_of(function, *more) -> set:
    """The code objects of ``function`` (a function or method) and of ``more``, with
    their comprehensions'."""
    out, todo = set(), [getattr(f, "__func__", f).__code__ for f in (function, *more)]
    while todo:
        code = todo.pop()
        out.add(code)
        todo += [c for c in code.co_consts if isinstance(c, type(code))]
    return out


def delivered(codes, n: int | None, call, *args):
    """``call(*args)`` with KeyboardInterrupt raised at the ``n``-th point of the frames of
    ``codes`` where CPython delivers a Ctrl-C that arrived before it (None: none raised):
    where such a frame begins (a generator's, where it resumes) and where a C function
    it called returns, as ``sys.setprofile`` sees them; returns the points counted and
    what ``call`` returned or raised. (:func:`interrupted` raises before any instruction,
    which is stricter than CPython: it delivers none between a ``with`` statement's block
    and the lock's C ``__exit__``.)"""
    codes, count = set(codes), 0

    def profile(frame, event, arg):
        nonlocal count
        if event in ("call", "c_return") and frame.f_code in codes:
            count += 1
            if count == n:
                raise KeyboardInterrupt(f"point {n}")

    out = _hooked(sys.getprofile, sys.setprofile, profile, call, args)
    return count, out
