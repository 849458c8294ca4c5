"""vLLM's `--config FILE.yaml`: flags read from a YAML mapping of flag names to values
(`max-model-len: 4096`, `enforce-eager: true`, `served-model-name: [a, b]`), for any command.

A flag given on the command line wins over the file's (vLLM's order: command line, config file,
defaults): the file's flags go before every flag typed, but after a positional typed first
(`kiln serve MODEL`, `kiln generate PROMPT`), as vLLM puts them after serve's model: a list
flag (served-model-name: a) right before the positional would take it as one more value.
"""
import argparse
import json
from pathlib import Path


def option_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every option string of `parser` and of its subcommands, theirs too, with its action."""
    out = {}
    for action in parser._actions:
        out.update(dict.fromkeys(action.option_strings, action))
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out.update(option_actions(sub))
    return out


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands, theirs too."""
    return set(option_actions(parser))


def flags_from_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` with its `--config FILE` replaced by the file's flags (after the command's
    words: `serve`, `bench throughput`); `false` becomes `--no-FLAG` where `parser` has one
    (and is left out where there is none)."""
    end = argv.index("--") if "--" in argv else len(argv)  # after it: positionals
    at = [i for i, arg in enumerate(argv[:end])
          if arg == "--config" or arg.startswith("--config=")]
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
    actions = option_actions(parser)
    groups = _flags(path, *_load(path), actions)
    typed = {arg.partition("=")[0] for arg in rest if arg.startswith("-")}
    # a repeatable flag (--stop) adds to the file's values: typed, it replaces them
    groups = [g for g in groups if not (g[0] in typed
                                        and isinstance(actions.get(g[0]), argparse._AppendAction))]
    if (rest[:1] == ["serve"] and any(g[0] == "--model" for g in groups)
            and parser.parse_known_args(rest)[0].model_tag):
        groups = [g for g in groups if g[0] != "--model"]  # `kiln serve MODEL` wins
    flags = [arg for group in groups for arg in group]
    words = 2 if rest[:1] == ["bench"] else 1
    at = next((j for j in range(words, len(rest)) if rest[j].startswith("-")), len(rest))
    return rest[:at] + flags + rest[at:]


def _load(path: str) -> tuple[dict, dict]:
    """The file's mapping as YAML types it, and as the text it holds (yaml.BaseLoader)."""
    import yaml

    try:
        # bytes: YAML's own reader decodes them (UTF-8, or UTF-16 by its BOM), whatever the
        # locale, and names a bad byte as a YAML error of this file
        text = Path(path).read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"--config {path}: no such file") from None
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it ({e.strerror})") from None
    try:
        config = yaml.safe_load(text)
        raw = yaml.load(text, Loader=yaml.BaseLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path} is not valid YAML: "
                         f"{' '.join(str(e).split())}") from None
    if config is None:
        return {}, {}
    if not isinstance(config, dict):
        raise ValueError(f"--config {path} must be a YAML mapping of flag names to values "
                         f"(max-model-len: 4096), got a {type(config).__name__}")
    return config, raw


def _flags(path: str, config: dict, raw: dict,
           actions: dict[str, argparse.Action]) -> list[list[str]]:
    """The file's flags, one list (the flag, then its values) per key. A flag taking text
    (--api-key, --served-model-name, --revision) gets the text as written: YAML 1.1 reads
    0777 as 511, 1.10 as 1.1 and no as false."""
    out = []
    for key, value in config.items():
        text = raw.get(key) if isinstance(key, str) else None  # merged (<<) keys: none
        # the name is dashed, not the field after a dot (compilation_config.pass_config.x)
        name, dot, field = str(key).lstrip("-").partition(".")
        flag = "--" + name.replace("_", "-")
        if flag == "--config":
            raise ValueError(f"--config {path} names another config file; give one file")
        if value is None:
            continue
        action = actions.get(flag)
        if not dot and action is not None and action.nargs != 0 and action.type in (None, str):
            value = _as_written(value, text)
        if dot:  # one JSON value, as -O.FIELD=VALUE reads it: true stays true, not a switch
            out.append([f"{flag}.{field}={_json(value)}"])
        elif isinstance(value, bool):
            off = "--no-" + flag[2:]
            if value:
                out.append([flag])
            elif off in actions:
                out.append([off])
        elif isinstance(value, list):
            values = [_json(v) if isinstance(v, dict) else str(v) for v in value]
            if action is not None and action.nargs is None:  # one value a time, repeatable:
                out += [[flag, v] for v in values]  # --stop a --stop b, --ir-op-priority
            elif values:  # an empty list asks for nothing, as in vLLM
                out.append([flag, *values])
        elif isinstance(value, dict):  # -O's JSON, --structured-outputs-config's
            out.append([flag, _json(value)])
        else:
            out.append([flag, str(value)])
    return out


def _as_written(value, text):
    """`value` (YAML's reading) with its scalars, its list's too, as the file's text."""
    if isinstance(value, list) and isinstance(text, list):
        return [_as_written(v, t) for v, t in zip(value, text)]
    return text if isinstance(text, str) and not isinstance(value, dict) else value


def _json(value) -> str:
    # YAML reads 2024-01-01 as a date, which JSON has no type for: its text, as written
    return json.dumps(value, default=str)
