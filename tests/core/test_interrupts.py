"""Ctrl-C during a process's first capture leaves the process able to capture.

A first capture imports modules lazily (Dynamo, sympy, and more under tc_piecewise); an
interrupt in the middle of such an import used to leave a half-initialised package in
``sys.modules`` and every later capture failing. Each case is a fresh Python process
(tests/support/interrupted_capture.py) that sends itself a real SIGINT when a given module starts
importing during its first capture, then captures again. The processes run side by side,
started once for the module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "support" / "interrupted_capture.py"

# name: (strategy, the module whose import start sends SIGINT, how the process takes it).
# Each point broke every later capture before imports were made whole (sympy's package
# half done: "module 'sympy' has no attribute 'core'"; Dynamo's: "partially initialized
# module 'torch._dynamo'").
CASES = {
    "breakable, in sympy": ("breakable", "sympy.polys", "plain"),
    "full, in Dynamo": ("full", "torch._dynamo.trace_rules", "plain"),
    "tc_piecewise, in Dynamo's polyfills": ("tc_piecewise", "torch.onnx", "plain"),
    "a handler of the user's": ("breakable", "sympy.printing", "handler"),
    "a capture on a worker thread": ("full", "sympy.polys", "thread"),
}

# Each case starts a process of its own; one worker runs them all (the module's fixture
# starts them once, side by side, where two workers would each start all five).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("interrupts")]


@pytest.fixture(scope="module")
def runs():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {name: subprocess.Popen([sys.executable, str(CHILD), *args], cwd=ROOT, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, args in CASES.items()}
    results = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        results[name] = (json.loads(out.strip().splitlines()[-1]) if proc.returncode == 0
                         else {"failed": f"exit {proc.returncode}: {err[-3000:]}"})
    return results


def run_of(runs, name) -> dict:
    """The process's report; a process that failed (its second capture raised) fails
    the test with its error."""
    run = runs[name]
    assert "failed" not in run, run.get("failed")
    return run


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] == "plain"])
def test_ctrl_c_in_a_first_captures_imports_stops_it_and_the_next_capture_matches_eager(
        runs, name):
    run = run_of(runs, name)
    assert run["fired"] == [CASES[name][1]]  # the signal was sent where it was meant
    assert run["interrupted"]  # the user's Ctrl-C still stopped the capture
    assert run["matches"]


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][2] == "plain"])
def test_a_capture_imports_nothing_after_the_imports_made_whole(runs, name):
    assert run_of(runs, name)["imported"] == []


def test_a_ctrl_c_held_back_reaches_the_users_handler_once_and_it_stays_installed(runs):
    run = run_of(runs, "a handler of the user's")
    assert run["fired"] and not run["interrupted"]  # the handler ran instead of raising
    assert run["handler_calls"] == 1 and run["handler_kept"]
    assert run["matches"]


def test_a_ctrl_c_during_a_worker_threads_first_capture_leaves_its_imports_whole(runs):
    run = run_of(runs, "a capture on a worker thread")
    assert run["fired"] and run["interrupted"]  # raised on the main thread, in join()
    assert run["worker_failed"] == []
    assert run["matches"]
