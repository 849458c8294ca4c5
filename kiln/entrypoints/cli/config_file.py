"""vLLM's `--config FILE.yaml`: flags read from a YAML mapping of flag names to values
(`max-model-len: 4096`, `enforce-eager: true`, `served-model-name: [a, b]`), for any command.

A flag given on the command line wins over the file's (vLLM's order: command line, config file,
defaults): the file's flags go right after the command's name, before everything typed.
"""
import argparse
import json
from pathlib import Path


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands, theirs too."""
    out = set()
    for action in parser._actions:
        out.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= option_strings(sub)
    return out


def flags_from_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with its `--config FILE` replaced by the file's flags (after the command's
    words: `serve`, `bench throughput`); `false` becomes `--no-FLAG` where `parser` has one
    (and is left out where there is none)."""
    at = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not at:
        return argv
    if len(at) > 1:
        raise ValueError("--config given more than once: give one YAML file")
    i = at[0]
    if argv[i] == "--config":
        if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
            raise ValueError("--config needs a YAML file of flags, e.g. --config serve.yaml")
        path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
    else:
        path, rest = argv[i].partition("=")[2], argv[:i] + argv[i + 1:]
    flags = _flags(path, _load(path), option_strings(parser))
    words = 2 if rest[:1] == ["bench"] else 1
    if rest[:1] == ["serve"] and "--model" in flags and parser.parse_known_args(rest)[0].model_tag:
        flags = _without(flags, "--model")  # `kiln serve MODEL` wins over the file's model
    return rest[:words] + flags + rest[words:]


def _load(path: str) -> dict:
    import yaml

    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: "
                         f"{' '.join(str(e).split())}") from None
    if config is None:
        return {}
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must be a YAML mapping of flag names to values "
                         f"(max-model-len: 4096), got a {type(config).__name__}")
    return config


def _flags(path: str, config: dict, option_strings: set[str]) -> list[str]:
    out = []
    for key, value in config.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config {path} names another config file; give one file")
        if value is None:
            continue
        if isinstance(value, bool):
            off = "--no-" + flag[2:]
            if value:
                out.append(flag)
            elif off in option_strings:
                out.append(off)
        elif isinstance(value, list):
            out += [flag, *(json.dumps(v) if isinstance(v, dict) else str(v) for v in value)]
        elif isinstance(value, dict):  # -O's JSON, --structured-outputs-config's
            out += [flag, json.dumps(value)]
        else:
            out += [flag, str(value)]
    return out


def _without(flags: list[str], flag: str) -> list[str]:
    if flag not in flags:
        return flags
    i = flags.index(flag)
    return flags[:i] + flags[i + 2:]
