"""The ``graphcap`` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from graphcap.demo import run_demo

    return run_demo(device=args.device, steps=args.steps)


def _ops(args: argparse.Namespace) -> int:
    import torch

    import graphcap.opsdb  # noqa: F401  (registers the built-in ops)
    from graphcap.opsdb.listing import render

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(render(device, as_json=args.json))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("graphcap bench needs a CUDA GPU (benchmarks time real kernels)", file=sys.stderr)
        return 2
    if args.suite == "ops":
        from graphcap.bench.ops import run

        run(args.out)
        return 0
    from graphcap.bench.suites import run_suite

    return run_suite(args)


def _check(args: argparse.Namespace) -> int:
    from graphcap.check import run_check
    from graphcap.errors import GraphcapError

    try:
        return run_check(args.factory, args.strategies, args.examples, args.sequences,
                         args.max_tokens, args.max_requests, args.attention)
    except GraphcapError as exc:
        print(f"graphcap check: {exc}", file=sys.stderr)
        return 2


class _Defaults(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, unless its help says it already."""

    def _get_help_string(self, action):
        if action.default is None or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from graphcap.api import GRAPHED
    from graphcap.models import PRESETS
    from graphcap.opsdb.attention import BACKENDS

    defaults = _Defaults
    parser = argparse.ArgumentParser(
        prog="graphcap", description="CUDA graphs for LLM prefill and launch-bound forwards.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=defaults,
                          help="capture a small model, replay it, check it against eager")
    demo.add_argument("--device", default=None, choices=["cuda", "cpu"],
                      help="where to run (default: cuda if present)")
    demo.add_argument("--steps", type=int, default=5, help="replays with fresh inputs")
    demo.set_defaults(func=_demo)
    ops = sub.add_parser("ops", formatter_class=defaults,
                         help="the op registry and the attention backends: what runs here")
    ops.add_argument("--device", default=None, help="device to check kernels for "
                     "(default: cuda if present)")
    ops.add_argument("--json", action="store_true", help="machine-readable output")
    ops.set_defaults(func=_ops)
    check = sub.add_parser("check", formatter_class=defaults,
                           help="replay equivalence of your model under every strategy")
    check.add_argument("factory", help="MODULE:FUNCTION returning the model")
    check.add_argument("--strategies", nargs="+", default=list(GRAPHED), choices=GRAPHED,
                       help="the strategies to check")
    check.add_argument("--examples", type=int, default=10, help="batches per strategy")
    check.add_argument("--sequences", type=int, default=3, help="call sequences")
    check.add_argument("--max-tokens", type=int, default=64, help="the largest bucket")
    check.add_argument("--max-requests", type=int, default=4, help="request slots")
    check.add_argument("--attention", default=None, choices=sorted(BACKENDS),
                       help="attention backend (default: the best for full capture here)")
    check.set_defaults(func=_check)
    bench = sub.add_parser("bench", formatter_class=defaults,
                           help="GPU benchmarks, written as JSON")
    bench.add_argument("suite", choices=["ops", "prefill", "decode", "build", "memory"],
                       help="ops: kernels; prefill: speed per prompt length and arm; "
                            "decode: a decode step per batch size and arm; build: capture "
                            "time of the 42-shape ladder; memory: graph memory")
    bench.add_argument("--out", default=None, help="JSON file to write (a PNG plot of "
                       "prefill goes beside it; default: a dated name here)")
    bench.add_argument("--models", default=None,
                       help="comma-separated presets, of " + ", ".join(sorted(PRESETS))
                            + " (prefill default: qwen3-0.6b,llama3-8b,qwen3-30b-a3b-4l; "
                            "decode, build, memory: qwen3-0.6b)")
    bench.add_argument("--arms", default=None,
                       help="comma-separated arms (prefill default: every arm on the "
                            "preset; hf-eager, hf-compile-reduce-overhead and "
                            "hf-{breakable,full,tc_piecewise}-{stock,graphcap} add the stock "
                            "transformers model of the preset's config)")
    bench.add_argument("--lengths", default=None,
                       help="comma-separated prompt lengths (default 16..2048)")
    bench.add_argument("--reps", type=int, default=30, help="timed calls per arm and length")
    bench.add_argument("--batches", default=None,
                       help="decode: comma-separated batch sizes (default 1,8)")
    bench.add_argument("--context", type=int, default=128,
                       help="decode: tokens in the cache of every request")
    bench.add_argument("--tp", type=int, default=1,
                       help="prefill: split each preset across this many GPUs (one process "
                            "each, NCCL) and time it beside the unsplit run")
    bench.add_argument("--attention", default=None, choices=sorted(BACKENDS),
                       help="attention backend of the arms that do not name one (eager, "
                            "breakable, tc_piecewise, the peers; default: the best for full)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
