"""What every benchmark shares: the run's environment, interleaved CUDA-event timing, and
writing the result.

Timings are wall times of whole calls measured with CUDA events around them: a prefill
call is launch-bound, so the host's time to launch is part of what is measured. Arms of
one case run interleaved (round-robin, several rounds), so the drift of a noisy machine
hits them alike; the figure is the median over every repetition.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from graphcap import env
from graphcap.errors import GraphcapError


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


ROOT = Path(__file__).resolve().parents[2]  # the project: graphcap/bench/common.py


def commit(root: Path = ROOT) -> str:
    """The commit being measured: ``GRAPHCAP_COMMIT``, else the HEAD of the git checkout
    the project runs from (``-dirty`` with uncommitted changes). A copy of the tree that
    is no checkout of its own (inside another repository, or none) has no commit to read:
    the enclosing repository's HEAD is not the project's."""
    if env.settings().commit:
        return env.settings().commit

    def git(*args) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True,
                              text=True, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root.resolve():
            raise subprocess.CalledProcessError(1, "git")
        head = git("rev-parse", "--short", "HEAD")
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no")
                       else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout of graphcap: set GRAPHCAP_COMMIT)"


def environment() -> dict:
    """Commit, date, device, library versions and the command line of this run."""
    return {
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"),
        "flash_attn_4": _version("flash-attn-4"),
        "command": "graphcap " + " ".join(sys.argv[1:]) if sys.argv else "graphcap",
        "pdl": _pdl(),
    }


def _pdl() -> bool:
    """Whether the project's Triton kernels launch with PDL here (``GRAPHCAP_PDL=0``
    switches it off, e.g. to compare)."""
    if not torch.cuda.is_available():
        return False
    try:
        from graphcap.opsdb.triton.common import pdl
    except ImportError:  # no Triton
        return False
    return pdl(torch.device("cuda"))


def _stats(samples: list[float]) -> dict:
    qs = (statistics.quantiles(samples, n=10, method="inclusive") if len(samples) > 1
          else samples * 9)
    return {"median_ms": round(statistics.median(samples), 4), "p10_ms": round(qs[0], 4),
            "p90_ms": round(qs[-1], 4), "n": len(samples)}


def time_interleaved(arms: dict[object, Callable[[], object]], *, reps: int = 30,
                     rounds: int = 5, warmup: int = 3, settle_ms: float = 0.0,
                     settle_calls: int = 0, warmup_s: float = 0.0, timer=None, sync=None,
                     on_round=None) -> dict[object, dict]:
    """Median (and p10/p90) milliseconds of one call of each arm: ``warmup`` untimed calls
    each, then ``rounds`` rounds in which every arm runs ``ceil(reps / rounds)`` timed
    calls (``reps`` at least; ``n`` of each result says how many);
    ``on_round(done)`` after each round (a progress bar).

    ``warmup_s``: after the warm-up calls, untimed passes over every arm, each call
    waited for, until that many seconds have passed since the warm-up began: the timing
    starts from the steady state, not from a process fresh from building its arms.

    ``settle_ms``: in each round, before its timed calls, an arm runs untimed calls, each
    waited for (``sync``), until that many milliseconds have passed (one call at least):
    a fast graph arm is then timed on a device busy with its own work, not on one the
    previous arm left idle for tens of milliseconds (an eager forward is mostly host
    time), so its figure does not depend on which arms ran beside it. ``settle_calls``:
    the same by a count of calls, for processes that must make the same calls (the ranks
    of a TP model, where time-bound loops would make them call different numbers of
    times)."""
    cuda = torch.cuda.is_available()
    timer = timer or (cuda_event_ms if cuda else wall_ms)
    sync = sync or (torch.cuda.synchronize if cuda else (lambda: None))
    start = time.perf_counter()
    for fn in arms.values():
        for _ in range(warmup):
            fn()
    while time.perf_counter() - start < warmup_s:
        for fn in arms.values():
            fn()
            sync()
    samples: dict[str, list[float]] = {name: [] for name in arms}
    per_round = max(-(-reps // rounds), 1)
    for done in range(1, rounds + 1):
        for name, fn in arms.items():
            if settle_ms > 0:
                _settle(fn, settle_ms, sync)
            for _ in range(settle_calls):
                fn()
                sync()
            samples[name] += [timer(fn) for _ in range(per_round)]
        if on_round is not None:
            on_round(done)
    return {name: _stats(s) for name, s in samples.items()}


def _settle(fn: Callable[[], object], ms: float, sync: Callable[[], object]) -> None:
    start = time.perf_counter()
    while True:
        fn()
        sync()
        if (time.perf_counter() - start) * 1000 >= ms:
            return


def wall_ms(fn: Callable[[], object]) -> float:
    """Host wall milliseconds of ``fn`` (machines without CUDA: smoke runs only)."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def back_to_back(cases: dict, calls: int = 20, **timing) -> dict:
    """Milliseconds a call of each of ``cases`` when ``calls`` calls are fed back to back
    with no wait between them (the host may run ahead of the device, as in a serving
    loop): runs of ``calls`` calls timed as :func:`time_interleaved` times one call
    (``timing``: its rounds, warm-up and pacing, so no case's figure depends on the case
    run before it), the median run over ``calls``."""
    runs = {key: (lambda fn=fn: [fn() for _ in range(calls)]) for key, fn in cases.items()}
    return {key: round(t["median_ms"] / calls, 4)
            for key, t in time_interleaved(runs, **timing).items()}


def host_us(fn: Callable[[], object], reps: int = 50) -> float:
    """Median host microseconds of ``fn()`` from an idle device: the Python and launch
    calls until it returns (on CUDA its device work is only enqueued)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(reps):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return round(statistics.median(times) * 1e6, 1)


def cuda_event_ms(fn: Callable[[], object]) -> float:
    """Milliseconds from before ``fn``'s first launch to after its last kernel."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def check_out(out: str | None) -> None:
    """Refuse, before a run, an ``--out`` that :func:`write_result` could not write after
    it (the figures of minutes lost to a traceback): a directory, a path under a file, or
    in a directory this process may not write into; a PNG's name, which the plot beside
    the JSON would take. No ``--out``: a dated name in the working directory."""
    if out is None:
        if not os.access(Path.cwd(), os.W_OK | os.X_OK):
            raise GraphcapError(f"this process may not write into the working directory "
                                f"{Path.cwd()}, where the result goes without --out: give "
                                "--out a path in a directory it can write")
        return
    path = Path(out)
    if path.suffix.lower() == ".png":  # the plot's name: it would be written over the JSON
        raise GraphcapError(f"--out {out}: --out names the JSON file, and a plot goes beside "
                            f"it as .png, over it: give {path.with_suffix('.json')}")
    if path.is_dir():
        raise GraphcapError(f"--out {out} is a directory: give a file in it, such as "
                            f"{path / 'result.json'}")
    parent = path.parent
    while not parent.exists():  # the directories write_result makes
        parent = parent.parent
    if not parent.is_dir():
        raise GraphcapError(f"--out {out}: {parent} is a file, not a directory: give a "
                            "path in a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise GraphcapError(f"--out {out}: this process may not write into {parent}: give "
                            "a path in a directory it can write")


def write_result(record: dict, out: str | None, default: str,
                 beside: tuple[str, ...] = ()) -> Path:
    """Write ``record`` as JSON to ``out`` (default: ``default`` in the working directory)
    and return the path; never overwrites a file: where one is there, or one of the
    ``beside`` suffixes the caller writes next (``.png``: its plot), the next free
    ``<stem>-2``, ``-3``, ... (the caller prints the path written)."""
    path = Path(out or default)

    def taken(p: Path) -> bool:
        return p.exists() or any(p.with_suffix(s).exists() for s in beside)

    stem, n = path.stem, 2
    while taken(path):
        path = path.with_name(f"{stem}-{n}{path.suffix}")
        n += 1
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    return path


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")
