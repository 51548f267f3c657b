"""``graphcap bench prefill|decode|generate|build|memory`` from the command line: run, show,
write."""

from __future__ import annotations

import argparse
from pathlib import Path


def check_preset(args: argparse.Namespace, name: str) -> None:
    """The preset ``name`` runs as ``args`` ask, checked before anything runs (else it
    fails mid-run, after minutes of the other arms and models): it has the positions the
    suite writes, and ``--tp`` splits it into whole heads and columns."""
    from graphcap.bench import decode, generate, prefill
    from graphcap.errors import GraphcapError
    from graphcap.models import PRESETS
    from graphcap.models.decoder import shard_args

    positions = PRESETS[name].max_position
    if args.suite == "decode" and not args.speculative:
        context = max(map(int, (args.context or str(decode.CONTEXT)).split(",")))
        if context >= positions:
            raise GraphcapError(
                f"--context {context}: {name} has {positions} positions, and a step after "
                f"{context} tokens writes position {context}; give contexts below {positions}")
        if args.max_len is not None and not context < args.max_len <= positions:
            raise GraphcapError(
                f"--max-len {args.max_len}: a request's table holds its context and the "
                f"step's token ({context + 1} for --context {context}) and at most {name}'s "
                f"{positions} positions; give a --max-len from {context + 1} to {positions}")
    if args.suite == "prefill":
        longest = max(map(int, args.lengths.split(","))) if args.lengths else \
            max(prefill.LENGTHS)
        if longest > positions:
            raise GraphcapError(
                f"--lengths {longest}: {name} has {positions} positions, and a "
                f"{longest}-token prompt writes positions 0 to {longest - 1}; give lengths "
                f"of at most {positions}")
    if args.suite == "generate":
        needed = generate.LONG[0] + generate.LONG_NEW
        if needed > positions:
            raise GraphcapError(
                f"--models {name}: {name} has {positions} positions, and bench generate "
                f"prefills a {generate.LONG[0]}-token prompt and draws {generate.LONG_NEW} "
                f"tokens after it ({needed} positions); choose presets of {needed} or more")
    if getattr(args, "tp", 1) > 1:  # the split run comes after the whole unsplit one
        try:
            shard_args(PRESETS[name], args.tp)
        except GraphcapError as exc:
            raise GraphcapError(f"--tp {args.tp} --models {name}: {exc}") from None


def _csv(text: str | None, default, convert=str) -> tuple:
    return tuple(convert(x) for x in text.split(",")) if text else tuple(default)


def _judged(result: dict, out: str | None, name: str) -> int:
    """Each model's targets shown, the result written (a dated ``name`` by default): the
    exit status, 1 where a target was missed."""
    from graphcap.bench.common import today, write_result
    from graphcap.bench.report import show_targets

    for model in result["models"]:
        show_targets(model["targets"])
    path = write_result(result, out, f"{today()}-{name}.json")
    print(f"wrote {path}")
    return 0 if all(t["met"] for m in result["models"] for t in m["targets"]) else 1


def run_suite(args: argparse.Namespace) -> int:
    from graphcap.bench import ladder, prefill
    from graphcap.bench.arms import ARMS
    from graphcap.bench.common import today, write_result
    from graphcap.bench.report import (
        plot_decode,
        plot_prefill,
        show_decode,
        show_ladder,
        show_prefill,
        show_tp,
    )
    from graphcap.progress import progress

    if args.suite == "decode" and args.speculative:
        from graphcap.bench import speculative

        result = speculative.run(_csv(args.models, ["qwen3-0.6b"]),
                                 _csv(args.arms, speculative.ARMS),
                                 _csv(args.batches, speculative.BATCHES, int),
                                 args.speculative,
                                 reps=args.reps or 3)
        return _judged(result, args.out, "bench-decode-speculative")
    if args.suite == "decode":
        from graphcap.bench import decode

        models = _csv(args.models, ["qwen3-0.6b"])
        arms = _csv(args.arms, decode.ARMS)  # names checked by the command line
        batches = _csv(args.batches, decode.BATCHES, int)
        result = decode.run(models, arms, batches, _csv(args.context, [decode.CONTEXT], int),
                            args.reps or 30, window=args.window, max_len=args.max_len)
        show_decode(result)
        path = write_result(result, args.out, f"{today()}-bench-decode.json", (".png",))
        plot = plot_decode(result, Path(path).with_suffix(".png"))
        print(f"wrote {path}" + (f" and {plot}" if plot else ""))
        return 0 if all(t["met"] for m in result["models"] for t in m["targets"]) else 1
    if args.suite == "generate":
        from graphcap.bench import generate

        result = generate.run(_csv(args.models, ["qwen3-0.6b"]),
                              _csv(args.arms, generate.STRATEGIES),
                              reps=args.reps or 3)
        return _judged(result, args.out, "bench-generate")
    if args.suite == "prefill":
        models = _csv(args.models, prefill.MODELS)
        arms = _csv(args.arms, ARMS)
        lengths = _csv(args.lengths, prefill.LENGTHS, int)
        if getattr(args, "tp", 1) > 1:
            from graphcap.bench import tp

            result = tp.run(models, arms, lengths, args.reps or 30, args.tp, args.attention)
            show_tp(result)
            path = write_result(result, args.out, f"{today()}-bench-prefill-tp{args.tp}.json")
            print(f"wrote {path}")
            return 0 if all(t["met"] for m in result["models"] for t in m["targets"]) else 1
        with progress(len(models) * (len(arms) + prefill.ROUNDS), "prefill") as step:
            result = prefill.run(models, arms, lengths, args.reps or 30, progress=step,
                                 attention=args.attention)
        show_prefill(result)
        path = write_result(result, args.out, f"{today()}-bench-prefill.json", (".png",))
        plot = plot_prefill(result, Path(path).with_suffix(".png"))
    else:
        model = _csv(args.models, ["qwen3-0.6b"])[0]
        suite = ladder.build if args.suite == "build" else ladder.memory
        default = ladder.BUILD_ARMS if args.suite == "build" else ladder.MEMORY_ARMS
        arms = _csv(args.arms, default)
        with progress(len(arms), args.suite) as step:
            result = suite(model, arms, progress=step, attention=args.attention)
        show_ladder(result)
        path = write_result(result, args.out, f"{today()}-bench-{args.suite}.json")
        plot = None
    print(f"wrote {path}" + (f" and {plot}" if plot else ""))
    return 0 if all(t["met"] for t in _targets(result)) else 1


def _targets(result: dict) -> list[dict]:
    if "models" in result:
        return [t for m in result["models"] for t in m["targets"]]
    return result["targets"]
