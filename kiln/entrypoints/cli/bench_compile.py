"""`kiln bench compile`: cold (empty cache) vs warm (second process) start-up; one JSON line.

Each start is a separate `kiln compile --json` process on a fresh temporary cache directory.
"""
import argparse

from kiln.engine.arg_utils import EngineArgs


def register_bench(kinds) -> None:
    parser = kinds.add_parser(
        "compile", help="cold vs warm compile start-up, each in a fresh process",
        description="Start the engine twice in separate processes on one new, empty compile "
                    "cache directory (cold, then warm) and report start-up time, compile vs "
                    "artifact-load time, Inductor compiles and the warm/cold ratio.")
    parser.add_argument("--keep-cache", action="store_true",
                        help="keep the temporary cache directory (its path is in the report)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds each start-up process may take (default: no limit)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.benchmarks.child import check_timeout, print_report
    from kiln.benchmarks.compile import run_compile_bench

    check_timeout(args.timeout)
    return print_report(lambda: run_compile_bench(EngineArgs.from_cli_args(args),
                                                  args.keep_cache, args.timeout))
