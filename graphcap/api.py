"""``graphcap.capture``: one entry point for every strategy."""

from __future__ import annotations

import inspect
import os

import torch

from graphcap.breakable import BreakableBackend, DebugBackend
from graphcap.core.backend import EagerBackend
from graphcap.core.buckets import check_ladder, prefill_ladder
from graphcap.core.runner import Runner, RunnerConfig
from graphcap.errors import UnsupportedStrategy
from graphcap.full import FullBackend

BACKENDS = {"eager": EagerBackend, "breakable": BreakableBackend, "full": FullBackend}
STRATEGIES = (*BACKENDS, "tc_piecewise")  # tc_piecewise's backend needs the compiled model


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _kind(model: torch.nn.Module) -> str:
    params = list(inspect.signature(model.forward).parameters)
    return "prefill" if params[:2] == ["input_ids", "positions"] else "generic"


def capture(model: torch.nn.Module, strategy: str = "breakable", *,
            max_tokens: int | None = None,
            buckets=None, max_requests: int | None = None, attention: str | None = None,
            debug: bool = False, fallback: bool = True, copy_outputs: bool = True,
            example_inputs: tuple | None = None, compiler: str = "eager",
            warmup: str = "first", progress=None) -> Runner:
    """Capture ``model`` under ``strategy`` and return a runner callable like the model.

    ``strategy``: ``"eager"`` (no graphs), ``"breakable"`` (graph segments, eager breaks at
    ``@eager_on_graph`` functions and split ops), ``"full"`` (one graph per shape),
    ``"tc_piecewise"`` (torch.compile pieces between split ops, captured per shape).
    ``max_tokens``: the largest bucket, the chunked-prefill size (default 2048);
    ``buckets`` overrides the default ladder (42 shapes for 2048). ``max_requests``:
    request slots per batch (default ``max(max_tokens // 512, 1)``; more requests run
    eagerly). ``attention``: the attention backend of prefill models (default: the best
    one for the strategy).
    ``debug`` (or ``GRAPHCAP_DEBUG_CUDA_GRAPH=1``): breakable with the whole forward as
    one eager break. ``fallback=False`` makes batches that fit no graph an error.
    ``copy_outputs=False`` returns views of the runner's buffers, overwritten by the next
    call. ``compiler`` (tc_piecewise): ``"eager"`` or ``"inductor"`` pieces.
    ``warmup``: ``"first"`` runs one eager warm-up forward, before the first (largest)
    shape's capture, and captures the others directly; a shape whose direct capture fails
    (a library's lazy set-up, a driver refusing a kernel's module load under capture) is
    warmed up and captured again, counted in ``report()["warmup_retries"]`` (its
    ``@eager_on_graph`` functions then run once more). A model that builds state lazily
    per shape (a tensor made on first sight of a size and kept) builds it inside that
    shape's graph, where it holds real values only once the shape has replayed: use
    ``"every"``, which warms up every shape first, so such state is built eagerly.
    tc_piecewise warms every shape (its warm-ups compile).
    ``progress(done, total)`` is called after each captured shape (a progress bar). Prefill
    models, ``forward(input_ids, positions)``, are called as
    ``runner(input_ids, positions, seq_lens=[...])``; any other module as
    ``runner(*tensors)`` with the tokens along dim 0, captured on its first call (or now,
    from ``example_inputs``). A prefill model whose ``output_rows`` attribute is
    ``"requests"`` returns one row per request (last-token logits) instead of per token.

        runner = graphcap.capture(model, strategy="full", max_tokens=512, max_requests=4)
        logits = runner(input_ids, positions, seq_lens=[100, 23])
        print(runner.report())
    """
    if strategy not in STRATEGIES:
        raise UnsupportedStrategy(
            f"unknown strategy {strategy!r}: choose one of {sorted(STRATEGIES)}")
    if os.environ.get("GRAPHCAP_DEBUG_CUDA_GRAPH") == "1":
        debug = True
    if debug and strategy != "breakable":
        raise UnsupportedStrategy("debug=True is a mode of strategy='breakable'")
    if buckets is None:
        ladder = prefill_ladder(max_tokens if max_tokens is not None else 2048)
    else:
        ladder = check_ladder(buckets)
        if max_tokens is not None and max_tokens != ladder[-1]:
            raise ValueError(f"max_tokens={max_tokens} differs from the largest bucket "
                             f"{ladder[-1]}: give one of them, or make them agree")
    if warmup not in ("first", "every"):
        raise ValueError(f"warmup={warmup!r}: use 'first' (warm up the first shape, "
                         "capture the rest directly) or 'every' (warm up every shape)")
    requests = max_requests if max_requests is not None else max(ladder[-1] // 512, 1)
    if requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {requests}")
    device, kind = _device_of(model), _kind(model)
    attn = None
    if kind == "prefill":
        from graphcap.opsdb.attention import get_backend

        attn = get_backend(attention, device, strategy=strategy)
    rows = getattr(model, "output_rows", "tokens")
    if rows not in ("tokens", "requests") or (rows == "requests" and kind != "prefill"):
        raise UnsupportedStrategy(
            f"{type(model).__name__}.output_rows is {rows!r}: use 'tokens' (a row per token) "
            "or, for prefill models only, 'requests' (a row per request, e.g. last-token "
            "logits)")
    config = RunnerConfig(ladder, requests, attn, fallback, copy_outputs, output_rows=rows,
                          warmup=warmup)
    if strategy == "tc_piecewise":
        from graphcap.piecewise import CompiledForward, PiecewiseBackend, PiecewiseCompiler

        pieces = PiecewiseCompiler({"capture_sizes": ladder, "compiler": compiler,
                                    "copy_outputs": False})
        runner = Runner(CompiledForward(model, pieces), PiecewiseBackend(pieces), config,
                        device, kind)
        pieces.pool = runner.pool
    else:
        backend = DebugBackend() if debug else BACKENDS[strategy]()
        runner = Runner(model, backend, config, device, kind)
    if runner.backend.captures and (kind == "prefill" or example_inputs is not None):
        runner.capture_all(example_inputs, progress)
    return runner
