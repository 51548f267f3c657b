"""The ``graphcap`` command line."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from graphcap.demo import run_demo

    return run_demo(device=args.device, steps=args.steps)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="graphcap", description="CUDA graphs for LLM prefill and launch-bound forwards.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture a small model, replay it, check it against eager")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    demo.add_argument("--steps", type=int, default=5, help="replays with fresh inputs")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
