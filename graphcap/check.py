"""``graphcap check MODULE:FACTORY``: a user's model under every strategy against eager."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import time
import traceback

import torch

from graphcap.api import GRAPHED
from graphcap.core.inputs import NO_ATTENTION
from graphcap.errors import GraphcapError, UnsupportedModel


def load_factory(spec: str):
    """``"package.module:function"`` -> the callable, with clear errors: whatever the
    user's module raises on import (an exit too) is a :class:`GraphcapError` naming it."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise GraphcapError(f"{spec!r}: give the factory as MODULE:FUNCTION, e.g. "
                            "mypkg.models:build")
    if "/" in module_name or os.sep in module_name or module_name.startswith("."):
        raise GraphcapError(_a_path(module_name, attr))  # import takes no path
    sys.path.insert(0, ".")  # a module in the working directory, like python -m
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if module_name.endswith(".py"):  # a file's name, not a module "py" of a package
            raise GraphcapError(_a_path(module_name, attr)) from exc
        raise GraphcapError(f"cannot import {module_name!r} (from {spec!r}): {exc}") from exc
    except (Exception, SystemExit) as exc:  # the user's module failed, not graphcap
        raise GraphcapError(f"importing {module_name!r} (from {spec!r}) {_failed(exc)}; "
                            f"python -c 'import {module_name}' shows the traceback") from exc
    finally:
        sys.path.remove(".")
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise GraphcapError(f"{module_name!r} has no callable {attr!r} (from {spec!r})")
    return factory


def _a_path(module_name: str, attr: str) -> str:
    """What to give instead of a file's path: the module's dotted name."""
    path = module_name.removesuffix(".py").replace(os.sep, "/")
    parts = [p for p in path.split("/") if p.strip(".")]
    dotted = parts[-1] if os.path.isabs(path) else ".".join(parts).lstrip(".")
    return (f"{module_name!r} is a file's path, not a module's name: give {dotted}:{attr}, "
            "from the directory it imports from (as python -m takes a module)")


def model_from(factory, spec: str):
    """What ``factory()`` returns. A factory that needs arguments is refused before it is
    called; one that raises or exits is a :class:`GraphcapError` saying so and where."""
    if isinstance(factory, torch.nn.Module):  # callable, but calling it runs its forward
        module, _, name = spec.partition(":")
        raise GraphcapError(f"{spec!r} is a {type(factory).__name__} (a model), not a "
                            "function that returns one: graphcap check builds the model "
                            f"by calling MODULE:FUNCTION; add def build(): return {name} "
                            f"to {module} and give {module}:build")
    needed = _required_parameters(factory)
    if needed:
        raise GraphcapError(f"the factory {spec!r} takes arguments {needed}; graphcap check "
                            "calls it with no arguments: give it a function of no arguments "
                            "that returns the model")
    try:
        return factory()
    except (Exception, SystemExit) as exc:  # the user's factory failed, not graphcap
        raise GraphcapError(f"the factory {spec!r} {_failed(exc)}") from exc


def _required_parameters(factory) -> list[str]:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read (a builtin): call it and see
        return []
    return [p.name for p in params if p.default is p.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _failed(exc: BaseException) -> str:
    """What the user's code did, in one line: raised what, and the line that raised it."""
    if isinstance(exc, SystemExit):
        return f"exited (SystemExit({exc.code!r})) instead of returning: nothing was checked"
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    message = str(exc).strip().splitlines()
    return f"raised {type(exc).__name__}" + (f": {message[0]}" if message else "") + where


def _from_the_model(exc: BaseException) -> bool:
    """Whether the innermost frame that raised, torch's own left out, is outside
    graphcap: the model's code (or a library it calls), not graphcap's."""
    frames = [f.filename for f in traceback.extract_tb(exc.__traceback__)]
    torch_dir = os.path.dirname(torch.__file__)
    ours = [f for f in frames if not f.startswith(torch_dir)]
    return bool(ours) and not ours[-1].startswith(_PACKAGE + os.sep)


_PACKAGE = os.path.dirname(os.path.abspath(__file__))


def checkable(model) -> tuple:
    """The model ``check`` runs, and how it got it: a model of packed requests as it is,
    a stock transformers causal LM wrapped in :class:`graphcap.hf.PrefillLM`; anything
    else is refused, saying what a checkable model is."""
    from graphcap.api import inputs_of, output_rows

    if not isinstance(model, torch.nn.Module):
        raise GraphcapError(f"the factory returned {_what_to_return(model)}")
    meta = next((n for n, t in [*model.named_parameters(), *model.named_buffers()]
                 if t.is_meta), None)
    if meta is not None:  # no values to run: every strategy would FAIL on the device
        raise GraphcapError(f"the factory returned a {type(model).__name__} whose {meta} is "
                            "on the meta device (no values): load or initialise its weights "
                            "on cpu or cuda before returning it")
    if _is_causal_lm(model):
        from graphcap.hf import PrefillLM

        name, lm = type(model).__name__, PrefillLM(model)
        return lm, (f" (a transformers {name}, wrapped in graphcap.hf.PrefillLM; "
                    f"{lm.kernels.summary()})")
    if inputs_of(model) != "prefill":
        params = list(inspect.signature(model.forward).parameters)
        raise GraphcapError(
            f"{type(model).__name__}.forward{tuple(params)} is no model of packed requests: "
            "graphcap check runs forward(input_ids, positions) over requests packed along "
            "dim 0 (declare it with graphcap_inputs = 'prefill' on the class, or name its "
            "first parameters input_ids, positions), or a transformers causal LM, which it "
            "wraps. A module of tensors along dim 0 is checked with graphcap.capture(model, "
            "strategy, example_inputs=...) against its eager calls")
    output_rows(model, "prefill")  # a misdeclared one: an error, not a FAIL per strategy
    return model, ""


def _what_to_return(value) -> str:
    """What a factory returned that is no model, and what it should return instead."""
    if value is None:
        return "None, not a torch.nn.Module: end it with return model"
    kind = type(value).__name__
    items = list(value.values()) if isinstance(value, dict) else value \
        if isinstance(value, (tuple, list)) else []
    inside = [type(v).__name__ for v in items if isinstance(v, torch.nn.Module)]
    if inside:  # (model, tokenizer), say: the model alone
        return (f"a {kind} holding a {inside[0]}, not a torch.nn.Module: return the "
                f"{inside[0]} alone")
    article = "an" if kind[0].lower() in "aeiou" else "a"
    return f"{article} {kind}, not a torch.nn.Module: return the model"


def _is_causal_lm(model) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and model.get_output_embeddings() is not None


def run_check(spec: str, strategies=None, examples: int = 10, sequences: int = 3,
              max_tokens: int = 64, max_requests: int = 4, attention: str | None = None
              ) -> int:
    """Print one row per strategy (``strategies``, default every one ``attention`` runs
    under); 0 when every strategy matches eager, else 1."""
    chosen = strategies is not None
    strategies = list(strategies) if chosen else list(GRAPHED)
    try:  # a test extra, not a dependency: else a traceback, as if graphcap had failed
        import hypothesis  # noqa: F401
    except ImportError:
        raise GraphcapError("graphcap check draws its batches with hypothesis, which is not "
                            "installed here: pip install hypothesis (or "
                            "torch-graphcap[test])") from None
    from graphcap.testing import assert_replay_equivalent
    from graphcap.testing.replay import eager_copy

    model, wrapped = checkable(model_from(load_factory(spec), spec))
    if attention is not None:  # a backend this machine cannot run: one error, not a row each
        from graphcap.errors import BackendUnavailable
        from graphcap.opsdb.attention import BACKENDS, get_backend

        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        try:
            backend = get_backend(attention, device)
        except BackendUnavailable as exc:
            here = sorted(n for n, cls in BACKENDS.items() if not cls().unavailable(device))
            raise BackendUnavailable(f"--attention {attention}: {exc}; on {device.type} "
                                     f"choose one of {here}, or leave --attention out (the "
                                     "best here)") from None
        left = [s for s in strategies if not backend.runs_under(s)]
        if left and chosen:  # asked for one it cannot run under: a bad pair
            try:
                backend.check_strategy(left[0])
            except GraphcapError as exc:
                raise type(exc)(f"--attention {attention} with strategy {left[0]}: "
                                f"{exc}") from None
        strategies = [s for s in strategies if s not in left]
        if left:
            print(f"--attention {attention} runs under {', '.join(strategies)} only: "
                  f"{', '.join(left)} left out")
    from graphcap.api import _device_of
    from graphcap.core.buckets import prefill_ladder
    from graphcap.core.graphs import graph_kind
    from graphcap.testing.replay import request_room

    try:  # a ladder of too many shapes to build, a model of few positions (requests
        # long enough to fill --max-tokens): in one line, as the other refusals
        prefill_ladder(max_tokens, "--max-tokens", "a smaller --max-tokens")
        request_room(model, max_tokens, max_requests, ("--max-tokens", "--max-requests"))
    except ValueError as exc:
        raise GraphcapError(str(exc)) from None

    device = _device_of(model)  # where it runs, on which graphs: a CPU model, emulated ones
    print(f"graphcap check {spec}: {type(model).__name__}{wrapped} on {device} "
          f"({graph_kind(device)} graphs), {examples} drawn "
          f"batches, the fullest batch, each bucket's most padded and full batches and "
          f"{sequences} call sequences per strategy, buckets to {max_tokens} tokens\n")
    print(f"{'strategy':>12}  {'attention':>12}  {'result':>6}  {'max err':>9}  "
          f"{'fallbacks':>9}  {'build s':>7}")
    failed = []
    reference = eager_copy(model)  # before any strategy captures: the same for each
    for strategy in strategies:
        start = time.perf_counter()
        try:
            report = assert_replay_equivalent(
                model, (strategy,), max_tokens=max_tokens, max_requests=max_requests,
                attention=attention, examples=examples, sequences=sequences,
                reference=reference)[strategy]
        except Exception as exc:
            if not isinstance(exc, (AssertionError, GraphcapError)):
                if not _from_the_model(exc):
                    raise  # graphcap's own failure: its traceback says where
                exc = GraphcapError(f"{type(model).__name__}'s forward {_failed(exc)}")
            failed.append((strategy, exc))
            print(f"{strategy:>12}  {attention or '-':>12}  {'FAIL':>6}  {'-':>9}  {'-':>9}  "
                  f"{time.perf_counter() - start:>7.2f}")
            continue
        print(f"{strategy:>12}  {report['attention'] or 'none':>12}  {'pass':>6}  "
              f"{report['max_error']:>9.2e}  {sum(report['fallbacks'].values()):>9}  "
              f"{report['build_wall_s']:>7.2f}")
    for strategy, exc in failed:
        first = str(exc).strip().splitlines()[0]
        print(f"\n{strategy}: {first}")
    if any(isinstance(exc, UnsupportedModel) and NO_ATTENTION in str(exc) for _, exc in failed):
        print("\nA model that runs no graphcap attention takes one request a call: check it "
              "with --max-requests 1.")
    if any(isinstance(exc, AssertionError) for _, exc in failed):
        print("\nReplays differ from eager: Python in forward (a side effect, a counter, a "
              "host value read from a tensor) runs only at capture and is frozen there: "
              "move it out of forward, or mark the function @graphcap.eager_on_graph and "
              "use strategy='breakable'. Or its rows depend on other rows (a reduction over "
              "every token, the token count): a replay pads the batch to its bucket, so "
              "each output row must depend on its own request's tokens only. Or it is "
              "nondeterministic (random ops): eager differs from eager.")
        dropout = [n for n, m in model.named_modules() if m.training and isinstance(
            m, torch.nn.modules.dropout._DropoutNd) and m.p > 0]
        if dropout:  # it draws anew on each call, eager's and a fallback's too
            print(f"\nIts dropout {dropout[0] or 'itself'} is in training mode: return the "
                  "model from the factory in eval mode (model.eval()).")
    return 1 if failed else 0
