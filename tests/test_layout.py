"""The project's shape, checked: every source file is in git (an ignore rule once hid a
whole package from every clean clone), files stay small, the environment is read in
one module, and the docs' measured figures point at recorded runs."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_no_source_file_is_hidden_from_git_by_an_ignore_rule():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    ignored = subprocess.run(
        ["git", "ls-files", "--others", "--ignored", "--exclude-standard", "--",
         "graphcap", "tests", "examples", "docs", "tools"],
        cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    hidden = [p for p in ignored if "__pycache__" not in p and not p.endswith(".pyc")]
    assert not hidden, f"ignored by .gitignore, so missing from every clone: {hidden}"


def test_no_package_file_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "graphcap").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"files with two jobs: {long}"


def test_the_environment_is_read_in_graphcap_env_only():
    readers = {str(p.relative_to(ROOT)) for p in (ROOT / "graphcap").rglob("*.py")
               if re.search(r"os\.environ|getenv", p.read_text())}
    # bench/tp.py sets NCCL's variables for its worker processes; it reads no GRAPHCAP_*.
    assert readers <= {"graphcap/env.py", "graphcap/bench/tp.py"}, readers
    assert "GRAPHCAP_" not in (ROOT / "graphcap/bench/tp.py").read_text()


def test_performance_page_is_short_and_every_result_is_indexed():
    assert len((ROOT / "docs/performance.md").read_text().splitlines()) <= 150
    index = (ROOT / "docs/results/README.md").read_text()
    unlisted = [p.name for p in (ROOT / "docs/results").iterdir()
                if p.is_file() and p.name != "README.md" and p.name not in index
                and not (p.suffix == ".png" and p.with_suffix(".json").name in index)]
    assert not unlisted, f"docs/results/README.md does not list {unlisted}"


def test_no_package_folder_is_named_like_build_output():
    # Tools that measure or package a tree skip such folders (graphcap.dist once was one).
    named = [str(p.relative_to(ROOT)) for p in (ROOT / "graphcap").rglob("*")
             if p.is_dir() and p.name in {"dist", "build", "out", "target"}]
    assert not named, f"rename {named}: tools treat them as build output"


# The ground floor: what each folder may import of the package (itself included).
GROUND = {"core": {"core", "compat", "env", "errors", "tp"},
          "kv": {"kv", "core", "compat", "env", "errors"},
          "tp": {"tp", "compat", "env", "errors"}}


@pytest.mark.parametrize("folder", sorted(GROUND))
def test_the_ground_floor_imports_nothing_above_it(folder):
    above = {}
    for path in (ROOT / "graphcap" / folder).rglob("*.py"):
        text = path.read_text()
        names = re.findall(r"^\s*(?:from|import) graphcap\.(\w+)", text, re.M)
        for listed in re.findall(r"^\s*from graphcap import ([\w, ]+)$", text, re.M):
            names += [n.strip() for n in listed.split(",")]
        if wrong := set(names) - GROUND[folder]:
            above[str(path.relative_to(ROOT))] = wrong
    assert not above, f"graphcap/{folder} imports from floors above it: {above}"


def _imports() -> dict[str, set[str]]:
    """Part of the package (a folder, or a top-level module) -> the parts it imports,
    lazy imports included; the deprecated modules that re-export moved names (their
    docstring says "Deprecated:") are left out: nothing imports them."""
    edges: dict[str, set[str]] = {}
    for path in (ROOT / "graphcap").rglob("*.py"):
        text = path.read_text()
        if text.lstrip('"').startswith("Deprecated:"):
            continue
        rel = path.relative_to(ROOT / "graphcap").parts
        part = rel[0] if len(rel) > 1 else rel[0].removesuffix(".py")
        names = re.findall(r"^\s*(?:from|import) graphcap\.(\w+)", text, re.M)
        for listed in re.findall(r"^\s*from graphcap import ([\w, ]+)$", text, re.M):
            names += [n.strip() for n in listed.split(",")]
        edges.setdefault(part, set()).update(n for n in names if n != part)
    return edges


def test_no_two_parts_of_the_package_import_each_other_even_through_others():
    edges = _imports()
    edges.pop("__init__", None)  # the public names, on top of everything

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for n in edges.get(todo.pop(), ()):
                if n not in seen:
                    seen.add(n)
                    todo.append(n)
        return seen

    loops = sorted(p for p in edges if p in reach(p))
    assert not loops, f"parts of an import loop: {loops}"


def test_the_engine_is_imported_only_by_the_package_s_top():
    # engine/ is the top floor: the public names, the command line and its benchmarks
    importers = {p for p, names in _imports().items() if "engine" in names}
    assert importers <= {"__init__", "cli", "bench"}, importers
