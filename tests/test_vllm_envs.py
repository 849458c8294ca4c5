"""vLLM's environment variables: honoured where Kiln has the setting (Kiln's own variable wins),
named once at start-up where it does not (kiln/envs.py VLLM_NAMES, kiln/vllm_envs.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import envs, vllm_envs

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _no_ambient_settings(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("KILN_", "VLLM_")) and name != "KILN_CACHE_ROOT":
            monkeypatch.delenv(name)


def test_vllm_cpu_settings_are_honoured_and_kilns_win(monkeypatch):
    """VLLM_CPU_KVCACHE_SPACE=1 gave a vLLM-CPU user Kiln's 4 GiB; VLLM_CPU_OMP_THREADS_BIND,
    VLLM_CPU_NUM_OF_RESERVED_CPU were ignored the same way."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "3")
    assert envs.cpu_kvcache_space_gib() == 1
    assert envs.cpu_omp_threads_bind() == "nobind"
    assert envs.cpu_num_reserved_cpu(default=1) == 3
    assert envs.source("KILN_CPU_OMP_THREADS_BIND") == "VLLM_CPU_OMP_THREADS_BIND"
    monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", "2")
    monkeypatch.setenv("KILN_CPU_OMP_THREADS_BIND", "auto")
    monkeypatch.setenv("KILN_CPU_NUM_OF_RESERVED_CPU", "0")
    assert envs.cpu_kvcache_space_gib() == 2
    assert envs.cpu_omp_threads_bind() == "auto"
    assert envs.cpu_num_reserved_cpu(default=1) == 0


def test_vllm_kvcache_space_0_is_vllms_default_and_bad_values_name_vllms_variable(monkeypatch):
    """vLLM's VLLM_CPU_KVCACHE_SPACE defaults to 0: its own default size, not an error."""
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0")
    assert envs.cpu_kvcache_space_gib() is None
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots' must be a finite"):
        envs.cpu_kvcache_space_gib()
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "-2")
    with pytest.raises(ValueError, match="VLLM_CPU_NUM_OF_RESERVED_CPU='-2'"):
        envs.cpu_num_reserved_cpu(default=1)


def test_vllm_switches_logging_and_timeouts_are_honoured(monkeypatch):
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "debug")
    monkeypatch.setenv("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "30")
    monkeypatch.setenv("VLLM_CONFIGURE_LOGGING", "0")
    monkeypatch.setenv("VLLM_LOGGING_PREFIX", "[x] ")
    assert envs.enable_multiprocessing() is False and envs.disable_compile_cache() is True
    assert envs.logging_level() == "DEBUG" and envs.execute_model_timeout_s() == 30
    assert envs.configure_logging() is False and envs.logging_prefix() == "[x] "
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "1")
    monkeypatch.setenv("KILN_LOGGING_LEVEL", "ERROR")
    assert envs.enable_multiprocessing() is True and envs.logging_level() == "ERROR"
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "maybe")
    with pytest.raises(ValueError, match="VLLM_DISABLE_COMPILE_CACHE='maybe'"):
        envs.disable_compile_cache()


def test_vllm_logging_level_takes_the_names_pythons_logging_takes(monkeypatch):
    """vLLM gives VLLM_LOGGING_LEVEL to logging as written: WARN and FATAL are levels there;
    here they were refused (INFO, and a warning at every start)."""
    for value, level in (("WARN", "WARNING"), ("warn", "WARNING"), ("FATAL", "CRITICAL")):
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", value)
        assert envs.logging_level() == level
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "LOUD")
    with pytest.raises(ValueError, match="VLLM_LOGGING_LEVEL='LOUD'"):
        envs.logging_level()


def test_honoured_vllm_settings_reach_ray_ranks_but_the_api_key_does_not():
    from kiln.executor.ray_placement import kiln_env_vars

    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_API_KEY": "k", "KILN_API_KEY": "k",
           "VLLM_CPU_KVCACHE_SPACE": "3", "VLLM_RPC_TIMEOUT": "5", "HOME": "/h"}
    assert kiln_env_vars(env) == {"VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                  "VLLM_CPU_KVCACHE_SPACE": "3"}


def test_unhonoured_vllm_settings_are_each_named_once_with_kilns_equivalent():
    env = {"VLLM_USE_V1": "0", "VLLM_CACHE_ROOT": "/data/vllm", "VLLM_SERVER_DEV_MODE": "1",
           "VLLM_ATTENTION_BACKEND": "TORCH_SDPA", "VLLM_MYSTERY": "1", "VLLM_OTHER": "x",
           "VLLM_CPU_KVCACHE_SPACE": "8", "KILN_CPU_KVCACHE_SPACE": "2", "PATH": "/bin"}
    lines = vllm_envs.unhonoured_vllm_settings(env)
    assert len(lines) == 6, lines
    text = "\n".join(lines)
    for needle in ("VLLM_USE_V1='0' is not honoured: Kiln has only vLLM's V1 engine",
                   "VLLM_CACHE_ROOT='/data/vllm' is not honoured: Kiln caches under "
                   "KILN_CACHE_ROOT", "VLLM_SERVER_DEV_MODE='1'", "KILN_ATTENTION_BACKEND",
                   "VLLM_CPU_KVCACHE_SPACE='8' is overridden by KILN_CPU_KVCACHE_SPACE='2'",
                   "VLLM_MYSTERY, VLLM_OTHER are vLLM setting(s) Kiln does not read"):
        assert needle in text


def test_settings_that_change_nothing_here_are_not_named():
    """A value that means what Kiln does anyway, an honoured variable, vLLM's usage-stats
    switches and empty values give no line (a warning there would be noise)."""
    env = {"VLLM_USE_V1": "1", "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
           "VLLM_SERVER_DEV_MODE": "0", "VLLM_CPU_KVCACHE_SPACE": "8",
           "VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_NO_USAGE_STATS": "1", "VLLM_PORT": "",
           "VLLM_API_KEY": "k", "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"}
    assert vllm_envs.unhonoured_vllm_settings(env) == []


def test_the_warning_is_logged_once_per_process(monkeypatch):
    import logging

    monkeypatch.setattr(vllm_envs, "_warned", False)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("kiln.vllm_envs")
    logger.addHandler(handler)
    try:
        vllm_envs.warn_unhonoured_once({"VLLM_USE_V1": "0"})
        vllm_envs.warn_unhonoured_once({"VLLM_USE_V1": "0"})
    finally:
        logger.removeHandler(handler)
    assert seen == ["VLLM_USE_V1='0' is not honoured: Kiln has only vLLM's V1 engine"]


def _log_once(extra_env: dict) -> subprocess.CompletedProcess:
    code = ("import logging, sys\n"
            "logging.basicConfig(stream=sys.stdout, format='APP %(name)s %(message)s')\n"
            "from kiln.logger import init_logger\n"
            "init_logger('kiln.t').warning('hello')\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "VLLM_"))}
    env.update(PYTHONPATH=str(REPO), **extra_env)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)


def test_vllm_logging_prefix_and_configure_logging_are_honoured():
    """VLLM_CONFIGURE_LOGGING=0 (the application configures logging) still got Kiln's handler,
    and VLLM_LOGGING_PREFIX no prefix."""
    out = _log_once({"VLLM_LOGGING_PREFIX": "[node-3 %s] "})
    assert out.stderr.startswith("[node-3 %s] WARNING ") and "hello" in out.stderr, out
    assert "APP" not in out.stdout
    out = _log_once({"VLLM_CONFIGURE_LOGGING": "0"})
    assert out.stdout == "APP kiln.t hello\n" and "hello" not in out.stderr, out


def test_vllm_http_keep_alive_reaches_the_servers_settings(monkeypatch):
    """VLLM_HTTP_TIMEOUT_KEEP_ALIVE=60 (behind a load balancer that reuses connections for 60 s)
    still closed idle connections after Kiln's fixed 5 s."""
    from kiln.entrypoints.cli.main import build_parser
    from kiln.entrypoints.cli.serve import settings_from_args

    def settings():
        return settings_from_args(build_parser().parse_args(["serve"]))

    assert settings().timeout_keep_alive == 5
    monkeypatch.setenv("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "60")
    assert settings().timeout_keep_alive == 60
    monkeypatch.setenv("KILN_HTTP_TIMEOUT_KEEP_ALIVE", "7")
    assert settings().timeout_keep_alive == 7
    monkeypatch.setenv("KILN_HTTP_TIMEOUT_KEEP_ALIVE", "-1")
    with pytest.raises(ValueError, match="KILN_HTTP_TIMEOUT_KEEP_ALIVE='-1' must be a finite"):
        settings()


def test_a_bad_vllm_binding_is_refused_by_its_own_name(monkeypatch):
    """VLLM_CPU_OMP_THREADS_BIND=0-1 for two ranks was refused as KILN_CPU_OMP_THREADS_BIND, a
    variable the user never set."""
    from kiln.distributed.cpu_binding import cores_for_rank

    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    with pytest.raises(ValueError, match=r"^VLLM_CPU_OMP_THREADS_BIND='0-1' gives 1 core list"):
        cores_for_rank(envs.cpu_omp_threads_bind(), 0, 2, [0, 1])
    assert cores_for_rank(envs.cpu_omp_threads_bind(), 0, 1, [0, 1, 2]) == [0, 1]


def test_an_overridden_api_key_is_named_without_either_key():
    lines = vllm_envs.unhonoured_vllm_settings({"VLLM_API_KEY": "old-secret",
                                                "KILN_API_KEY": "new-secret"})
    assert lines == ["VLLM_API_KEY is overridden by KILN_API_KEY"]


def test_reserved_cores_at_tp2_are_named_as_ignored(monkeypatch, kiln_logs):
    """VLLM_CPU_NUM_OF_RESERVED_CPU=1 with two ranks: vLLM-CPU leaves a core per rank, Kiln's
    ranks take every core of their share, and nothing said so."""
    from kiln.engine.arg_utils import EngineArgs

    from checkpoints import STORIES_DIR

    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    EngineArgs(model=str(STORIES_DIR), device="cpu", pipeline_parallel_size=2,
               distributed_executor_backend="mp").create_kiln_config()
    assert "VLLM_CPU_NUM_OF_RESERVED_CPU=1 is ignored" in kiln_logs.text
    kiln_logs.clear()
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    EngineArgs(model=str(STORIES_DIR), device="cpu", pipeline_parallel_size=2,
               distributed_executor_backend="mp").create_kiln_config()
    assert "RESERVED" not in kiln_logs.text
