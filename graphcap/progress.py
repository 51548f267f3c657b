"""A progress bar for long builds and benchmarks (rich's, or plain lines without rich)."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def progress(total: int, what: str):
    """A progress bar; yields ``step(label)`` to call once per unit of work."""
    try:
        from rich.progress import Progress
    except ImportError:
        done = [0]

        def step(label=""):
            done[0] += 1
            print(f"[{done[0]}/{total}] {what} {label}", flush=True)

        yield step
        return
    with Progress(transient=False) as bar:
        task = bar.add_task(what, total=total)

        def step(label=""):
            bar.update(task, advance=1, description=f"{what} {label}")

        yield step
