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


class _Unpicklable:
    """As a model's oneDNN-packed tensors: pickling raises NotImplementedError."""

    def __reduce__(self):
        raise NotImplementedError("Cannot access storage of OpaqueTensorImpl")


class _FakeWorker:
    def collective_rpc(self, method, args, kwargs):
        return _Unpicklable() if method == "get_model" else {"ok": args}


def test_a_result_that_does_not_pickle_is_the_callers_error_not_a_ranks_death():
    """collective_rpc('get_model') crossing processes: the core's reply to the front end, and a
    rank's reply to the engine (its pipe pickled it outside any guard, so the rank died and the
    engine with it)."""
    import pickle

    from kiln.executor.rank_worker import RankWorker

    with pytest.raises(ValueError, match="_Unpicklable.*cannot be sent back.*OpaqueTensorImpl"):
        rpc_wire.dumps_results([_Unpicklable()])
    rank = RankWorker.__new__(RankWorker)
    rank.rank, rank.worker = 0, _FakeWorker()
    replies = [pickle.loads(pickle.dumps(rank.call("collective_rpc", (m, (1,), None))))
               for m in ("echo", "get_model")]  # as the rank's pipe sends them
    assert rpc_wire.raise_failures(replies[:1]) == [{"ok": (1,)}]
    with pytest.raises(ValueError, match="worker rank 1: collective_rpc: .*cannot be sent"):
        rpc_wire.raise_failures(replies)


class _Executor:
    """Workers whose weight update fails, and whose KV-scale query fails after it."""

    def __init__(self):
        self.scale_queries = 0

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "kv_cache_scales":
            self.scale_queries += 1
            if self.scale_queries > 1:
                raise RuntimeError("rank 0 could not read its scales")
            return [[(1.0, 1.0)]]
        raise KeyError("model.no_such_weight")


class _Scheduler:
    def __init__(self):
        self.resets = []

    def reset_prefix_cache(self, reset_running_requests=False):
        self.resets.append(reset_running_requests)
        return True


def test_a_failed_update_raises_its_own_error_when_the_scale_check_after_it_fails_too(
        kiln_logs):
    """The check after a failed update ran in a `finally`: its error replaced the update's
    (which showed only as its context). The update's error is raised, the check's logged, and
    scales that could not be read back are taken as changed (running requests recomputed)."""
    from kiln.core.core_sleep import CoreSleepMode

    core = CoreSleepMode()
    core.executor, core.scheduler = _Executor(), _Scheduler()
    with pytest.raises(KeyError, match="model.no_such_weight"):
        core.collective_rpc("load_weights", kwargs={"weights": []})
    assert core.scheduler.resets == [True]
    (record,) = [r for r in kiln_logs.records if "failed too" in r.getMessage()]
    assert "could not read its scales" in str(record.exc_info[1])


def test_a_scale_check_that_fails_after_a_good_update_is_raised():
    from kiln.core.core_sleep import CoreSleepMode

    class Executor(_Executor):
        def collective_rpc(self, method, args=(), kwargs=None):
            return super().collective_rpc(method) if method == "kv_cache_scales" else ["ok"]

    core = CoreSleepMode()
    core.executor, core.scheduler = Executor(), _Scheduler()
    with pytest.raises(RuntimeError, match="could not read its scales"):
        core.collective_rpc("load_weights")
    assert core.scheduler.resets == [True]
