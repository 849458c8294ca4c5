"""The model's own sampling defaults (generation_config.json) and the chat template flag's text.

Defaults fill only the fields a request leaves unset, as vLLM's `--generation-config auto`.
"""
import json
from pathlib import Path

from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

# generation_config.json key -> SamplingParams field (vLLM's get_diff_sampling_param).
GENERATION_CONFIG_KEYS = {"repetition_penalty": "repetition_penalty", "temperature": "temperature",
                 "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                 "max_new_tokens": "max_tokens"}


def load_chat_template(value: str | None) -> str | None:
    """--chat-template as vLLM takes it: a path to a Jinja file, or the template's text; one
    that does not parse is refused here, not by every chat request afterwards."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        is_file = path.is_file()
    except OSError:  # template text longer than a file name may be (ENAMETOOLONG)
        is_file = False
    if is_file:
        where = str(path)
        try:  # UTF-8 whatever the locale: Jinja files are, as transformers reads them
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:  # a bare codec error named neither flag nor file
            raise ConfigError(f"--chat-template: {where} is not UTF-8 text ({e.reason} at "
                              f"byte {e.start}); save the template as UTF-8") from None
    elif "{" not in value:  # no Jinja in it: meant as a file that is not there
        raise FileNotFoundError(f"--chat-template {value!r}: no such file (give a Jinja "
                                "template file or the template text)")
    else:
        text, where = value, "the template text"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        # bytes that are not UTF-8 on the command line reach Python as lone surrogates: every
        # chat failed to render, blamed on its messages
        raise ConfigError(f"--chat-template: {where} is not UTF-8 text ({text[e.start]!r} at "
                          f"character {e.start}); give UTF-8 text") from None
    if not text.strip():  # it would render every chat as an empty prompt
        raise ConfigError(f"--chat-template: {where} is empty; give a Jinja chat template")
    from jinja2 import TemplateSyntaxError

    try:
        _compile_template(text)
    except TemplateSyntaxError as e:
        raise ConfigError(f"--chat-template: {where} is no valid Jinja template: {e.message} "
                          f"(line {e.lineno})") from None
    return text


def _compile_template(text: str) -> None:
    """Compile as transformers does when it renders (its extensions: {% generation %}, loop
    controls), raising jinja2's TemplateSyntaxError."""
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # its private helper moved: the sandbox it renders in, less extensions
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
        return
    _compile_jinja_template(text)


def generation_config_file(generation_config: str, model_path: Path) -> Path | None:
    """The generation_config.json that --generation-config names (None: no defaults)."""
    if generation_config == "vllm":
        return None
    if generation_config == "auto":
        path = model_path / "generation_config.json"
        return path if path.is_file() else None
    path = Path(generation_config).expanduser()
    if path.is_dir():
        path = path / "generation_config.json"
    if not path.is_file():
        raise FileNotFoundError(f"--generation-config {generation_config!r}: no "
                                "generation_config.json there; pass auto, vllm or a directory "
                                "holding one")
    return path


def load_generation_defaults(generation_config: str, model_path: Path) -> dict:
    """SamplingParams field -> default, from the generation config the flag names."""
    path = generation_config_file(generation_config, model_path)
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        if generation_config == "auto":
            logger.warning("ignoring unreadable %s (%s)", path, e)
            return {}
        raise ConfigError(f"--generation-config {generation_config!r}: {path} is not JSON "
                          f"({e})") from None
    defaults = {field: raw[key] for key, field in GENERATION_CONFIG_KEYS.items()
                if raw.get(key) is not None}
    for field, value in list(defaults.items()):
        problem = _default_problem(field, value)
        if problem is None:
            continue
        if generation_config != "auto":  # the user's file: every request would fail on it
            raise ConfigError(f"--generation-config {generation_config!r}: {path}: {problem}")
        logger.warning("ignoring %s's %s: %s", path, field, problem)
        del defaults[field]
    if defaults:
        logger.info("sampling defaults from %s for fields requests leave unset: %s "
                    "(--generation-config vllm ignores them)", path, defaults)
    return defaults


def _default_problem(field: str, value) -> str | None:
    """Why SamplingParams refuses `value` as `field`'s default, if it does."""
    from kiln.sampling_params import SamplingParams

    try:
        SamplingParams(**{field: value})
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def default_max_tokens(requested: int | None, defaults: dict) -> int | None:
    """A request's max_tokens under the model's default: the smaller of both, as vLLM's."""
    default = defaults.get("max_tokens")
    if requested is None or default is None:
        return requested if default is None else default
    return min(requested, default)
