"""The `kiln` command: argparse subcommands, and the one place CLI errors become exit codes.

A subcommand is a module with `register(subparsers)` that sets `func`; add it to SUBCOMMANDS.
"""
import argparse
import importlib
import re
import sys

from kiln import process_signals
from kiln.entrypoints.cli.config_file import flags_from_config_file, option_strings

SUBCOMMANDS = [
    "kiln.entrypoints.cli.generate",
    "kiln.entrypoints.cli.chat",
    "kiln.entrypoints.cli.bench_throughput",
    "kiln.entrypoints.cli.compile",
    "kiln.entrypoints.cli.serve",
]

# A user error (bad flag value, missing file) exits with this code and one line, no traceback.
USAGE_ERROR_EXIT = 2


class HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth saying (not None, not
    an off switch, not one its help already names)."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default == argparse.SUPPRESS
                or not action.option_strings or "default" in text.lower()
                or action.nargs == 0 and not isinstance(action,
                                                        argparse.BooleanOptionalAction)):
            return text
        if isinstance(default, (list, tuple)):
            shown = " ".join(map(str, default))
        else:
            shown = "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


def _subparsers(parser: argparse.ArgumentParser):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield action


def build_parser() -> argparse.ArgumentParser:
    from kiln.version import __version__

    parser = argparse.ArgumentParser(prog="kiln", description="Kiln: a torch.compile-centred LLM "
                                     "inference engine with a vLLM-shaped API")
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(subparsers)
    todo = [parser]
    while todo:
        p = todo.pop()
        p.formatter_class = HelpFormatter
        # A flag's prefix is not that flag: `generate --prompt` took `--prompt-logprobs`, and a
        # new flag would change what an old prefix meant.
        p.allow_abbrev = False
        todo += [sub for action in _subparsers(p) for sub in action.choices.values()]
    return parser


def parse_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """parse_args, but an unknown flag is reported by the subcommand that was given it (its
    usage line, a close match), not by `kiln` itself."""
    args, extras = parser.parse_known_args(argv)
    if not extras:
        return args
    culprit = parser
    for dest in ("command", "bench_command"):
        name = getattr(args, dest, None)
        for action in _subparsers(culprit):
            if action.dest == dest and name in action.choices:
                culprit = action.choices[name]
    message = f"unrecognized arguments: {' '.join(extras)}"
    flags = [a for a in extras if a.startswith("-")]
    if flags:
        import difflib

        close = difflib.get_close_matches(flags[0].split("=")[0],
                                          list(culprit._option_string_actions), n=1, cutoff=0.8)
        if close:
            message += f" (did you mean {close[0]}?)"
    culprit.error(message)


# Commands that build an engine: the core's interpreter starts before their imports (below).
_ENGINE_COMMANDS = ("generate", "chat", "serve")


def _prestart_core(argv: list[str]) -> None:
    """For a command that will build an engine with its core in its own process, start that
    process now: it imports torch and the engine while this one does (the critical path of a
    warm start: about 0.8 s on 2 cores), and waits for the config."""
    from kiln import envs

    if (argv and argv[0] in _ENGINE_COMMANDS and not {"-h", "--help"} & set(argv)
            and envs.enable_multiprocessing()):
        from kiln.engine import core_interpreter

        core_interpreter.prestart()


def _openmp_wait_as_the_core() -> None:
    """This process's OpenMP threads wait as an engine core's do (core_interpreter's
    set_openmp_wait): an engine in this process (`kiln bench throughput` without
    --multiprocess, `bench latency`, KILN_ENABLE_V1_MULTIPROCESSING=0) then runs as `LLM`'s core
    does, not at libgomp's default, whose long spin after every parallel region slowed a
    loaded host's bench rounds (figures in docs/measurements.md). libgomp reads it once, when
    torch loads it: before any import of torch."""
    import os

    if "torch" not in sys.modules:
        from kiln.engine.core_interpreter import set_openmp_wait

        set_openmp_wait(os.environ)


_LEVELS = ("0", "1", "2", "3")


def dotted_flags_as_O(argv: list[str]) -> list[str]:
    """vLLM's --compilation-config.FIELD[=]VALUE and -O.FIELD VALUE as -O.FIELD=VALUE, and its
    optimization levels (-O0..-O3, -O N, -O=N) as --optimization-level=N: a default for the
    mode (-O0 compiles nothing; -O1..-O3 Kiln's piecewise stack: on a CPU vLLM's levels differ
    only in CUDA graphs and GPU fusions, which Kiln applies as the platform allows)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # what follows is positional (a prompt "-O3"), as argparse reads it
            return out + argv[i:]
        level = None
        if arg in ("-O", "--optimization-level") and i + 1 < len(argv):
            level = argv[i + 1]
        elif arg.startswith(("--optimization-level=", "-O=")):
            level = arg.partition("=")[2]
        elif len(arg) == 3 and arg.startswith("-O"):
            level = arg[2]
        if level in _LEVELS:
            out.append(f"--optimization-level={level}")
            i += 2 if arg in ("-O", "--optimization-level") else 1
            continue
        if arg.startswith("--optimization-level"):
            raise ValueError(f"--optimization-level takes 0, 1, 2 or 3 (vLLM's levels), got "
                             f"{level!r}")
        for prefix in ("--compilation-config.", "-O."):
            if arg.startswith(prefix):
                rest = arg[len(prefix):]
                if "=" not in rest and i + 1 < len(argv):
                    i += 1
                    rest += "=" + argv[i]
                arg = "-O." + rest
                break
        out.append(arg)
        i += 1
    return out


def underscored_flags_dashed(argv: list[str]) -> list[str]:
    """vLLM's parser takes a flag with underscores for dashes (--max_model_len=64,
    --compilation_config.pass_config.x): the name before any "=" or "." is dashed; values and
    whatever follows a bare "--" are left alone."""
    out = list(argv)
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg.startswith("--"):
            name = re.match(r"--[^=.]*", arg).group()
            out[i] = "--" + name[2:].replace("_", "-") + arg[len(name):]
    return out


def with_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """An error that opens with a field's name (max_num_seqs must be ...) names the flag for
    it too: max_num_seqs (--max-num-seqs) must be ..."""
    field = re.match(r"[a-z][a-z0-9_]*(?= must )", message)
    if field is None:
        return message
    flag = "--" + field.group().replace("_", "-")
    if flag in message or flag not in option_strings(parser):
        return message
    return f"{field.group()} ({flag}){message[field.end():]}"


def main(argv: list[str] | None = None) -> None:
    # `kiln serve` hands SIGTERM to uvicorn once it serves.
    process_signals.install_terminate()
    parser = None
    try:  # Ctrl-C may come during the imports too: no traceback then either
        argv = underscored_flags_dashed(sys.argv[1:] if argv is None else argv)
        _openmp_wait_as_the_core()
        _prestart_core(argv)
        parser = build_parser()
        argv = dotted_flags_as_O(flags_from_config_file(argv, parser))
        args = parse_args(parser, argv)
        if getattr(args, "func", None) is None:
            parser.print_help(sys.stderr)
            sys.exit(USAGE_ERROR_EXIT)
        code = args.func(args)
    except (ValueError, FileNotFoundError) as e:
        message = str(e)
        if parser is not None:
            message = with_flag(message, parser)
        print(f"error: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR_EXIT)
    except KeyboardInterrupt:
        sys.exit(130)
    except RuntimeError as e:
        said = one_line_error(e)
        if said is None:
            raise
        print(f"error: {said}", file=sys.stderr)
        sys.exit(1)
    exit_without_teardown(code or 0)


def one_line_error(e: RuntimeError) -> BaseException | None:
    """The error the command ends with in one line: the engine's death, or a piece that would
    not compile (the message says what failed and what to do; the traceback is in the engine's
    log). None for any other, a bug (a recompile after warm-up, say): its traceback."""
    from kiln.compilation.piecewise import PieceCompileError, unwrap_backend_error
    from kiln.engine.core_errors import engine_gone

    if engine_gone(e):
        return e
    inner = unwrap_backend_error(e)
    if not isinstance(inner, PieceCompileError):
        return None
    if inner is not e:  # an engine core in this process (kiln compile, bench throughput,
        import traceback  # KILN_ENABLE_V1_MULTIPROCESSING=0): logged as a core process does

        from kiln.logger import init_logger

        init_logger("kiln.engine").error("engine core failed: %s",
                                         "".join(traceback.format_exception(e)))
    return inner


def exit_without_teardown(code: int) -> None:
    """Exit once the command is done: exit handlers run (temporary files, the engine's
    finalizers), the interpreter's teardown does not (freeing torch's modules one by one: 0.7 s
    of a 4 s `kiln generate` on 2 cores, with nothing left to write)."""
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
