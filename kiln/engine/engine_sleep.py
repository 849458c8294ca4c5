"""`EngineSleepMode`: vLLM's LLMEngine sleep / wake_up / is_sleeping and collective_rpc, handed to
the engine core (kiln/core/core_sleep.py), and the check that a batch can run now."""
import math


def check_rpc_timeout(timeout) -> float | None:
    """collective_rpc's `timeout`: seconds > 0, or None (or infinity): no limit."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"collective_rpc timeout must be a number of seconds > 0 (or None: no "
                         f"limit), got {timeout!r}")
    return float(timeout) if math.isfinite(timeout) else None


def rpc_timed_out(method, timeout: float) -> TimeoutError:
    """What a collective_rpc call that outlived its `timeout` raises (vLLM's TimeoutError):
    the worker's call runs on, and the engine runs nothing else until it ends."""
    name = method if isinstance(method, str) else getattr(method, "__qualname__", repr(method))
    return TimeoutError(f"collective_rpc {name!r} did not finish within its timeout of "
                        f"{timeout:g} s; the workers' call goes on (the engine steps again once "
                        "it ends): raise timeout, or make the call shorter")


class EngineSleepMode:
    """Mixed into `LLMEngine` (llm_engine.py), whose `_core()` these call."""

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's: level 0 pauses scheduling; 1 frees the KV cache and keeps the weights
        (offloaded to host memory on CUDA); 2 also discards the weights. The prefix cache is
        reset. `mode`: requests in flight are ended ("abort"), recomputed after wake_up
        ("keep"), or ("wait") none may be in flight."""
        self._core().sleep(level, mode)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """vLLM's: bring back what `tags` name ("weights", "kv_cache", "scheduling"; None:
        all). After a level-2 sleep the weights must be loaded again (collective_rpc
        "reload_weights" or "load_weights") before the engine steps."""
        self._core().wake_up(None if tags is None else list(tags))

    def is_sleeping(self) -> bool:
        return self._core().is_sleeping()

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's: every worker's `method` (a Worker method's name such as "load_weights",
        "reload_weights", "get_model", or a callable taking the worker first; across processes a
        module-level function) with `args` / `kwargs`, the results in rank order. `timeout`
        (seconds): a call still running then raises TimeoutError naming the method and the
        timeout (vLLM's); the call itself cannot be stopped, and the engine steps again once
        it ends."""
        timeout = check_rpc_timeout(timeout)
        if not isinstance(args, (tuple, list)):
            raise ValueError(f"collective_rpc args must be a tuple, got {type(args).__name__}")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise ValueError(f"collective_rpc kwargs must be a dict, got {type(kwargs).__name__}")
        return self._core().collective_rpc(method, tuple(args), kwargs, timeout)

    def check_awake(self, what: str) -> None:
        """Refuse a batch that could never finish: nothing steps while the engine sleeps or
        weights a level-2 sleep discarded are not loaded again (a server's requests wait)."""
        if not self.kiln_config.model_config.enable_sleep_mode:
            return
        status = self._core().sleep_status()
        if status["asleep"]:
            raise RuntimeError(f"{what}: the engine is sleeping ({', '.join(status['asleep'])} "
                               "asleep); call wake_up() first")
        if status["weights_missing"]:
            raise RuntimeError(f"{what}: {status['weights_missing']} weight(s) discarded by "
                               "sleep(level=2) are not loaded again; call "
                               "collective_rpc('reload_weights') or load them all with "
                               "collective_rpc('load_weights', kwargs={'weights': ...}) (a "
                               "speculative draft's with kwargs={'weights': ..., 'model': "
                               "'draft'})")
