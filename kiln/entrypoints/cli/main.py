"""The `kiln` command: argparse subcommands, and the one place CLI errors become exit codes.

A subcommand is a module with `register(subparsers)` that sets `func`; add it to SUBCOMMANDS.
"""
import argparse
import importlib
import sys

SUBCOMMANDS = [
    "kiln.entrypoints.cli.generate",
    "kiln.entrypoints.cli.chat",
    "kiln.entrypoints.cli.bench_throughput",
    "kiln.entrypoints.cli.compile",
    "kiln.entrypoints.cli.serve",
]

# A user error (bad flag value, missing file) exits with this code and one line, no traceback.
USAGE_ERROR_EXIT = 2


def build_parser() -> argparse.ArgumentParser:
    from kiln.version import __version__

    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: a torch.compile-centred LLM "
                                     "inference engine with a vLLM-shaped API")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        sys.exit(USAGE_ERROR_EXIT)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(USAGE_ERROR_EXIT)
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(code or 0)


if __name__ == "__main__":
    main()
