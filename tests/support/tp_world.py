"""Processes joined in one torch.distributed world, kept for the whole test session: each
test runs its scenario, ``fn(rank, *args)``, on every rank of the same processes, instead
of starting (and importing torch in) new ones.

A scenario is a module-level function (the ranks import it by name); it makes its own
``TPGroup``s, so a group one scenario closed is never another's. A rank's exception
fails the test with that rank's traceback; a scenario that has not ended on every rank
within ``timeout_s`` fails it too, and the world is started anew for the next test.
"""

from __future__ import annotations

import multiprocessing as mp
import random
import tempfile
import time
import traceback
import zlib

import pytest

_WORLDS: dict[tuple[int, str], World] = {}


def _serve(rank: int, size: int, init: str, backend: str, conn) -> None:
    import torch
    import torch.distributed as dist

    from graphcap.tp import release_all

    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size)
    try:
        while True:
            job = conn.recv()
            if job is None:
                return
            fn, args = job
            seed = zlib.crc32(fn.__qualname__.encode())  # as tests/conftest.py seeds a test
            torch.manual_seed(seed)
            random.seed(seed)
            try:
                fn(rank, *args)
            except BaseException:  # noqa: BLE001  every failure goes back to the test
                conn.send(traceback.format_exc())
            else:
                conn.send(None)
    finally:
        release_all()  # every scenario's groups, before the world's
        dist.destroy_process_group()


class World:
    def __init__(self, size: int, backend: str):
        self.size, self.backend = size, backend
        self._folder = tempfile.TemporaryDirectory()
        context = mp.get_context("spawn")
        self._conns, self._procs = [], []
        for rank in range(size):
            mine, theirs = context.Pipe()
            proc = context.Process(target=_serve, daemon=True, args=(
                rank, size, f"file://{self._folder.name}/init", backend, theirs))
            proc.start()
            self._conns.append(mine)
            self._procs.append(proc)

    def run(self, fn, *args, timeout_s: float = 600.0) -> None:
        for conn in self._conns:
            conn.send((fn, args))
        deadline = time.monotonic() + timeout_s
        failures = []
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs, strict=True)):
            try:
                outcome = conn.recv() if conn.poll(max(deadline - time.monotonic(), 0)) \
                    else f"did not finish within {timeout_s:g} s"
            except EOFError:
                proc.join(5)
                outcome = f"died (exit code {proc.exitcode})"
            if outcome is not None:
                failures.append(f"rank {rank}: {outcome}")
        if failures:  # the ranks may be out of step now: the next test gets a new world
            self.stop()
            pytest.fail(f"{fn.__name__} failed on the test world:\n" + "\n".join(failures),
                        pytrace=False)

    def stop(self) -> None:
        for conn, proc in zip(self._conns, self._procs, strict=True):
            try:
                conn.send(None)
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()
        _WORLDS.pop((self.size, self.backend), None)
        self._folder.cleanup()


def world(size: int = 2, backend: str = "gloo") -> World:
    """The session's world of ``size`` ranks on ``backend``, started on first use."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    key = (size, backend)
    if key not in _WORLDS or not all(p.is_alive() for p in _WORLDS[key]._procs):
        if key in _WORLDS:
            _WORLDS[key].stop()
        _WORLDS[key] = World(size, backend)
    return _WORLDS[key]


def stop_all() -> None:
    for w in list(_WORLDS.values()):
        w.stop()
