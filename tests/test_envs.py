"""kiln/envs.py: the environment variables Kiln reads."""
from pathlib import Path

from kiln import envs


def test_an_empty_cache_root_means_the_default(monkeypatch, tmp_path):
    """KILN_CACHE_ROOT="" cached into the working directory (Path("") is "."), where every
    other variable treats empty as unset (helper-25)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("KILN_CACHE_ROOT", "")
    assert envs.cache_root() == tmp_path / "kiln"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert envs.cache_root() == Path.home() / ".cache" / "kiln"


def test_switches_read_the_usual_spellings_and_refuse_the_rest(monkeypatch):
    """Anything but ""/0/false read as true: KILN_ENABLE_V1_MULTIPROCESSING=off ran the core in
    its own process, KILN_DISABLE_COMPILE_CACHE=no disabled the cache (helper-42)."""
    import pytest

    for value, want in (("off", False), ("NO", False), ("0", False),
                        ("on", True), ("Yes", True), ("1", True), ("TRUE", True)):
        monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", value)
        monkeypatch.setenv("KILN_DISABLE_COMPILE_CACHE", value)
        assert envs.enable_multiprocessing() is want and envs.disable_compile_cache() is want
    monkeypatch.delenv("KILN_DISABLE_COMPILE_CACHE")
    assert envs.disable_compile_cache() is False
    monkeypatch.setenv("KILN_WEIGHT_SNAPSHOT", "maybe")
    with pytest.raises(ValueError, match="KILN_WEIGHT_SNAPSHOT='maybe' must be 1/true/yes/on"):
        envs.weight_snapshot()


def test_an_empty_switch_means_its_default(monkeypatch):
    """KILN_NATIVE_CPU_OPS= (empty) read as false and turned a default-on switch off, where every
    other variable treats empty as unset."""
    for value in ("", "  "):
        for name in ("KILN_NATIVE_CPU_OPS", "KILN_WEIGHT_SNAPSHOT", "KILN_ENABLE_V1_MULTIPROCESSING",
                     "KILN_DISABLE_COMPILE_CACHE", "KILN_REQUIRE_NATIVE", "KILN_CUDAGRAPH_DEBUG"):
            monkeypatch.setenv(name, value)
        assert envs.native_cpu_ops() and envs.weight_snapshot() and envs.enable_multiprocessing()
        assert not (envs.disable_compile_cache() or envs.require_native()
                    or envs.cudagraph_debug())


def test_logging_level_is_checked_by_name(monkeypatch):
    import pytest

    monkeypatch.setenv("KILN_LOGGING_LEVEL", "debug")
    assert envs.logging_level() == "DEBUG"
    monkeypatch.setenv("KILN_LOGGING_LEVEL", "bogus")
    with pytest.raises(ValueError, match="KILN_LOGGING_LEVEL='bogus' must be DEBUG, INFO"):
        envs.logging_level()


def test_vllm_api_key_protects_a_server_moved_from_vllm(monkeypatch):
    """VLLM_API_KEY was ignored: the server came up open, saying "API key off" (helper-42)."""
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    assert envs.api_key() == "secret"
    monkeypatch.setenv("KILN_API_KEY", "mine")
    assert envs.api_key() == "mine"
