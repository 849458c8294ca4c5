"""`kiln bench startup`: where a warm `kiln generate "Hi" --max-tokens 8` spends its time; one
JSON line (each run a fresh process: the first may compile, the last is reported).
"""
import argparse
from dataclasses import fields

from kiln.engine.arg_utils import EngineArgs


def register_bench(kinds) -> None:
    parser = kinds.add_parser(
        "startup", help="start-up time of a one-prompt generate, phase by phase",
        description="Run `generate PROMPT --max-tokens N` in fresh processes and print the last "
                    "run's phases (imports, config, tokenizer, core start, model load, KV "
                    "cache, compile / warm-up, generation, shutdown) as JSON.")
    parser.add_argument("--prompt", default="Hi", help="the prompt each run completes")
    parser.add_argument("--max-tokens", type=int, default=8, help="tokens each run generates")
    parser.add_argument("--runs", type=int, default=2,
                        help="processes to start one after another (the first warms caches)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds each process may take (default: no limit)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.child import check_timeout, print_report
    from kiln.benchmarks.startup import run_startup_bench

    if args.runs < 1 or args.max_tokens < 1:
        raise ValueError("--runs and --max-tokens must be >= 1")
    check_timeout(args.timeout)
    engine_args = EngineArgs.from_cli_args(args)
    default = EngineArgs()
    kwargs = {f.name: getattr(engine_args, f.name) for f in fields(EngineArgs)
              if getattr(engine_args, f.name) != getattr(default, f.name)}
    return print_report(lambda: run_startup_bench(kwargs, args.prompt, args.max_tokens, args.runs,
                                                  args.timeout))
