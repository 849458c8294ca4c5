"""Which start-up errors are the user's (one line naming the flag) and which are bugs (logged
with their traceback): a ConfigError or a missing file is the user's, a bare ValueError is not."""
import pytest

from kiln.core.core_messages import failure_report
from kiln.engine.core_errors import rebuild_error
from kiln.errors import ConfigError, is_user_error


def test_a_refused_setting_is_the_users_and_a_bare_value_error_is_a_bug():
    assert is_user_error(ConfigError("--max-model-len 9 exceeds ..."))
    assert is_user_error(FileNotFoundError("no config.json"))
    assert not is_user_error(ValueError("too many values to unpack"))  # a bug in Kiln's code
    assert not is_user_error(RuntimeError("x"))


def test_a_config_error_from_the_core_process_is_rebuilt_as_a_config_error():
    error = rebuild_error(failure_report(ConfigError("--dtype must be ...")))
    assert type(error) is ConfigError and str(error) == "--dtype must be ..."


def test_refusals_at_load_are_config_errors(monkeypatch):
    from kiln.config.cache_config import CacheConfig
    from kiln.core.block_pool import BlockPool
    from kiln.envs import cpu_kvcache_space_gib
    from kiln.model.layers.quantization.compressed_tensors import UnsupportedQuantization

    assert issubclass(UnsupportedQuantization, ConfigError)
    with pytest.raises(ConfigError, match="block_size"):
        CacheConfig(block_size=3)
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override"):
        BlockPool(0)
    monkeypatch.setenv("KILN_CPU_KVCACHE_SPACE", "abc")
    with pytest.raises(ConfigError, match="KILN_CPU_KVCACHE_SPACE"):
        cpu_kvcache_space_gib()
