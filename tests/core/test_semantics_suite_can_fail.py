"""The semantics suite is not vacuous: against a graph that just re-runs the function,
every one of its tests fails."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_semantics_test_fails_on_a_rerun_standin(tmp_path):
    report = tmp_path / "junit.xml"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         str(ROOT / "tests" / "core" / "test_graph_semantics.py"), "--graph-standin=rerun",
         "-m", "not gpu", f"--junitxml={report}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    cases = ET.parse(report).getroot().iter("testcase")
    outcomes = {}
    for case in cases:
        failure = case.find("failure")
        if failure is not None:
            # A real failed expectation, not a crash of the stand-in itself.
            broken = ("AttributeError", "NotImplementedError", "TypeError")
            message = failure.get("message") or ""
            outcomes[case.get("name")] = "broken" if message.startswith(broken) else "failed"
        elif case.find("error") is not None:
            outcomes[case.get("name")] = "broken"
        elif case.find("skipped") is not None:
            outcomes[case.get("name")] = "skipped"
        else:
            outcomes[case.get("name")] = "passed"
    ran = {name: o for name, o in outcomes.items() if o != "skipped"}
    assert len(ran) >= 15, proc.stdout[-2000:]
    wrong = sorted(f"{name}: {o}" for name, o in ran.items() if o != "failed")
    assert not wrong, f"these do not fail on an expectation under plain re-execution: {wrong}"
