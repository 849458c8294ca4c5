"""The sleep mode's decisions without a model: levels, modes, tags refused with what to pass;
collective_rpc's wire refusing what cannot cross to the engine's processes."""
import pytest

from kiln.core import rpc_wire
from kiln.core.core_messages import failure_report
from kiln.core.core_sleep import check_sleep, check_tags
from kiln.errors import ConfigError


def test_levels_modes_and_sleep_mode_are_checked():
    check_sleep(1, "abort", enabled=True, num_in_flight=3)
    check_sleep(0, "keep", enabled=False, num_in_flight=0)  # a pause needs no sleep mode
    check_sleep(2, "wait", enabled=True, num_in_flight=0)
    with pytest.raises(ValueError, match="level must be 0"):
        check_sleep(3, "abort", enabled=True, num_in_flight=0)
    with pytest.raises(ValueError, match="level must be 0"):
        check_sleep(True, "abort", enabled=True, num_in_flight=0)
    with pytest.raises(ValueError, match="mode must be one of"):
        check_sleep(1, "drop", enabled=True, num_in_flight=0)
    with pytest.raises(ConfigError, match="--enable-sleep-mode"):
        check_sleep(1, "abort", enabled=False, num_in_flight=0)
    with pytest.raises(ValueError, match="mode='abort'.*'keep'"):
        check_sleep(1, "wait", enabled=True, num_in_flight=2)


def test_wake_up_tags():
    assert check_tags(None) == ("weights", "kv_cache", "scheduling")
    assert check_tags(["kv_cache", "weights"]) == ("weights", "kv_cache")
    with pytest.raises(ValueError, match=r"unknown wake_up tag\(s\) \['gpu'\]"):
        check_tags(["gpu"])
    with pytest.raises(ValueError, match="must be a list"):
        check_tags("weights")


def _module_level(worker, x):
    return x


def test_rpc_wire_sends_functions_by_name_and_refuses_lambdas():
    method, args, kwargs = rpc_wire.loads(rpc_wire.dumps_call(_module_level, (1,), {"y": 2}))
    assert method is _module_level and args == (1,) and kwargs == {"y": 2}
    with pytest.raises(ValueError, match="module-level function"):
        rpc_wire.dumps_call(lambda worker: 1, (), None)
    # a script's own function pickles by name, but the engine's process has another __main__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_module_level, "__module__", "__main__")
        with pytest.raises(ValueError, match=r"script being run \(__main__\).*module"):
            rpc_wire.dumps_call(_module_level, (), None)


def test_a_workers_error_comes_back_as_its_own_kind():
    def boom():
        raise ValueError("no such weight")

    results = [1, rpc_wire.guarded(boom)]
    with pytest.raises(ValueError, match="worker rank 1: no such weight"):
        rpc_wire.raise_failures(results)
    assert isinstance(rpc_wire.error_from(failure_report(KeyError("k"))), KeyError)
