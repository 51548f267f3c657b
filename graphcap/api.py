"""``graphcap.capture``: one entry point for every strategy."""

from __future__ import annotations

import inspect
import logging

import torch

from graphcap import compat, env
from graphcap.breakable import BreakableStrategy, DebugStrategy
from graphcap.compat import imports
from graphcap.config import CaptureConfig
from graphcap.core.buckets import check_ladder, prefill_ladder
from graphcap.core.checks import as_int, positive_int
from graphcap.core.inputs import Inputs
from graphcap.core.runner import Runner, RunnerConfig
from graphcap.core.strategy import EagerStrategy
from graphcap.errors import CaptureError, UnsupportedModel, UnsupportedStrategy
from graphcap.full import FullStrategy
from graphcap.inputs import PrefillInputs, TensorInputs
from graphcap.tp.group import entry, group_of


def _tc_piecewise(model, ladder: list[int], options: dict):
    from graphcap.piecewise import CompiledForward, PiecewiseCompiler, PiecewiseStrategy

    pieces = PiecewiseCompiler({"capture_sizes": ladder, "compiler": options["compiler"],
                                "copy_outputs": False})
    return PiecewiseStrategy(pieces), CompiledForward(model, pieces)


# Every strategy: (model, ladder, options) -> (the strategy, what the runner calls).
STRATEGIES = {
    "eager": lambda model, ladder, options: (EagerStrategy(), model),
    "breakable": lambda model, ladder, options: (
        DebugStrategy() if options["debug"] else BreakableStrategy(), model),
    "full": lambda model, ladder, options: (FullStrategy(), model),
    "tc_piecewise": _tc_piecewise,
}
GRAPHED = tuple(s for s in STRATEGIES if s != "eager")  # the strategies that capture
INPUTS = ("prefill", "tensors")
# Options that only one strategy, or one kind of input, takes: given elsewhere, an error.
_ONLY = {"debug": ("strategy", "breakable"), "compiler": ("strategy", "tc_piecewise"),
         "example_inputs": ("inputs", "tensors"), "attention": ("inputs", "prefill"),
         "max_requests": ("inputs", "prefill"), "check_inputs": ("inputs", "prefill")}


def _device_of(model: torch.nn.Module, example=None) -> torch.device:
    """Where ``model`` runs: its tensors' device; a model without parameters or buffers,
    its ``example`` inputs' (``example_inputs``), else the CPU."""
    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    tensors = [a for a in example or () if isinstance(a, torch.Tensor)]
    return tensors[0].device if tensors else torch.device("cpu")


def model_dtype(model: torch.nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating-point parameter (its activations')."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def backend_for(model: torch.nn.Module, attention: str | None, device,
                strategy: str | None = None, dtype: torch.dtype | None = None):
    """The prefill attention backend ``attention`` (None: the best on ``device`` for
    ``strategy``) of ``model``: for its dtype (``dtype`` when given) and computing the
    variant options its layers declare (``graphcap_attention_options``): a named one that
    does not is refused here, naming the model and the backends that would, before
    anything is built."""
    from graphcap.opsdb.attention import check_serves, get_backend

    options = getattr(model, "graphcap_attention_options", ())
    backend = get_backend(attention, device, strategy=strategy,
                          dtype=dtype or model_dtype(model),
                          options=options if attention is None else ())
    check_serves(backend, options, device=device, whose=f"{type(model).__name__}'s layers")
    return backend


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
    if declared not in INPUTS:  # the model's own declaration named as such: not an argument
        where = f"inputs={declared!r}" if inputs is not None else \
            f"{type(model).__name__}.graphcap_inputs is {declared!r}"
        raise UnsupportedModel(f"{where}: a model takes 'prefill' (packed requests: "
                               "forward(input_ids, positions), called with seq_lens) or "
                               "'tensors' (tensors along dim 0)")
    if declared == "prefill":
        params = list(inspect.signature(model.forward).parameters.values())
        if any(p.kind == p.VAR_POSITIONAL for p in params):  # a wrapper's: torch.compile's
            return declared
        params = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(params) < 2:
            raise UnsupportedModel(
                f"{type(model).__name__} is declared a prefill model, but its forward takes "
                f"{[p.name for p in params]}: a prefill forward takes (input_ids, positions) "
                "of the packed requests")
    return declared


def output_rows(model: torch.nn.Module, kind: str) -> str:
    """The rows the model returns (its ``output_rows``): ``"tokens"`` (the default) or,
    for a prefill model, ``"requests"``; another value is refused naming both."""
    rows = getattr(model, "output_rows", "tokens")
    if rows not in ("tokens", "requests") or (rows == "requests" and kind != "prefill"):
        raise UnsupportedStrategy(
            f"{type(model).__name__}.output_rows is {rows!r}: use 'tokens' (a row per token) "
            "or, for prefill models only, 'requests' (a row per request, e.g. last-token "
            "logits)")
    return rows


def _input_bounds(model: torch.nn.Module) -> tuple[int, int | None]:
    vocab = getattr(model, "vocab_size", None)
    if vocab is None:
        raise UnsupportedModel(
            f"check_inputs=True checks token ids against the model's vocab_size, which "
            f"{type(model).__name__} does not have: set model.vocab_size (and max_position, "
            "to check positions too)")
    return as_int(vocab, "vocab_size"), getattr(model, "max_position", None)


def capture(model: torch.nn.Module, strategy: str = "breakable",
            config: CaptureConfig | None = None, **options) -> Runner:
    """Capture ``model`` under ``strategy`` (one of :data:`STRATEGIES`) and return a runner
    callable like the model: a prefill model as ``runner(input_ids, positions,
    seq_lens=[...])``, a model of tensors as ``runner(*tensors)``.

    ``config`` (a :class:`~graphcap.config.CaptureConfig`) and ``options`` (its fields as
    keywords, replacing the config's) say how: ``max_tokens``, ``buckets``,
    ``max_requests``, ``attention``, ``check_inputs``, ``inputs``, ``debug``,
    ``compiler``, ``example_inputs``, ``fallback``, ``copy_outputs``, ``warmup``,
    ``on_change``, ``progress`` (docs/strategies.md). An option the strategy or the model
    does not take is an error; under ``"eager"`` (the reference, no graphs) the capture
    options are accepted, so one set of options runs under every strategy, and change
    nothing.

        runner = graphcap.capture(model, strategy="full", max_tokens=512, max_requests=4)
        logits = runner(input_ids, positions, seq_lens=[100, 23])
        print(runner.report())
    """
    # A split model's ranks refuse together, else agree on what they capture.
    with entry(model, "a capture", warm=True) as key:
        c, inputs, ladder, debug = _plan(model, strategy, config, options)
        if key is not None:  # a split model's
            # The compiler too: the ranks' replicated norms and router must round alike.
            key.append(repr((strategy, ladder, inputs.kind, c.fallback, c.copy_outputs,
                             c.on_change, c.max_requests, c.attention, c.compiler or "eager")))
    run = RunnerConfig(ladder, c.fallback, c.copy_outputs, warmup=c.warmup,
                       on_change=c.on_change, ranks=group_of(model))
    how, called = STRATEGIES[strategy](model, ladder, {"debug": debug,
                                                       "compiler": c.compiler or "eager"})
    runner = Runner(called, how, run, inputs, source=model)
    if how.captures and (not inputs.needs_batch or c.example_inputs is not None):
        if callable(c.progress) or not c.progress:  # a callback, or none (None, False)
            runner.capture_all(c.example_inputs, c.progress if c.progress else None)
        else:
            from graphcap.progress import progress as bar

            with bar(len(ladder), f"capturing {type(model).__name__} ({strategy})") as step:
                runner.capture_all(c.example_inputs, lambda done, total: step())
    inputs.claim(runner)
    return runner


def _plan(model, strategy, config, options):
    """``capture()``'s arguments checked: the config with the options, the inputs object,
    the ladder of buckets, and whether breakable captures in debug mode."""
    if config is not None and not isinstance(config, CaptureConfig):
        raise TypeError(f"capture(model, strategy, config): config must be a "
                        f"graphcap.CaptureConfig, got {type(config).__name__}; give options "
                        "as keywords")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"capture(model, ...): model must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    if isinstance(strategy, CaptureConfig):
        raise TypeError("capture(model, strategy, config): the config came where the "
                        "strategy goes; give capture(model, 'full', config)")
    c = (config or CaptureConfig()).with_options(options)
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        raise UnsupportedStrategy(
            f"unknown strategy {strategy!r}: choose one of {sorted(STRATEGIES)}")
    if strategy in ("full", "breakable"):
        _refuse_graphs_of_its_own(model, strategy)
    imports.complete(imports.for_capture(strategy, c.compiler))  # a Ctrl-C leaves none half done
    debug = c.debug or (env.settings().debug_cuda_graph and strategy == "breakable")
    inputs = c.inputs
    kind = inputs.kind if isinstance(inputs, Inputs) else inputs_of(model, inputs)
    given = {"debug": debug, "compiler": c.compiler is not None,
             "example_inputs": c.example_inputs is not None,
             "attention": c.attention is not None, "max_requests": c.max_requests is not None,
             "check_inputs": c.check_inputs}
    if isinstance(inputs, Inputs):
        inputs.check_free()
        if inputs.strategies is not None and strategy not in inputs.strategies:
            raise UnsupportedStrategy(
                f"{type(inputs).__name__} runs under {', '.join(inputs.strategies)}, not "
                f"{strategy}: {inputs.why_not}")
        carried = [o for o in ("attention", "max_requests", "check_inputs") if given[o]]
        if carried:
            raise UnsupportedStrategy(
                f"{', '.join(o + '=' for o in carried)} beside an inputs object: what a "
                f"kind of input takes is the inputs object's ({type(inputs).__name__})")
    for option, (what, only) in _ONLY.items():
        if given[option] and (strategy if what == "strategy" else kind) != only:
            raise UnsupportedStrategy(
                f"{option}= is an option of {what} {only!r} only, and this capture's "
                f"{what} is {strategy if what == 'strategy' else kind!r}: leave it out")
    ladder = _ladder(c.max_tokens, c.buckets,
                     inputs.default_buckets if isinstance(inputs, Inputs) else None)
    slots = (positive_int(c.max_requests, "max_requests") if c.max_requests is not None
             else max(ladder[-1] // 512, 1))
    if not isinstance(inputs, Inputs):
        inputs = _inputs(model, kind, strategy, c.attention, slots, c.check_inputs,
                         c.example_inputs)
        if kind == "prefill":  # by its forward's parameter names alone: refusals say so
            inputs.guessed = c.inputs is None and getattr(model, "graphcap_inputs", None) is None
    inputs.bind(model)
    if inputs.most_tokens is not None and ladder[-1] > inputs.most_tokens:
        logging.getLogger("graphcap").warning(
            "graphcap: buckets %s are larger than any call of %s fills (at most %d tokens%s):"
            " they are captured and never replayed; leave them out, or build the cache with "
            "more max_requests", [b for b in ladder if b > inputs.most_tokens],
            type(inputs).__name__, inputs.most_tokens, inputs.limits())
    if strategy != "eager" and inputs.needs_batch and c.example_inputs is None and \
            c.progress not in (None, False):
        raise UnsupportedStrategy(
            "progress= shows a capture made by capture(), and this model of tensors is "
            "captured at its first call: give example_inputs=(...) to capture it now")
    return c, inputs, ladder, debug


def _refuse_graphs_of_its_own(model: torch.nn.Module, strategy: str) -> None:
    """CaptureError where ``model`` or a module of it is compiled by the sgl_piecewise
    backend: it captures graphs of its own, which cannot be captured inside ``strategy``'s
    (the emulator's Dynamo skips it, and fullgraph=True raised torch's "found no compiled
    frames")."""
    for name, module in model.named_modules():
        backend = compat.compiled_with(module)
        if backend is None:
            continue
        from graphcap.piecewise.compiler import PiecewiseCompiler, sgl_piecewise

        if backend is sgl_piecewise or isinstance(backend, PiecewiseCompiler):
            what = "model" + (f".{name}" if name else "")
            raise CaptureError(
                f"{what} ({type(module).__name__}) is compiled with torch.compile(..., "
                f"backend='sgl_piecewise'), which captures graphs of its own: strategy "
                f"{strategy!r} would capture them inside its graphs, and graphs do not nest. "
                f"Capture the module it compiled ({what}._orig_mod) under {strategy!r}, or "
                "the model under strategy='tc_piecewise' (the same backend, the runner "
                "capturing)")


def _ladder(max_tokens, buckets, default=None) -> list[int]:
    """The buckets given, else ``default(max_tokens)`` (an inputs object's own ladder, up
    to max_tokens where given), else the token ladder to max_tokens (2048)."""
    if buckets is None:
        own = default(max_tokens) if default is not None else None
        return own if own is not None else \
            prefill_ladder(max_tokens if max_tokens is not None else 2048)
    ladder = check_ladder(buckets)
    if max_tokens is not None and as_int(max_tokens, "max_tokens") != ladder[-1]:
        raise ValueError(f"max_tokens={max_tokens} differs from the largest bucket "
                         f"{ladder[-1]}: give one of them, or make them agree")
    return ladder


def _inputs(model, kind: str, strategy: str, attention, slots: int, check: bool,
            example=None) -> Inputs:
    device = _device_of(model, example)
    rows = output_rows(model, kind)
    if kind == "tensors":
        held = next(model.parameters(), None) is not None or \
            next(model.buffers(), None) is not None
        return TensorInputs(device, captured=strategy != "eager",
                            placed=held or example is not None)
    backend = backend_for(model, attention, device, strategy)
    return PrefillInputs(device, backend, slots, rows, _input_bounds(model) if check else None,
                         name=type(model).__name__)
