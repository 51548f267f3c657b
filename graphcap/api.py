"""``graphcap.capture``: one entry point for every strategy; ``graphcap.packed``: a model of
packed requests called eagerly."""

from __future__ import annotations

import contextlib
import inspect

import torch

from graphcap import env
from graphcap.breakable import BreakableBackend, DebugBackend
from graphcap.core.backend import EagerBackend
from graphcap.core.batch import as_int, host_lengths
from graphcap.core.buckets import check_ladder, prefill_ladder
from graphcap.core.context import forward_context
from graphcap.core.runner import Runner, RunnerConfig
from graphcap.errors import UnsupportedModel, UnsupportedStrategy
from graphcap.full import FullBackend

BACKENDS = {"eager": EagerBackend, "breakable": BreakableBackend, "full": FullBackend}
STRATEGIES = (*BACKENDS, "tc_piecewise")  # tc_piecewise's backend needs the compiled model
INPUTS = ("prefill", "tensors")
ON_CHANGE = ("recapture", "error")


def _device_of(model: torch.nn.Module) -> torch.device:
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


def _dtype_of(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (its activations')."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def inputs_of(model: torch.nn.Module, inputs: str | None = None) -> str:
    """What a model takes: ``"prefill"`` (``forward(input_ids, positions)`` over packed
    requests, called with ``seq_lens``) or ``"tensors"`` (tensors along dim 0).

    Declared by ``inputs``, else by the model's ``graphcap_inputs`` attribute (graphcap's
    decoders and ``graphcap.hf.PrefillLM`` set it); as a convenience, a model whose
    forward's first two parameters are named ``input_ids, positions`` is a prefill model."""
    declared = inputs if inputs is not None else getattr(model, "graphcap_inputs", None)
    if declared is None:
        params = list(inspect.signature(model.forward).parameters)
        return "prefill" if params[:2] == ["input_ids", "positions"] else "tensors"
    if declared not in INPUTS:
        raise ValueError(f"inputs={declared!r}: a model takes 'prefill' (packed requests: "
                         "forward(input_ids, positions), called with seq_lens) or 'tensors' "
                         "(tensors along dim 0)")
    if declared == "prefill":
        params = [p for p in inspect.signature(model.forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) < 2:
            raise UnsupportedModel(
                f"{type(model).__name__} is declared a prefill model, but its forward takes "
                f"{[p.name for p in params]}: a prefill forward takes (input_ids, positions) "
                "of the packed requests")
    return declared


def _input_bounds(model: torch.nn.Module) -> tuple[int, int | None]:
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        raise UnsupportedModel(
            f"check_inputs=True checks token ids against the model's vocab_size, which "
            f"{type(model).__name__} does not have: set model.vocab_size (and max_position, "
            "to check positions too)")
    return as_int(vocab, "vocab_size"), getattr(model, "max_position", None)


def capture(model: torch.nn.Module, strategy: str = "breakable", *,
            max_tokens: int | None = None,
            buckets=None, max_requests: int | None = None, attention: str | None = None,
            debug: bool = False, fallback: bool = True, copy_outputs: bool = True,
            example_inputs: tuple | None = None, compiler: str = "eager",
            warmup: str = "first", progress=None, inputs: str | None = None,
            on_change: str = "recapture", check_inputs: bool = False) -> Runner:
    """Capture ``model`` under ``strategy`` and return a runner callable like the model.

    ``strategy``: ``"eager"`` (no graphs), ``"breakable"`` (graph segments, eager breaks at
    ``@eager_on_graph`` functions and split ops), ``"full"`` (one graph per shape),
    ``"tc_piecewise"`` (torch.compile pieces between split ops, captured per shape).
    ``inputs``: ``"prefill"`` (packed requests, ``runner(input_ids, positions,
    seq_lens=[...])``) or ``"tensors"`` (``runner(*tensors)``, tokens along dim 0,
    captured on the first call or now from ``example_inputs``); default: the model's
    declaration (:func:`inputs_of`). ``max_tokens``: the largest bucket (default 2048);
    ``buckets`` overrides the default ladder (42 shapes for 2048). ``max_requests``:
    request slots per batch (default ``max(max_tokens // 512, 1)``; more requests run
    eagerly). ``attention``: the prefill attention backend (default: the best one for the
    strategy). ``debug`` (or ``GRAPHCAP_DEBUG_CUDA_GRAPH=1``): breakable with the whole
    forward as one eager break. ``fallback=False`` makes batches that fit no graph an
    error. ``copy_outputs=False`` returns views of the runner's buffers, overwritten by
    the next call. ``compiler`` (tc_piecewise): ``"eager"`` or ``"inductor"`` pieces.
    ``warmup``: ``"first"`` (one eager warm-up, of the largest shape) or ``"every"`` (every
    shape; for models that build state lazily per shape); see docs/strategies.md.
    ``on_change``: what a call does when the model changed since capture (a parameter or
    buffer replaced, moved or converted): ``"recapture"`` every shape, or ``"error"``
    (:class:`~graphcap.errors.ModelChanged`). ``check_inputs=True`` checks token ids and
    positions against the model's ``vocab_size`` and ``max_position`` on every call (one
    host sync each). ``progress``: ``True`` for a progress bar, or ``progress(done,
    total)`` called after each captured shape. A prefill model whose ``output_rows`` is
    ``"requests"`` returns one row per request (last-token logits) instead of per token.

        runner = graphcap.capture(model, strategy="full", max_tokens=512, max_requests=4)
        logits = runner(input_ids, positions, seq_lens=[100, 23])
        print(runner.report())
    """
    if strategy not in STRATEGIES:
        raise UnsupportedStrategy(
            f"unknown strategy {strategy!r}: choose one of {sorted(STRATEGIES)}")
    if env.settings().debug_cuda_graph:
        debug = True
    if debug and strategy != "breakable":
        raise UnsupportedStrategy("debug=True is a mode of strategy='breakable'")
    if buckets is None:
        ladder = prefill_ladder(max_tokens if max_tokens is not None else 2048)
    else:
        ladder = check_ladder(buckets)
        if max_tokens is not None and as_int(max_tokens, "max_tokens") != ladder[-1]:
            raise ValueError(f"max_tokens={max_tokens} differs from the largest bucket "
                             f"{ladder[-1]}: give one of them, or make them agree")
    if warmup not in ("first", "every"):
        raise ValueError(f"warmup={warmup!r}: use 'first' (warm up the first shape, "
                         "capture the rest directly) or 'every' (warm up every shape)")
    if on_change not in ON_CHANGE:
        raise ValueError(f"on_change={on_change!r}: use 'recapture' (capture every shape "
                         "again when the model changed) or 'error' (raise ModelChanged)")
    requests = (as_int(max_requests, "max_requests") if max_requests is not None
                else max(ladder[-1] // 512, 1))
    if requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {requests}")
    device, kind = _device_of(model), inputs_of(model, inputs)
    attn = None
    if kind == "prefill":
        from graphcap.opsdb.attention import get_backend

        attn = get_backend(attention, device, strategy=strategy, dtype=_dtype_of(model))
    rows = getattr(model, "output_rows", "tokens")
    if rows not in ("tokens", "requests") or (rows == "requests" and kind != "prefill"):
        raise UnsupportedStrategy(
            f"{type(model).__name__}.output_rows is {rows!r}: use 'tokens' (a row per token) "
            "or, for prefill models only, 'requests' (a row per request, e.g. last-token "
            "logits)")
    bounds = _input_bounds(model) if check_inputs and kind == "prefill" else None
    config = RunnerConfig(ladder, requests, attn, fallback, copy_outputs, output_rows=rows,
                          warmup=warmup, on_change=on_change, input_bounds=bounds)
    if strategy == "tc_piecewise":
        from graphcap.piecewise import CompiledForward, PiecewiseBackend, PiecewiseCompiler

        pieces = PiecewiseCompiler({"capture_sizes": ladder, "compiler": compiler,
                                    "copy_outputs": False})
        runner = Runner(CompiledForward(model, pieces), PiecewiseBackend(pieces), config,
                        device, kind, source=model)
        pieces.pool = runner.pool
    else:
        backend = DebugBackend() if debug else BACKENDS[strategy]()
        runner = Runner(model, backend, config, device, kind)
    if runner.backend.captures and (kind == "prefill" or example_inputs is not None):
        if progress is True:
            from graphcap.progress import progress as bar

            with bar(len(ladder), f"capturing {type(model).__name__} ({strategy})") as step:
                runner.capture_all(example_inputs, lambda done, total: step())
        else:
            runner.capture_all(example_inputs, progress)
    return runner


@contextlib.contextmanager
def packed(seq_lens, device, attention: str | None = None, dtype: torch.dtype | None = None):
    """Call a model of packed requests eagerly, outside a runner: prepares the attention
    metadata of requests of these lengths (host values) and makes it the forward context,
    which ``graphcap::attention`` reads. ``attention``: the backend (default: the best on
    ``device`` for q/k/v of ``dtype``). Yields the metadata (``meta.last_token_rows()``:
    the row of each request's last token). Leaving the block, a call of several requests
    whose forward ran no graphcap attention raises :class:`~graphcap.errors.
    UnsupportedModel`: its attention could not see where the requests begin and end.

        with graphcap.packed([5, 3], device="cpu"):
            logits = model(input_ids, positions)      # 8 tokens: two requests
    """
    from graphcap.opsdb.attention import get_backend

    device = torch.device(device)
    lens = host_lengths(seq_lens)
    meta = get_backend(attention, device, dtype=dtype).prepare(lens, device)
    with forward_context(attention=meta):
        yield meta
    if sum(n > 0 for n in lens) > 1 and not meta.attended:
        raise UnsupportedModel(
            f"the model called under graphcap.packed({lens}) ran no graphcap attention, so "
            "its attention could not see where the packed requests begin and end: route "
            "it through graphcap.opsdb.attention.ATTENTION (docs/models.md, 'Bring your own "
            "model'), or call it with one request at a time")
