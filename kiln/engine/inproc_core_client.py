"""`InprocCoreClient`: the engine core in the front end's process (KILN_ENABLE_V1_MULTIPROCESSING=0),
with CoreProcClient's calls (core_client.py), and a watcher that hears a rank die between steps.
"""
import os
import threading
from collections.abc import Sequence

from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import Request, RequestStatus
from kiln.core.stats import SchedulerStats
from kiln.engine.engine_sleep import rpc_timed_out


class InprocCoreClient:
    """The core in this process (KILN_ENABLE_V1_MULTIPROCESSING=0): for debugging and tests that
    look inside the executor."""

    def __init__(self, kiln_config, executor_class: type):
        import torch

        from kiln.core.engine_core import EngineCore

        self._core = EngineCore(kiln_config, executor_class)
        self._late: threading.Thread | None = None  # a collective_rpc past its timeout
        self.executor = self._core.executor
        self.startup_timings = dict(self.core.startup_timings)
        self.pid = os.getpid()
        self.num_blocks = self.core.num_blocks  # the KV cache's size, in blocks
        self.max_model_len = self.core.max_model_len  # the config's, or what the cache holds
        self.num_threads = torch.get_num_threads()
        self._death_callbacks: list = []
        self._watcher: threading.Thread | None = None
        self._closing = threading.Event()
        self._wake: tuple[int, int] | None = None  # a pipe that wakes the watcher at shutdown

    @property
    def core(self):
        """The EngineCore, once a collective_rpc that outlived its timeout has ended: nothing
        else runs beside it (as in the core's own process, which runs one call at a time)."""
        if self._late is not None:
            self._late.join()
            self._late = None
        return self._core

    def add_request(self, request: Request, child_ids: Sequence[str] = ()) -> None:
        self.core.add_request(request, child_ids)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.core.abort_requests(req_ids)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        self.core.finish_requests(req_ids, status)

    def step(self) -> list[list[EngineCoreOutput]]:
        """One core step's outputs, as a list of one step (CoreProcClient.step's shape)."""
        return [self.core.step()]

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        return self.core.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int, mode: str) -> None:
        self.core.sleep(level, mode)

    def wake_up(self, tags: list[str] | None) -> None:
        self.core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.core.is_sleeping()

    def sleep_status(self) -> dict:
        return self.core.sleep_status()

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """With a `timeout`, the call runs on a thread of its own: past it, TimeoutError, and
        the call runs on (its result or error dropped) until `core` is next wanted. An earlier
        call still running counts against the timeout (the core's process, running one call
        at a time, answers it as late): this one runs once that one ends."""
        if timeout is None:
            return self.core.collective_rpc(method, args, kwargs)
        earlier, self._late = self._late, None
        outcome = {}

        def call():
            if earlier is not None:
                earlier.join()
            try:
                outcome["result"] = self._core.collective_rpc(method, args, kwargs)
            except BaseException as e:  # noqa: BLE001 - raised on the caller's thread
                outcome["error"] = e

        thread = threading.Thread(target=call, name="kiln-collective-rpc", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            self._late = thread  # after `earlier`: waiting for it waits for both
            raise rpc_timed_out(method, timeout)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    def make_stats(self) -> SchedulerStats:
        return self.core.make_stats()

    step_stats = make_stats  # in-process, the stats are always those after the last step

    def add_death_callback(self, callback) -> None:
        """`callback(error)` on a watcher thread once a rank dies, also while no step runs (a
        step finds a death during it itself): the core process watches its ranks so, and an
        idle server on this core would otherwise answer /health 200 with a rank gone."""
        self._death_callbacks.append(callback)
        if self._watcher is None:
            self._wake = os.pipe()
            self._watcher = threading.Thread(target=self._watch_ranks, name="kiln-rank-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch_ranks(self) -> None:
        from multiprocessing.connection import wait

        sentinels = list(self.executor.rank_sentinels())
        every = self.executor.idle_check_s  # ranks without sentinels (Ray) are polled
        if not sentinels and every is None:
            return
        while not self._closing.is_set():
            fired = wait([*sentinels, self._wake[0]], timeout=every)
            if self._closing.is_set():
                return
            sentinels = [s for s in sentinels if s not in fired]  # each death is told once
            try:
                self.executor.check_health()
            except Exception as e:  # noqa: BLE001 - the death, told to the callbacks
                if not self._closing.is_set():
                    for callback in self._death_callbacks:
                        callback(e)
                return

    def shutdown(self, timeout: float | None = None) -> None:
        """`timeout` (vLLM's) has nothing to bound here: no core process to wait for."""
        if self._closing.is_set():
            return
        self._closing.set()  # the ranks' exits below are no deaths to report
        if self._wake is not None:
            os.write(self._wake[1], b"x")
        self.core.shutdown()
        if self._watcher is not None:
            self._watcher.join(5)
            for fd in self._wake:
                os.close(fd)
