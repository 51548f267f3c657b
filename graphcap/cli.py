"""The ``graphcap`` command line.

Exit status: 0 when the command did its job; 1 when a check ran and failed (demo's or
check's replays differ from eager, a benchmark missed its targets); 2 for an error of the
user's making (an argument, their module or factory, a device this machine lacks), told
in one line on stderr; 3 for an unexpected exception inside graphcap, its traceback on
stderr (as pytest's internal error), so that a crash never reads as a failed check.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import re
import sys
import traceback

import torch

from graphcap import cli_types as arg
from graphcap.errors import GraphcapError


def _demo(args: argparse.Namespace) -> int:
    from graphcap.demo import run_demo

    missing = _no_cuda() if args.device == "cuda" else None
    if missing:
        raise GraphcapError(f"--device cuda, but {missing}: run graphcap demo --device cpu "
                            "(or leave --device out to use what is here)")
    return run_demo(device=args.device, steps=args.steps)


def _ops(args: argparse.Namespace) -> int:
    import graphcap.opsdb  # noqa: F401  (registers the built-in ops)
    from graphcap.opsdb.listing import render

    missing = _no_cuda() if args.device and args.device.startswith("cuda") else None
    index = torch.device(args.device).index if args.device and not missing else None
    if index is not None and args.device.startswith("cuda") and \
            index >= torch.cuda.device_count():
        missing = f"this machine has {torch.cuda.device_count()} CUDA GPU(s)"
    if missing:
        raise GraphcapError(f"--device {args.device}, but {missing}: what runs here is "
                            "graphcap ops --device cpu (or leave --device out)")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(render(device, as_json=args.json))
    return 0


def _bench(args: argparse.Namespace) -> int:
    _check_bench_args(args)
    missing = _no_cuda()
    if missing:
        raise GraphcapError(f"needs a CUDA GPU (benchmarks time real kernels), but {missing}")
    gpus = torch.cuda.device_count()
    if args.tp > gpus:
        raise GraphcapError(f"--tp {args.tp}: {gpus} GPU{'s' * (gpus != 1)} here, {args.tp} "
                            "needed (one per rank)")
    if args.suite == "ops":
        from graphcap.bench.ops import run

        return 0 if all(t["met"] for t in run(args.out)["targets"]) else 1
    from graphcap.bench.suites import run_suite

    return run_suite(args)


def _generate(args: argparse.Namespace) -> int:
    from graphcap.engine.llm import LLM
    from graphcap.inputs.sampling import Sampling

    try:
        sampling = Sampling(temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    except ValueError as exc:  # named as the flag that gave it (Sampling.top_p: --top-p)
        raise GraphcapError(re.sub(r"Sampling\.(\w+)", lambda m: "--" + m[1].replace(
            "_", "-"), str(exc))) from exc
    try:
        llm = LLM(args.checkpoint, strategy=args.strategy, max_batch=args.max_batch,
                  max_len=args.max_len, prefill_tokens=args.prefill_tokens,
                  progress=sys.stderr.isatty())
    except (ValueError, OSError, GraphcapError) as exc:  # the directory, its files, an
        # option's value, a K/V cache past the device's memory (CacheTooLarge)
        raise GraphcapError(_as_flags(str(exc))) from exc
    if llm.tokenizer is None:
        raise GraphcapError(f"{args.checkpoint} has no tokenizer files: graphcap generate "
                            "takes text prompts (graphcap.LLM takes token ids)")
    options = dict(sampling=sampling, stop=args.stop or None)
    try:
        if len(args.prompt) == 1:  # one prompt: its text as it is drawn
            for delta in llm.stream(args.prompt, args.max_new_tokens, **options):
                print(delta.text, end="", flush=True)
            print()
        else:
            for done in llm.generate(args.prompt, args.max_new_tokens, **options):
                print(f"[{done.index}] {done.text}")
    except ValueError as exc:  # a prompt too long for --max-len, say
        raise GraphcapError(_as_flags(str(exc))) from exc
    return 0


def _as_flags(message: str) -> str:
    """An error of graphcap.LLM with its options named as generate's flags (max_len:
    --max-len), which are what a user of the command changes."""
    return re.sub(r"\b(max_len|max_batch|prefill_tokens)\b",
                  lambda m: "--" + m[1].replace("_", "-"), message)


# The options of bench, their defaults, and which each suite reads (another given is an
# error, not ignored).
BENCH_DEFAULTS = {"models": None, "arms": None, "lengths": None, "reps": None,
                  "batches": None, "context": None, "window": 0, "attention": None,
                  "speculative": 0, "max_len": None}
BENCH_READS = {"ops": set(), "decode": {"models", "arms", "batches", "context", "window",
                                        "reps", "speculative", "max_len"},
               "prefill": {"models", "arms", "lengths", "reps", "attention"},
               "generate": {"models", "arms", "reps"},
               "build": {"models", "arms", "attention"}, "memory": {"models", "arms",
                                                                    "attention"}}


def _check_bench_args(args: argparse.Namespace) -> None:
    """The presets, arms and --tp given are ones the suite runs (checked before anything
    runs: a wrong name would otherwise surface after minutes of other arms, or need a GPU)."""
    from graphcap.bench import decode, generate, ladder, prefill
    from graphcap.bench.arms import ARMS
    from graphcap.bench.common import check_out
    from graphcap.bench.hf import HF_ARMS, unmirrored
    from graphcap.bench.suites import check_preset
    from graphcap.models import PRESETS

    if args.tp > 1 and args.suite != "prefill":
        raise GraphcapError(f"--tp {args.tp}: only bench prefill splits a model across GPUs")
    unused = [f"--{o.replace('_', '-')}" for o, default in BENCH_DEFAULTS.items()
              if getattr(args, o) != default and o not in BENCH_READS[args.suite]]
    if unused:
        raise GraphcapError(f"bench {args.suite} does not take {', '.join(unused)}: leave "
                            f"{'it' if len(unused) == 1 else 'them'} out")
    check_out(args.out)  # where the result goes, before the minutes that make it
    if args.suite == "ops":
        return
    ladders = args.suite in ("build", "memory")  # one model, perhaps a stock transformers one
    kinds = ("", "hf", "hf-stock") if ladders else ("",)
    models = args.models.split(",") if args.models is not None else []
    for option, items in (("models", models), ("arms", (args.arms or "").split(","))):
        if getattr(args, option) is not None and "" in items:  # '', 'a,', 'a,,b': not every
            raise GraphcapError(f"--{option} {getattr(args, option)!r} names nothing between "
                                f"its commas: give names, or leave --{option} out for the "
                                "suite's default")
        if (twice := arg.repeated(items)) is not None:
            raise GraphcapError(f"--{option}: {twice!r} is given twice (its runs would "
                                "overwrite each other's under one name); give each once")
    for name in models:
        kind, colon, preset = name.rpartition(":")
        if kind not in kinds or (colon and not kind) or preset not in PRESETS:
            forms = ", or hf:PRESET or hf-stock:PRESET" if ladders else ""
            raise GraphcapError(f"--models: no preset {name!r} for bench {args.suite}; choose "
                                f"from {', '.join(sorted(PRESETS))}{forms}")
        if kind and (why := unmirrored(preset)):  # the stock model would be another one
            raise GraphcapError(f"--models {name}: {why}")
    if ladders and len(models) > 1:
        raise GraphcapError(f"--models: bench {args.suite} runs one model, not {len(models)}; "
                            "run it once per model")
    if args.speculative and (args.context is not None or args.window or args.max_len):
        raise GraphcapError("bench decode --speculative generates from prompts of its own "
                            "length: leave out --context, --window and --max-len")
    for name in models or (prefill.MODELS if args.suite == "prefill" else ["qwen3-0.6b"]):
        check_preset(args, name.rpartition(":")[2])  # hf:PRESET: the stock model of its config
    arms = {"decode": decode.ARMS, "prefill": ARMS + HF_ARMS, "build": ladder.BUILD_ARMS,
            "memory": ladder.MEMORY_ARMS, "generate": generate.STRATEGIES}[args.suite]
    if args.speculative:
        from graphcap.bench import speculative

        arms = speculative.ARMS
    for arm in args.arms.split(",") if args.arms else []:
        if arm not in arms:
            raise GraphcapError(f"--arms: no arm {arm!r} in bench {args.suite}; choose from "
                                f"{', '.join(arms)}")
        if args.tp > 1 and arm in HF_ARMS:  # it would run unsplit only: nothing to compare
            raise GraphcapError(f"--arms {arm} with --tp {args.tp}: a stock transformers "
                                "model is not split across ranks; leave its arms out")


def _no_cuda() -> str | None:
    """Why this process cannot use a CUDA GPU, or None."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"torch {torch.__version__} here is a build without CUDA"
    return f"torch {torch.__version__} here sees no CUDA GPU"


def _check(args: argparse.Namespace) -> int:
    from graphcap.check import run_check

    if args.strategies and (twice := arg.repeated(args.strategies)) is not None:
        raise GraphcapError(f"--strategies: {twice} is given twice (it would be checked "
                            "twice, a row each); give each once")
    return run_check(args.factory, args.strategies, args.examples, args.sequences,
                     args.max_tokens, args.max_requests, args.attention)


def version() -> str:
    """``graphcap X, torch Y``: X the installed distribution's version (``torch-graphcap``),
    or the source tree's when graphcap runs from a checkout that is not installed."""
    try:
        ours = importlib.metadata.version("torch-graphcap")
    except importlib.metadata.PackageNotFoundError:
        import graphcap

        ours = f"{graphcap.__version__} (source tree, not installed)"
    return f"graphcap {ours}, torch {torch.__version__}"


class _Parser(argparse.ArgumentParser):
    """Tells a refused argument in one line, with where to look, and exits 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


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
    parser = _Parser(
        prog="graphcap", description="CUDA graphs for LLM prefill and launch-bound forwards.")
    parser.add_argument("--version", action="version", version=version())
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", formatter_class=defaults,
                          help="capture a small model, replay it, check it against eager")
    demo.add_argument("--device", default=None, choices=["cuda", "cpu"],
                      help="where to run (default: cuda if present)")
    demo.add_argument("--steps", type=arg.positive, default=5,
                      help="replays with fresh inputs (the strategies table checks up to 5 "
                           "batches each)")
    demo.set_defaults(func=_demo)
    ops = sub.add_parser("ops", formatter_class=defaults,
                         help="the op registry and the attention backends: what runs here")
    ops.add_argument("--device", default=None, type=arg.device,
                     help="device to check kernels for (default: cuda if present)")
    ops.add_argument("--json", action="store_true", help="machine-readable output")
    ops.set_defaults(func=_ops)
    check = sub.add_parser("check", formatter_class=defaults,
                           help="replay equivalence of your model under every strategy")
    check.add_argument("factory", help="MODULE:FUNCTION returning the model")
    check.add_argument("--strategies", nargs="+", default=None, choices=GRAPHED, type=arg.strategy,
                       help="the strategies to check (default: every one the attention "
                            "backend runs under)")
    check.add_argument("--examples", type=arg.positive, default=10, help="batches per strategy")
    check.add_argument("--sequences", type=arg.positive, default=3, help="call sequences")
    check.add_argument("--max-tokens", type=arg.positive, default=64, help="the largest bucket")
    check.add_argument("--max-requests", type=arg.positive, default=4, help="request slots")
    check.add_argument("--attention", default=None, choices=sorted(BACKENDS),
                       help="attention backend (default: the best for full capture here)")
    check.set_defaults(func=_check)
    gen = sub.add_parser("generate", formatter_class=defaults,
                         help="text from a local Hugging Face checkpoint, on graphcap.LLM")
    gen.add_argument("checkpoint", help="a checkpoint directory (config, safetensors, "
                     "tokenizer files; nothing is downloaded)")
    gen.add_argument("--prompt", action="append", required=True,
                     help="a prompt (repeat for several: decoded together)")
    gen.add_argument("--max-new-tokens", type=arg.positive, default=64, help="per prompt")
    gen.add_argument("--strategy", default="full", choices=("eager",) + tuple(GRAPHED),
                     help="how prefill and decode steps run (eager: no graphs)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0: every token")
    gen.add_argument("--top-p", type=float, default=1.0, help="1: every token")
    gen.add_argument("--seed", type=int, default=0, help="of the draws")
    gen.add_argument("--stop", action="append", default=None,
                     help="a string that ends a prompt's text (repeat for several)")
    gen.add_argument("--max-batch", type=arg.positive, default=8, help="prompts decoded together")
    gen.add_argument("--max-len", type=arg.positive, default=None,
                     help="tokens per prompt, its own and new (default: the model's, at "
                          "most 4096)")
    gen.add_argument("--prefill-tokens", type=arg.positive, default=512,
                     help="the largest prefill graph (longer prompts: in chunks)")
    gen.set_defaults(func=_generate)
    bench = sub.add_parser("bench", formatter_class=defaults,
                           help="GPU benchmarks, written as JSON")
    bench.add_argument("suite", choices=["ops", "prefill", "decode", "generate", "build",
                                         "memory"],
                       help="ops: kernels; prefill: speed per prompt length and arm; "
                            "decode: a decode step per batch size and arm; generate: graphcap.LLM "
                            "end to end against its decode step; build: capture "
                            "time of the 42-shape ladder; memory: graph memory")
    bench.add_argument("--out", default=None, help="JSON file to write (a PNG plot of "
                       "prefill goes beside it; default: a dated name here)")
    bench.add_argument("--models", default=None,
                       help="comma-separated presets, of " + ", ".join(sorted(PRESETS))
                            + " (prefill default: qwen3-0.6b,llama3-8b,qwen3-30b-a3b-4l; "
                            "decode, build, memory: qwen3-0.6b; build and memory take one, "
                            "or hf:PRESET, hf-stock:PRESET for the stock transformers model)")
    bench.add_argument("--arms", default=None,
                       help="comma-separated arms (prefill default: every arm on the "
                            "preset; hf-eager, hf-compile-reduce-overhead and "
                            "hf-{breakable,full,tc_piecewise}-{stock,graphcap} add the stock "
                            "transformers model of the preset's config)")
    bench.add_argument("--lengths", default=None, type=arg.positives,
                       help="comma-separated prompt lengths (default 16..2048)")
    bench.add_argument("--reps", type=arg.positive, default=None,
                       help="timed calls per arm and length, spread over the rounds of "
                            "the timing (a multiple of them, one a round at least; "
                            "default 30, generate and decode --speculative 3); decode's "
                            "back-to-back runs and host times keep their own counts")
    bench.add_argument("--batches", default=None, type=arg.positives,
                       help="decode: comma-separated batch sizes (default 1,8)")
    bench.add_argument("--context", type=arg.positives, default=None,
                       help="decode: tokens in the cache of every request, comma-separated "
                            "for several contexts (default 128)")
    bench.add_argument("--window", type=arg.window, default=0,
                       help="decode: a sliding window of this many tokens on every layer "
                            "(its step reads only the window's K/V; 0: none)")
    bench.add_argument("--max-len", type=arg.positive, default=None,
                       help="decode: the tokens a request's block table (and the gpt-fast "
                            "peer's static cache) holds, as an engine's max_len (default: "
                            "each context + 1)")
    bench.add_argument("--speculative", type=arg.positive, default=0, metavar="K",
                       help="decode: speculative decoding with K proposals a step, each "
                            "proposer (target, random, ngram: --arms) beside plain decode, "
                            "end to end (default batches 1,8,64)")
    bench.add_argument("--tp", type=arg.positive, default=1,
                       help="prefill: split each preset across this many GPUs (one process "
                            "each, NCCL) and time it beside the unsplit run")
    bench.add_argument("--attention", default=None, choices=sorted(BACKENDS),
                       help="attention backend of the arms that do not name one (eager, "
                            "breakable, tc_piecewise, the peers; default: the best for full)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status (the module's docstring says which)."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except GraphcapError as exc:  # graphcap's own errors name what was wrong and what to do
        print(f"graphcap {args.command}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader stopped (graphcap ops | head): nothing to tell
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit's flush does not raise again
        return 0
    except Exception:  # a crash: its whole traceback, and not 1 (a check that failed)
        traceback.print_exc()
        print(f"graphcap {args.command}: an unexpected error inside graphcap (its traceback "
              "is above): exit status 3", file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())
