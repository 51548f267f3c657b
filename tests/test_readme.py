"""The README's usage snippet runs as written (on the graph emulator here)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_readme_snippet_runs_as_written():
    text = (ROOT / "README.md").read_text()
    usage = text[text.index("## Use"):]
    code = re.search(r"```python\n(.*?)```", usage, re.S).group(1)
    # The snippet's property check draws the same examples on every run, as the suite's.
    fixed = ("from hypothesis import settings\n"
             "settings.register_profile('readme', derandomize=True)\n"
             "settings.load_profile('readme')\n")
    proc = subprocess.run([sys.executable, "-c", fixed + code], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torch.Size([123, 256])" in proc.stdout
