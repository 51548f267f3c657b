"""A fresh process whose first capture gets a real SIGINT (tests/core/test_interrupts.py).

    python tests/support/interrupted_capture.py STRATEGY MODULE HOW

The process sends itself SIGINT when MODULE starts importing during its first capture
(an import hook: a deterministic point, no timing). HOW: ``plain`` (Python's own handler:
KeyboardInterrupt), ``handler`` (a handler of the user's, which must be called and left
installed), ``thread`` (the first capture on a worker thread, the main thread waiting).
Then it captures again and checks the runner against eager. It prints one JSON line:
``interrupted``, ``fired``, ``worker_failed``, ``handler_calls``, ``handler_kept``,
``imported`` (modules the second capture imported), ``matches``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading

import torch

import graphcap
from graphcap.models import build_model

strategy, module, how = sys.argv[1:4]
fired: list[str] = []


class InterruptAt:
    """An import hook that sends this process SIGINT when ``module`` starts importing."""

    def find_spec(self, name, path=None, target=None):
        if name == module and not fired:
            fired.append(name)
            os.kill(os.getpid(), signal.SIGINT)
        return None  # the import itself goes on, through the other finders


calls: list[int] = []


def handler(signum, frame):
    calls.append(signum)


installed = handler if how == "handler" else signal.default_int_handler
signal.signal(signal.SIGINT, installed)
device = "cpu"  # the graph emulator, whose first capture imports Dynamo and sympy
model = build_model("tiny", device=device)
options = {"buckets": [8], "max_requests": 1, "attention": "torch_masked"}
interrupted = False
failed: list[str] = []  # what the worker thread's capture raised
done = threading.Event()  # the worker's capture returned or raised


def capture_on_worker():
    try:
        graphcap.capture(model, strategy, **options)
    except BaseException as exc:  # noqa: BLE001  reported to the test
        failed.append(repr(exc))
    finally:
        done.set()


sys.meta_path.insert(0, InterruptAt())
try:
    if how == "thread":
        worker = threading.Thread(target=capture_on_worker)
        worker.start()
        # Not join(): on Python 3.11 a join that KeyboardInterrupt interrupts can mark the
        # thread stopped while it still runs (threading's bpo-45274 handling), and a
        # later join() returns at once; the process would then exit mid-capture.
        while not done.is_set():
            try:
                done.wait()
            except KeyboardInterrupt:  # raised on the main thread, while the worker imports
                interrupted = True
        worker.join()
    else:
        graphcap.capture(model, strategy, **options)
except KeyboardInterrupt:
    interrupted = True
sys.meta_path.pop(0)

ids = torch.randint(1, model.args.vocab_size, (8,), generator=torch.Generator().manual_seed(0))
ids, pos = ids.to(device), torch.arange(8, device=device)
before = set(sys.modules)
runner = graphcap.capture(model, strategy, **options)
got = runner(ids, pos, seq_lens=[8])
imported = sorted(set(sys.modules) - before)
with graphcap.packed([8], device, attention="torch_masked"), torch.inference_mode():
    expected = model(ids, pos)
print(json.dumps({
    "interrupted": interrupted, "fired": fired, "worker_failed": failed,
    "handler_calls": len(calls),
    "handler_kept": signal.getsignal(signal.SIGINT) is installed, "imported": imported,
    "matches": bool(torch.allclose(got, expected, atol=1e-5, rtol=1e-5)),
}))
