"""Environment variables Kiln reads, in one place, with their defaults.

Read them through these functions (not at import time) so tests can set them per case.
Where vLLM has the same setting, its variable is read when Kiln's is unset (a deployment moved
from vLLM keeps its settings); Kiln's wins where both are set. vLLM variables Kiln does not
honour are named at start-up by kiln/vllm_envs.py.
"""
import os
from pathlib import Path

from kiln.errors import ConfigError

# Kiln's variable -> vLLM's with the same meaning, read when Kiln's is unset or empty.
VLLM_NAMES = {
    "KILN_API_KEY": "VLLM_API_KEY",
    "KILN_LOGGING_LEVEL": "VLLM_LOGGING_LEVEL",
    "KILN_CONFIGURE_LOGGING": "VLLM_CONFIGURE_LOGGING",
    "KILN_LOGGING_PREFIX": "VLLM_LOGGING_PREFIX",
    "KILN_CPU_KVCACHE_SPACE": "VLLM_CPU_KVCACHE_SPACE",
    "KILN_CPU_OMP_THREADS_BIND": "VLLM_CPU_OMP_THREADS_BIND",
    "KILN_CPU_NUM_OF_RESERVED_CPU": "VLLM_CPU_NUM_OF_RESERVED_CPU",
    "KILN_ENABLE_V1_MULTIPROCESSING": "VLLM_ENABLE_V1_MULTIPROCESSING",
    "KILN_DISABLE_COMPILE_CACHE": "VLLM_DISABLE_COMPILE_CACHE",
    "KILN_EXECUTE_MODEL_TIMEOUT_SECONDS": "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS",
    "KILN_SERVER_DEV_MODE": "VLLM_SERVER_DEV_MODE",
    "KILN_HTTP_TIMEOUT_KEEP_ALIVE": "VLLM_HTTP_TIMEOUT_KEEP_ALIVE",
    "KILN_ENABLE_RESPONSES_API_STORE": "VLLM_ENABLE_RESPONSES_API_STORE",
    "KILN_ALLOW_RUNTIME_LORA_UPDATING": "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
    "KILN_ALLOW_LONG_MAX_MODEL_LEN": "VLLM_ALLOW_LONG_MAX_MODEL_LEN",
    "KILN_MAX_N_SEQUENCES": "VLLM_MAX_N_SEQUENCES",
}


def _read(name: str) -> tuple[str, str | None]:
    """(the variable read, its value): Kiln's `name` where set and not blank, else vLLM's
    (VLLM_NAMES), else (name, None). Errors name the variable that was read."""
    value = os.environ.get(name)
    if value is not None and value.strip():
        return name, value
    alias = VLLM_NAMES.get(name)
    if alias is not None and (os.environ.get(alias) or "").strip():
        return alias, os.environ[alias]
    return name, value


def source(name: str) -> str:
    """The variable `name`'s setting is read from: `name`, or vLLM's in its place."""
    return _read(name)[0]


def cache_root() -> Path:
    """Root of everything Kiln caches: the default model, compiled artifacts."""
    # Empty means unset (as for the other variables): Path("") is the working directory.
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kiln"
    return Path(os.environ.get("KILN_CACHE_ROOT") or default).expanduser()


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str, default: bool) -> bool:
    """A boolean variable: 1/true/yes/on or 0/false/no/off (any case). Empty means unset, as for
    the other variables: `KILN_NATIVE_CPU_OPS=` turned a default-on switch off. Anything else is
    refused: read as true, `off` turned a switch on."""
    name, value = _read(name)
    if value is None or not value.strip():
        return default
    if value.strip().lower() in _TRUE:
        return True
    if value.strip().lower() in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} must be 1/true/yes/on or 0/false/no/off")


def logging_level() -> str:
    """`KILN_LOGGING_LEVEL` (vLLM's VLLM_LOGGING_LEVEL): DEBUG, INFO (the default), WARNING,
    ERROR or CRITICAL."""
    name, value = _read("KILN_LOGGING_LEVEL")
    value = (value or "INFO").strip()
    # WARN and FATAL: Python's logging takes them, so vLLM's variable does (it is given to
    # logging as written); a deployment with VLLM_LOGGING_LEVEL=WARN got INFO and a warning.
    level = {"WARN": "WARNING", "FATAL": "CRITICAL"}.get(value.upper(), value.upper())
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ConfigError(f"{name}={value!r} must be DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


def configure_logging() -> bool:
    """`KILN_CONFIGURE_LOGGING=0` (vLLM's VLLM_CONFIGURE_LOGGING): leave the `kiln` logger to the
    application (no handler, no level; records propagate to the root logger)."""
    return _flag("KILN_CONFIGURE_LOGGING", True)


def logging_prefix() -> str:
    """`KILN_LOGGING_PREFIX` (vLLM's VLLM_LOGGING_PREFIX): text put before every log line."""
    return _read("KILN_LOGGING_PREFIX")[1] or ""


def _positive_finite(name: str, unit: str, otherwise: str) -> float | None:
    """`name`'s value as a finite number > 0; None where unset or empty."""
    name, value = _read(name)
    if not value:
        return None
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not 0 < number < float("inf"):  # NaN too
        raise ConfigError(f"{name}={value!r} must be a finite number of {unit} > 0 ({otherwise})")
    return number


def cpu_kvcache_space_gib() -> float | None:
    """GiB of host memory for the KV cache on CPU (`KILN_CPU_KVCACHE_SPACE`, vLLM-CPU's
    `VLLM_CPU_KVCACHE_SPACE`); an explicit --kv-cache-memory wins. None: Kiln's default.
    vLLM's variable defaults to 0, meaning its own default size: read as unset."""
    if _read("KILN_CPU_KVCACHE_SPACE")[0] == "VLLM_CPU_KVCACHE_SPACE":
        try:
            if float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) == 0:
                return None
        except ValueError:
            pass  # refused below, by name
    return _positive_finite("KILN_CPU_KVCACHE_SPACE", "GiB",
                            "or unset it and pass --kv-cache-memory")


def enable_multiprocessing() -> bool:
    """`KILN_ENABLE_V1_MULTIPROCESSING=0` (vLLM's VLLM_ENABLE_V1_MULTIPROCESSING): run the engine
    core in the caller's process instead of its own, for debugging."""
    return _flag("KILN_ENABLE_V1_MULTIPROCESSING", True)


def disable_compile_cache() -> bool:
    return _flag("KILN_DISABLE_COMPILE_CACHE", False)


def server_dev_mode() -> bool:
    """`KILN_SERVER_DEV_MODE=1` (vLLM's VLLM_SERVER_DEV_MODE): kiln serve adds vLLM's
    POST /reset_prefix_cache, /sleep, /wake_up, /collective_rpc and GET /is_sleeping
    (kiln/entrypoints/openai/dev_routes.py)."""
    return _flag("KILN_SERVER_DEV_MODE", False)


def responses_api_store() -> bool:
    """`KILN_ENABLE_RESPONSES_API_STORE=1` (vLLM's VLLM_ENABLE_RESPONSES_API_STORE): kiln serve
    keeps /v1/responses answers in memory for GET /v1/responses/{id} and previous_response_id
    (kiln/entrypoints/openai/responses_store.py)."""
    return _flag("KILN_ENABLE_RESPONSES_API_STORE", False)


def _positive_int(name: str, unit: str, default: int) -> int:
    """`name`'s value as a whole number > 0; `default` where unset or empty."""
    name, value = _read(name)
    if value is None or not value.strip():
        return default
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{name}={value!r} must be a whole number of {unit} >= 1 (or unset "
                          f"it for the default, {default})")
    return number


def max_n_sequences() -> int:
    """`KILN_MAX_N_SEQUENCES` (vLLM's VLLM_MAX_N_SEQUENCES): the largest n (and beam_width) a
    request may ask for, default 16,384 as vLLM's; each sample is a request in the engine,
    and n=2**40 ran the front end out of memory making them."""
    return _positive_int("KILN_MAX_N_SEQUENCES", "sequences", 16_384)


def responses_api_store_max_entries() -> int:
    """`KILN_RESPONSES_API_STORE_MAX_ENTRIES`: the most responses the store keeps (default
    10,000; vLLM's store has no bound); the oldest finished one is forgotten first."""
    return _positive_int("KILN_RESPONSES_API_STORE_MAX_ENTRIES", "responses", 10_000)


def responses_api_store_max_bytes() -> int:
    """`KILN_RESPONSES_API_STORE_MAX_BYTES`: the most bytes (of JSON: the responses kept, their
    inputs and the earlier ones they continue) the store holds (default 1 GiB); the oldest
    finished response is forgotten first."""
    return _positive_int("KILN_RESPONSES_API_STORE_MAX_BYTES", "bytes", 1 << 30)


def allow_long_max_model_len() -> bool:
    """`KILN_ALLOW_LONG_MAX_MODEL_LEN` (vLLM's `VLLM_ALLOW_LONG_MAX_MODEL_LEN`): a
    --max-model-len past the model's own length is served, with a warning, not refused (the
    positions past it are the user's risk: the model never trained on them)."""
    return _flag("KILN_ALLOW_LONG_MAX_MODEL_LEN", False)


def allow_runtime_lora_updating() -> bool:
    """`KILN_ALLOW_RUNTIME_LORA_UPDATING=1` (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING): kiln
    serve adds POST /v1/load_lora_adapter and /v1/unload_lora_adapter (kiln/lora/serving.py)."""
    return _flag("KILN_ALLOW_RUNTIME_LORA_UPDATING", False)


def http_timeout_keep_alive_s() -> float:
    """`KILN_HTTP_TIMEOUT_KEEP_ALIVE` (vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE): seconds kiln serve
    keeps an idle HTTP connection open. Default 5, as vLLM's."""
    seconds = _positive_finite("KILN_HTTP_TIMEOUT_KEEP_ALIVE", "seconds",
                               "or unset it for the default, 5")
    return 5.0 if seconds is None else seconds


def weight_snapshot() -> bool:
    """`KILN_WEIGHT_SNAPSHOT=0`: load a GGUF model from its file on every start, not from the
    snapshot of its loaded weights (kiln/model/loader/weight_snapshot.py)."""
    return _flag("KILN_WEIGHT_SNAPSHOT", True)


def api_key() -> str | None:
    """`KILN_API_KEY`, else vLLM's `VLLM_API_KEY` (a server moved from vLLM keeps its key)."""
    return os.environ.get("KILN_API_KEY") or os.environ.get("VLLM_API_KEY") or None


def cudagraph_debug() -> bool:
    """`KILN_CUDAGRAPH_DEBUG=1`: check at every graph replay that inputs sit where they did at
    capture (a moved input makes a replay read stale memory)."""
    return _flag("KILN_CUDAGRAPH_DEBUG", False)


def attention_backend() -> str | None:
    """`KILN_ATTENTION_BACKEND`: force an attention backend (torch | cpu); unset = by platform."""
    return os.environ.get("KILN_ATTENTION_BACKEND") or None


def require_native() -> bool:
    """`KILN_REQUIRE_NATIVE=1`: a CPU kernel that cannot be built or loaded is an error, not a
    warning and the torch code (CI sets it: a kernel that stops building must fail the run)."""
    return _flag("KILN_REQUIRE_NATIVE", False)


def native_cflags() -> list[str]:
    """`KILN_NATIVE_CFLAGS`: extra compile flags for the CPU kernels, after `-march=native`
    (`-mno-amx-tile -mno-amx-int8 -mno-amx-bf16`: the kernels a CPU without AMX runs, built and
    cached under a key of their own; tests/native/test_isa_tiers.py and kiln.benchmarks.moe)."""
    return (os.environ.get("KILN_NATIVE_CFLAGS") or "").split()


def native_cpu_ops() -> bool:
    """`KILN_NATIVE_CPU_OPS=0`: the torch reference first for every IR op (kiln/ir/selection.py),
    and the linear kernel's GEMV, GGUF and SiLU-and-mul paths off."""
    return _flag("KILN_NATIVE_CPU_OPS", True)


def cpu_num_reserved_cpu(default: int) -> int:
    """`KILN_CPU_NUM_OF_RESERVED_CPU` (vLLM-CPU's `VLLM_CPU_NUM_OF_RESERVED_CPU`): cores the
    engine core's OpenMP threads leave to the front end (API server, tokenizer, the OS).
    Unset: `default` (1 for a served engine, 0 for `LLM`)."""
    name, value = _read("KILN_CPU_NUM_OF_RESERVED_CPU")
    if value is None or not value.strip():
        return default
    try:
        cores = int(value)
    except ValueError:
        cores = -1
    if cores < 0:
        raise ConfigError(f"{name}={value!r} must be a whole number of "
                          "cores >= 0 (0: the engine core's threads use every core)")
    return cores


def cpu_omp_threads_bind() -> str:
    """`KILN_CPU_OMP_THREADS_BIND` (vLLM-CPU's `VLLM_CPU_OMP_THREADS_BIND`): the cores each CPU
    rank's OpenMP threads run on: `auto` (the default: the machine's cores split evenly),
    `nobind`, or one core list per rank separated by `|` (`0-3|4-7`)."""
    value = _read("KILN_CPU_OMP_THREADS_BIND")[1]
    return value.strip() if value and value.strip() else "auto"


def execute_model_timeout_s() -> float:
    """`KILN_EXECUTE_MODEL_TIMEOUT_SECONDS` (vLLM's `VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`): how long
    a multi-rank engine waits for every rank's answer to one step before it fails the engine
    (a stopped rank or a deadlocked collective would hang it forever). Default 300."""
    seconds = _positive_finite("KILN_EXECUTE_MODEL_TIMEOUT_SECONDS", "seconds",
                               "or unset it for the default, 300")
    return 300.0 if seconds is None else seconds
