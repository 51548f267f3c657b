"""Whether a decode step's linears read faster when a parallel branch of its CUDA graph asks
L2 for the next linear's weight while this one runs (device side):

    PYTHONPATH=. python3 docs/notes/probes/l2_branch.py [preset] [batches]

At batch 1 and 8 a decode step is a chain of launches, each paying about 2.4 us besides
its bytes (docs/notes/2026-12-04-decode-launch-floor.md). PDL's in-kernel prefetch starts
a weight's read only once the kernel is resident. Here a second stream, forked in the
graph before each linear, runs a small kernel that asks L2 for the weight ``DISTANCE``
linears ahead (at most ``CAP`` bytes of it), so the HBM stream overlaps the main chain's
fixed costs; the main chain never waits for the branch (it joins at the step's end).

Arms: today's runner, and branches that prefetch line by line (``prefetch.global.L2``
from ``GRID`` programs) or in bulk (``cp.async.bulk.prefetch.L2``, one 16 KiB chunk a
lane), PDL on and off. The weights a step reads, in order, are recorded by a dispatch
mode over a capture's forward (a parameter of at least 1 MiB that an op reads, the
embedding lookup excepted); the same mode forks the branch during the arms' captures. Calls timed
interleaved, alone and fed back to back; kernels and idle share from the profiler;
logits against today's. JSON in $OUT/l2-branch-<preset>-<cap>mb.json
(``L2_CAP_MB``: the cap, 16 by default)."""

import json
import os
import sys

import torch
import triton
import triton.language as tl
from probe_common import prefilled_decode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import graphcap
from graphcap.bench.common import back_to_back, environment, time_interleaved
from graphcap.bench.decode import profile_steps
from graphcap.inputs import DecodeInputs
from graphcap.opsdb.triton.common import prefetch_share_l2, programmatic_launch

CONTEXT = 1024
MIN_BYTES = 1 << 20
CAP = int(os.environ.get("L2_CAP_MB", "16")) << 20  # the bytes of a weight asked for
CHUNK = 16 << 10
LINE_BYTES = 128
# (name, primitive, DISTANCE, GRID, PDL)
ARMS = [("today", None, 0, 0, True), ("today-nopdl", None, 0, 0, False),
        ("line-d1-g16", "line", 1, 16, True), ("line-d1-g32", "line", 1, 32, True),
        ("line-d2-g16", "line", 2, 16, True), ("line-d1-g16-nopdl", "line", 1, 16, False),
        ("bulk-d1-g8", "bulk", 1, 8, True), ("bulk-d1-g32", "bulk", 1, 32, True),
        ("bulk-d2-g16", "bulk", 2, 16, True), ("bulk-d1-g16-nopdl", "bulk", 1, 16, False),
        ("bulk-d1-g16", "bulk", 1, 16, True)]
if os.environ.get("L2_ARMS"):  # a shorter run: these arms only (today's always)
    ARMS = [a for a in ARMS if a[0] == "today" or a[0] in os.environ["L2_ARMS"].split(",")]


@triton.jit
def _line_prefetch(ptr, n_lines, LINE: tl.constexpr):
    prefetch_share_l2(ptr, n_lines, LINE, 1024)


@triton.jit
def _bulk_prefetch(ptr, n_bytes, CHUNK: tl.constexpr):
    """``ptr`` bytes: each lane asks L2 for one ``CHUNK`` (the last one shorter) by TMA."""
    lanes = tl.arange(0, 32)
    n_chunks = tl.cdiv(n_bytes, CHUNK)
    for c0 in range(tl.program_id(0) * 32, n_chunks, tl.num_programs(0) * 32):
        c = c0 + lanes
        ok = c < n_chunks
        size = tl.where(ok, tl.minimum(n_bytes - c * CHUNK, CHUNK), 0)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; "
            "@p cp.async.bulk.prefetch.L2.global [$1], $2; } // $0",
            "=r,l,r", [tl.where(ok, ptr + c * CHUNK, ptr), size], dtype=tl.int32,
            is_pure=False, pack=1)


def prefetch(weight: torch.Tensor, primitive: str, grid: int) -> None:
    """Ask L2 for the first ``CAP`` bytes of ``weight`` on the current stream."""
    flat = weight.detach().reshape(-1).view(torch.uint8)
    n = min(flat.numel(), CAP) // 16 * 16
    if primitive == "line":
        _line_prefetch[(grid,)](flat, triton.cdiv(n, LINE_BYTES), LINE=LINE_BYTES,
                                num_warps=4)
    else:
        _bulk_prefetch[(grid,)](flat, n, CHUNK=CHUNK, num_warps=1)


def _key(t: torch.Tensor) -> int:
    return t.data_ptr()


class Weights(TorchDispatchMode):
    """Records the order in which ops read the model's large parameters (``record``), or
    forks a branch before each one that asks L2 for the weight ``distance`` ahead."""

    def __init__(self, model, order=None, launch=None, distance=1):
        super().__init__()
        self.params = {_key(p): p for p in model.parameters()
                       if p.numel() * p.element_size() >= MIN_BYTES}
        self.order, self.launch, self.distance = order, launch, distance
        self.seen: list[int] = []
        self.fired = 0
        self.quiet = False  # the branch's own launches are not the step's reads

    def start_step(self) -> None:
        self.seen = []
        self.fired = 0
        if self.launch is not None:
            self.quiet = True
            try:
                for key in self.order[:self.distance]:
                    self.launch(self.params[key])
            finally:
                self.quiet = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.quiet and "embedding" not in str(func) and "index" not in str(func):
            for t in tree_leaves((args, kwargs)):
                if isinstance(t, torch.Tensor) and _key(t) in self.params:
                    self._read(_key(t))
        return func(*args, **kwargs)

    def _read(self, key: int) -> None:
        if self.seen and self.seen[-1] == key:
            return
        i = len(self.seen)
        self.seen.append(key)
        if self.launch is None:
            return
        if i >= len(self.order) or self.order[i] != key:
            raise RuntimeError(f"step read weight {i} out of the recorded order")
        ahead = i + self.distance
        if ahead < len(self.order):
            self.launch(self.params[self.order[ahead]])
            self.fired += 1


def branched(model, order, primitive, distance, grid):
    """A dispatch mode that forks the branch during a capture of ``model``, and joins it
    (``join``, called at the step's end)."""
    side = torch.cuda.Stream()

    def launch(weight):
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            prefetch(weight, primitive, grid)

    mode = Weights(model, order, launch, distance)
    mode.join = lambda: torch.cuda.current_stream().wait_stream(side)
    return mode


def step_hooks(model) -> list:
    """Hooks on ``model`` that start and end a step of the mode in the returned list's
    only item (none: nothing). Registered once, before any capture: the runners see the
    same hooks as at their capture, so none captures again."""
    active = [None]

    def pre(module, args):
        if active[0] is not None:
            active[0].start_step()

    def post(module, args, out):
        if active[0] is not None and getattr(active[0], "join", None) is not None:
            active[0].join()

    model.register_forward_pre_hook(pre)
    model.register_forward_hook(post)
    return active


def main(preset: str, batches: list[int]) -> None:
    model, cache, tokens = prefilled_decode(preset, max(batches), CONTEXT)
    active = step_hooks(model)

    def call(r, b):
        return r(tokens[:b], positions=[CONTEXT] * b, slots=list(range(b)))

    def capture(mode=None):
        active[0] = mode
        try:
            if mode is None:
                return graphcap.capture(model, "full", buckets=batches,
                                        inputs=DecodeInputs(cache))
            with mode:
                return graphcap.capture(model, "full", buckets=batches,
                                        inputs=DecodeInputs(cache))
        finally:
            active[0] = None

    recorder = Weights(model)
    capture(recorder)
    order = list(recorder.seen)
    mb = sum(recorder.params[k].nbytes for k in order) / 1e6
    print(f"weights a step: {len(order)}, {mb:.1f} MB", flush=True)
    runners, errors = {}, {}
    for name, primitive, distance, grid, pdl in ARMS:
        try:
            with programmatic_launch(pdl):
                mode = None if primitive is None else branched(model, order, primitive,
                                                                distance, grid)
                r = capture(mode)
            for b in batches:
                call(r, b)
            runners[name] = r
            if mode is not None:
                print(name, "branch launches a step:", mode.fired, flush=True)
        except Exception as e:  # one arm's failure must not lose the others
            errors[name] = repr(e)[:800]
            print(name, "failed:", errors[name], flush=True)
    cases = {(b, n): (lambda r=r, b=b: call(r, b)) for b in batches
             for n, r in runners.items()}
    times = time_interleaved(cases, reps=200, rounds=5)
    fed = back_to_back(cases, reps=5, rounds=5)
    rows = []
    for b in batches:
        want = call(runners["today"], b).float()
        for n in runners:
            fn = cases[b, n]
            prof = profile_steps(fn)
            top = prof.get("top_kernels", [])
            rows.append({"arm": n, "batch": b, "ms": times[b, n]["median_ms"],
                         "ms_back_to_back": fed[b, n],
                         "kernels": prof.get("kernels"), "idle_share": prof.get("idle_share"),
                         "max_logit_diff": float((fn().float() - want).abs().max()),
                         "top_kernels": top})
            r = rows[-1]
            print(f"b{b} {n}: {r['ms']:.4f} ms a call, {r['ms_back_to_back']:.4f} back to "
                  f"back, {r['kernels']} kernels, idle {r['idle_share']}, diff "
                  f"{r['max_logit_diff']:.3g}", flush=True)
    out = {"what": "decode step with a graph branch asking L2 for the next linear's weight",
           **environment(), "preset": preset, "context": CONTEXT, "cap_bytes": CAP,
           "weights_a_step": len(order or []), "arms": [list(a) for a in ARMS],
           "errors": errors, "rows": rows}
    name = f"l2-branch-{preset}-{CAP >> 20}mb.json"
    with open(os.path.join(os.environ.get("OUT", "/tmp"), name), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b",
         [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")])
