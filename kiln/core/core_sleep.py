"""The engine core's sleep mode (vLLM's `sleep(level, mode)` / `wake_up(tags)`) and its
collective_rpc: what happens to requests in flight, scheduling paused while anything sleeps or
weights a level-2 sleep discarded are not loaded again, and the workers told.

Requests that arrive while the engine sleeps wait in the queue until it wakes (vLLM's paused
scheduler); `LLM.generate` refuses instead, since nothing could wake the engine during it.
"""
from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import RequestStatus
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

LEVELS = (0, 1, 2)
MODES = ("abort", "wait", "keep")
TAGS = ("weights", "kv_cache", "scheduling")
# collective_rpc methods after which the prefix cache's K/V is stale
_NEW_WEIGHTS = ("load_weights", "reload_weights")


def check_sleep(level, mode, enabled: bool, num_in_flight: int) -> None:
    """vLLM's sleep arguments, refused with what to pass instead."""
    if isinstance(level, bool) or level not in LEVELS:
        raise ValueError(f"sleep level must be 0 (pause scheduling), 1 (free the KV cache, keep "
                         f"the weights) or 2 (free the KV cache and discard the weights), got "
                         f"{level!r}")
    if mode not in MODES:
        raise ValueError(f"sleep mode must be one of {list(MODES)}, got {mode!r}")
    if level >= 1 and not enabled:
        raise ConfigError(f"sleep(level={level}) needs sleep mode: start the engine with "
                          "enable_sleep_mode=True (--enable-sleep-mode)")
    if mode == "wait" and num_in_flight:
        raise ValueError(f"sleep(mode='wait') with {num_in_flight} request(s) in flight: Kiln "
                         "does not hold new requests while those finish; wait for them, or "
                         "sleep with mode='abort' (end them) or 'keep' (recompute them after "
                         "wake_up)")


def check_tags(tags) -> tuple[str, ...]:
    """vLLM's wake_up tags: None (everything) or a list of "weights", "kv_cache",
    "scheduling"."""
    if tags is None:
        return TAGS
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ValueError(f"wake_up tags must be a list of {list(TAGS)} (or None for all), got "
                         f"{tags!r}")
    unknown = sorted(set(tags) - set(TAGS))
    if unknown:
        raise ValueError(f"unknown wake_up tag(s) {unknown}; tags are {list(TAGS)}")
    return tuple(t for t in TAGS if t in tags)


class CoreSleepMode:
    """Mixed into `EngineCore` (engine_core.py): its scheduler, executor and config."""

    asleep: frozenset = frozenset()  # TAGS whose resources are given back / paused
    weights_missing = 0  # discarded by a level-2 sleep and not loaded again
    _memory_sleep = False  # a level 1 or 2 sleep (not only a level-0 pause) is in force
    _sleep_outputs: list = []  # requests a sleep ended, not yet reported

    @property
    def paused(self) -> bool:
        return bool(self.asleep) or self.weights_missing > 0

    def has_work(self) -> bool:
        """Whether a step would do anything now (the core loop waits idle otherwise)."""
        return bool(self._sleep_outputs) or (self.scheduler.has_unfinished_requests()
                                             and not self.paused)

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        scheduler = self.scheduler
        check_sleep(level, mode, self.kiln_config.model_config.enable_sleep_mode,
                    scheduler.get_num_unfinished_requests())
        if self.asleep - {"scheduling"}:
            logger.warning("sleep(level=%d): the engine is already asleep", level)
            return
        if mode == "abort":
            ids = list(scheduler.requests)
            scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._sleep_outputs = [*self._sleep_outputs, *(
                EngineCoreOutput(request_id=i, new_token_ids=[], finish_reason="abort")
                for i in ids)]
        elif level >= 1:  # "keep": recomputed after wake_up, as a preempted request is
            scheduler.reset_prefix_cache(reset_running_requests=True)
        if level == 0:
            self.asleep = self.asleep | {"scheduling"}
            return
        scheduler.kv_cache_manager.reset_prefix_cache()  # its blocks' K/V is about to go
        self.executor.collective_rpc("sleep", (level,))
        self.asleep, self._memory_sleep = frozenset(TAGS), True
        self._refresh_weights_missing()
        logger.info("engine asleep at level %d", level)

    def wake_up(self, tags=None) -> None:
        tags = check_tags(tags)
        worker_tags = [t for t in tags if t != "scheduling" and t in self.asleep]
        if worker_tags:
            self.executor.collective_rpc("wake_up", (worker_tags,))
        self.asleep = self.asleep - set(tags)
        if self.asleep == {"scheduling"} and self._memory_sleep:
            # a level 1/2 sleep paused it: it resumes once the memory is back (vLLM's); a level
            # 0 pause waits for its own tag
            self.asleep = frozenset()
        if not self.asleep & {"weights", "kv_cache"}:
            self._memory_sleep = False
        self._refresh_weights_missing()
        if not self.asleep:
            logger.info("engine awake%s", f"; {self.weights_missing} weight(s) to load before "
                        "it steps" if self.weights_missing else "")

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def sleep_status(self) -> dict:
        """What keeps the engine from stepping: the tags asleep, the weights to load."""
        return {"asleep": sorted(self.asleep), "weights_missing": self.weights_missing}

    def collective_rpc(self, method, args=(), kwargs=None) -> list:
        if method in ("sleep", "wake_up"):  # the core must know, to pause its scheduling
            raise ValueError(f"collective_rpc({method!r}): call the engine's {method}() "
                             "(LLM.sleep / LLM.wake_up), which tells every worker")
        scales = self.executor.collective_rpc("kv_cache_scales")
        try:
            results = self.executor.collective_rpc(method, tuple(args), kwargs)
        except BaseException:
            # a load that failed part way may have changed some; its own error is the one the
            # caller gets, a failure to check after it only logged
            try:
                self._forget_stale_kv(method, scales)
            except Exception:
                logger.exception("checking the KV cache scales after collective_rpc(%r) "
                                 "failed too; its own error follows", method)
            raise
        self._forget_stale_kv(method, scales)
        self._refresh_weights_missing()
        return results

    def _forget_stale_kv(self, method, scales_before: list) -> None:
        """After a worker call: a layer's new k_scale / v_scale would decode every block its
        cache holds, written as x / old scale, wrong (running requests' own blocks too), so
        those requests are recomputed (vLLM leaves this to the caller's reset_prefix_cache);
        new weights with the same scales leave cached blocks stale, not wrong: only those
        no request holds are forgotten (running requests keep theirs, as in vLLM)."""
        try:
            changed = self.executor.collective_rpc("kv_cache_scales") != scales_before
        except Exception:  # scales unknown: taken as changed, no block read with the wrong one
            self._recompute_under_new_scales(method)
            raise
        if changed:
            self._recompute_under_new_scales(method)
        elif method in _NEW_WEIGHTS:
            self.scheduler.kv_cache_manager.reset_prefix_cache()

    def _recompute_under_new_scales(self, method) -> None:
        logger.info("collective_rpc(%r) changed the KV cache scales (or they could not be read "
                    "back): the prefix cache is reset and running requests are recomputed",
                    method)
        if not self.scheduler.reset_prefix_cache(reset_running_requests=True):
            logger.warning("the prefix cache could not be reset after the KV cache scales "
                           "changed")

    def _refresh_weights_missing(self) -> None:
        if self.kiln_config.model_config.enable_sleep_mode:
            self.weights_missing = sum(self.executor.collective_rpc("weights_missing"))

    def take_sleep_outputs(self) -> list:
        outputs, self._sleep_outputs = self._sleep_outputs, []
        return outputs
