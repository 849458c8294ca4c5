"""torch.compile configuration, with vLLM's names so users' flags carry over.

`mode` picks the level of compilation; the rest tunes the piecewise stack (kiln/compilation/).
"""
import enum
import json
from dataclasses import dataclass, field, fields
from typing import Any

from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)


class CompilationMode(enum.IntEnum):
    NONE = 0  # eager
    STOCK_TORCH_COMPILE = 1  # plain torch.compile, normal guards
    DYNAMO_TRACE_ONCE = 2  # one Dynamo trace, guards dropped, no split, no cache
    KILN_COMPILE = 3  # the piecewise stack: split at attention, per-shape artifacts, disk cache


DEFAULT_SPLITTING_OPS = ["kiln::unified_attention"]


# pass_config keys: Kiln's graph passes (kiln/compilation/passes/), each on unless set false,
# and enable_fusion (norms and activations fused into the linear op after them).
PASS_NAMES = ("eliminate_noops", "fuse_norm_quant", "fuse_act_quant", "fuse_mm_act_quant",
              "reinplace_ir_ops", "enable_fusion")
_PASS_ALIASES = {"enable_noop": "eliminate_noops"}  # vLLM's older name
# vLLM's passes that Kiln does not have: false (what Kiln does anyway) is taken.
_VLLM_PASSES_OFF_ONLY = ("enable_sequence_parallelism", "enable_async_tp", "fuse_allreduce_rms",
                         "enable_fi_allreduce_fusion", "fuse_attn_quant", "enable_attn_fusion")


def _inductor_defaults() -> dict:
    """Every option torch._inductor.config has (dotted names of its sub-configs included) and
    its default."""
    from torch._inductor import config

    return {name: entry.default for name, entry in config._config.items()}


def _pass_config(given: dict) -> dict:
    """pass_config checked, vLLM's older names mapped, and only what differs from the default
    kept (so an equal config makes the same compile cache key)."""
    out, given_as = {}, {}  # given_as: the key that set each pass, for the error below
    for key, value in given.items():
        name = _PASS_ALIASES.get(key, key)
        if not isinstance(value, bool):
            raise ConfigError(f"compilation_config.pass_config.{key} must be true or false; got "
                              f"{value!r}")
        if name in _VLLM_PASSES_OFF_ONLY:
            if value:
                raise ConfigError(f"compilation_config.pass_config.{key}: Kiln has no such pass; "
                                  "drop it (or set it false)")
            continue
        if name not in PASS_NAMES:
            raise ConfigError(f"compilation_config.pass_config has unknown key {key!r}; Kiln's "
                              f"passes: {', '.join(PASS_NAMES)}")
        if out.get(name, value) != value:
            older = next(k for k in (key, given_as[name]) if k != name)
            raise ConfigError(f"compilation_config.pass_config sets {name} both ways ({older} "
                              "is its older name)")
        out[name], given_as[name] = value, key
    return {name: value for name, value in out.items() if value is not True}


def _check_inductor_options(options: dict) -> None:
    defaults = _inductor_defaults()
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        raise ConfigError(f"compilation_config.inductor_compile_config must be options of "
                          f"torch._inductor.config (unknown: {unknown})")
    for name, value in options.items():
        if not _fits(value, defaults[name]):
            raise ConfigError(f"compilation_config.inductor_compile_config[{name!r}] must be of "
                              f"type {type(defaults[name]).__name__} (its default is "
                              f"{defaults[name]!r}); got {value!r}")


def _fits(value, default) -> bool:
    """Whether `value` has the type of an option whose default is `default` (None: any)."""
    if value is None or type(default) not in (bool, int, float, str):
        return True
    if type(default) is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if type(default) is float:
        return isinstance(value, (int, float))
    return isinstance(value, type(default))


@dataclass
class CompilationConfig(FreezableConfig):
    mode: int | None = None  # None: KILN_COMPILE, or NONE with enforce_eager
    backend: str = "inductor"  # "inductor" | "eager"
    splitting_ops: list[str] | None = None
    compile_sizes: list[int] = field(default_factory=list)
    cudagraph_mode: Any = None  # a CUDAGraphMode name or value; None: platform default
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    # vLLM's: "none" / "all" / "-op" / "+op" choose IR ops' torch reference or kernel, under
    # any --ir-op-priority (KilnConfig)
    custom_ops: list[str] = field(default_factory=list)
    pass_config: dict = field(default_factory=dict)
    inductor_compile_config: dict = field(default_factory=dict)
    cache_dir: str = ""  # "" -> <KILN_CACHE_ROOT>/torch_compile_cache
    debug_dump_path: str = ""

    def __post_init__(self):
        def fail(name: str, rule: str, value) -> None:
            raise ConfigError(f"compilation_config.{name} must be {rule}; got {value!r}")

        def integer(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if self.mode is not None:
            if not integer(self.mode) or self.mode not in CompilationMode.__members__.values():
                fail("mode", "0, 1, 2 or 3", self.mode)
            self.mode = CompilationMode(self.mode)
        if self.backend not in ("inductor", "eager"):
            fail("backend", "'inductor' or 'eager'", self.backend)
        if self.splitting_ops is None:
            self.splitting_ops = list(DEFAULT_SPLITTING_OPS)
        if not (isinstance(self.splitting_ops, (list, tuple))
                and all(isinstance(op, str) and "::" in op for op in self.splitting_ops)):
            fail("splitting_ops", 'a list of op names such as ["kiln::unified_attention"]',
                 self.splitting_ops)
        self.splitting_ops = list(self.splitting_ops)
        if not (isinstance(self.compile_sizes, (list, tuple))
                and all(integer(size) and size >= 1 for size in self.compile_sizes)):
            fail("compile_sizes", "a list of positive integers", self.compile_sizes)
        self.compile_sizes = sorted(set(self.compile_sizes))
        for name in ("pass_config", "inductor_compile_config"):
            if not isinstance(getattr(self, name), dict):
                fail(name, "a JSON object (dict)", getattr(self, name))
        if not (isinstance(self.custom_ops, (list, tuple))
                and all(isinstance(op, str) for op in self.custom_ops)):
            fail("custom_ops", 'a list such as ["none", "+rms_norm"] (IR ops, kiln/ir/)',
                 self.custom_ops)
        self.custom_ops = list(self.custom_ops)
        for name in ("cache_dir", "debug_dump_path"):
            if not isinstance(getattr(self, name), str):
                fail(name, "a path (string)", getattr(self, name))
        self.pass_config = _pass_config(self.pass_config)
        # Checked only when given: importing Inductor takes seconds, and the engine front end
        # (which builds this config too) never compiles.
        if self.inductor_compile_config:
            _check_inductor_options(self.inductor_compile_config)

    @classmethod
    def from_cli(cls, value: "str | int | dict | CompilationConfig | None") -> "CompilationConfig":
        """Accept 3, "3", '{"mode": 3, ...}', a dict, or a CompilationConfig."""
        if value is None:
            return cls()
        if isinstance(value, CompilationConfig):
            return value
        if isinstance(value, int):
            return cls(mode=value)
        if isinstance(value, dict):
            value = level_as_mode(value)
            known = set(cls.__dataclass_fields__)
            unknown = set(value) - known
            if unknown:
                raise ConfigError(f"unknown compilation_config field(s) {sorted(unknown)}; "
                                  f"known: {sorted(known)}")
            return cls(**value)
        return cls.from_cli(cli_fields(str(value)))

    def resolve_mode(self, enforce_eager: bool) -> None:
        if enforce_eager:
            if self.mode not in (None, CompilationMode.NONE):  # vLLM warns the same
                logger.warning("--enforce-eager overrides compilation mode %d: the model runs "
                               "eagerly; drop one of the two", self.mode)
            self.mode = CompilationMode.NONE
        elif self.mode is None:
            self.mode = CompilationMode.KILN_COMPILE


def level_as_mode(value: dict) -> dict:
    """vLLM's deprecated `level` read as `mode` (vLLM still takes it, warning; a `mode` given
    too wins): {"level": 0} in scripts written for older vLLM was refused as unknown."""
    if "level" not in value:
        return value
    value = dict(value)
    level = value.pop("level")
    if isinstance(level, bool) or level not in (*CompilationMode.__members__.values(), None):
        raise ConfigError(f"compilation_config.level (vLLM's deprecated name for mode) must be "
                          f"0, 1, 2 or 3; got {level!r}")
    logger.warning("compilation_config.level is vLLM's deprecated name for mode; %s",
                   "mode, given too, is used" if value.get("mode") is not None
                   else f"read as mode={level!r}")
    if value.get("mode") is None:
        value["mode"] = level
    return value


def cli_fields(text: str) -> dict:
    """The fields one -O / --compilation-config value sets: {"mode": N} for "N", vLLM's dotted
    form (".pass_config.eliminate_noops=false": a JSON value, else the text), else its JSON
    object. Raises ValueError naming the flag."""
    text = text.strip()
    if text.isdigit():
        return {"mode": int(text)}
    if text.startswith("."):
        path, sep, raw = text[1:].partition("=")
        keys = path.split(".")
        if not sep or not all(keys):
            raise ConfigError(f"-O{text} must be -O.FIELD=VALUE (or -O.FIELD.KEY=VALUE), e.g. "
                              "-O.mode=3")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare word: -O.cudagraph_mode=NONE
        for key in reversed(keys):
            value = {key: value}
        return value
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"-O/--compilation-config must be a mode number, -O.FIELD=VALUE or a "
                          f"JSON object: {e}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"-O/--compilation-config JSON must be an object, got {text}")
    return parsed


def merged_fields(current: dict, update: dict) -> dict:
    """`update` over `current`, one level into the dict fields (pass_config, ...): repeated -O
    flags add up, as vLLM's dotted flags do."""
    out = dict(current)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = {**out[key], **value}
        else:
            out[key] = value
    return out


def spec_to_dict(value) -> dict:
    """A compilation-config spec (None, 3, "3", JSON text, dict, CompilationConfig) as the dict
    of the fields it sets, checked by CompilationConfig.from_cli (ValueError names the field)."""
    if value is None:
        return {}
    if isinstance(value, CompilationConfig):
        out = {f.name: getattr(value, f.name) for f in fields(value)}
        out["mode"] = None if value.mode is None else int(value.mode)
        return out
    if isinstance(value, bool):
        raise ConfigError(f"a compilation config must be a mode or JSON object, got {value!r}")
    if isinstance(value, int):
        out = {"mode": value}
    elif isinstance(value, dict):
        out = dict(value)
    else:
        out = cli_fields(str(value))
    out = level_as_mode(out)  # a spec merged over another sets the mode it names
    CompilationConfig.from_cli(dict(out))  # validate now, before any model is loaded
    return out
