"""`DPCoreClient`: vLLM's data parallel on one machine: N engine core replicas, each a
CoreProcClient with its own executor (tp x pp ranks), new requests sent to the least loaded one.

It offers CoreProcClient's calls, so LLMEngine drives it the same way: a request's abort and
finish go to the replica that has it; utility calls (sleep, reset_prefix_cache, collective_rpc)
go to every replica (collective_rpc returns replica 0's results, as vLLM's); stats add up over
replicas and keep each one's (`engines`).
"""
import dataclasses
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import zmq

from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import Request, RequestStatus
from kiln.core.stats import SchedulerStats
from kiln.engine.core_client import _STEP_WAIT_MS, CoreProcClient
from kiln.engine.core_errors import EngineCoreDeadError, engine_gone
from kiln.engine.dp_balance import pick_replica, replica_load
from kiln.engine.dp_placement import replica_placement, visible_cuda_devices
from kiln.errors import ConfigError


@dataclasses.dataclass
class DPSchedulerStats(SchedulerStats):
    """The replicas' stats added up, and each replica's own (`engines`, by replica index)."""
    engines: list[dict] = dataclasses.field(default_factory=list)


def merged_stats(per_engine: Sequence[SchedulerStats]) -> DPSchedulerStats:
    """Counts and totals add up; KV cache usage is over all replicas' blocks; the adapters in
    use are each named once."""
    out = DPSchedulerStats(engines=[s.to_dict() for s in per_engine])
    for f in dataclasses.fields(SchedulerStats):
        values = [getattr(s, f.name) for s in per_engine]
        if f.name == "kv_cache_usage":
            blocks = sum(s.num_total_blocks for s in per_engine)
            value = (sum(s.kv_cache_usage * s.num_total_blocks for s in per_engine) / blocks
                     if blocks else 0.0)
        elif f.name == "spec_decode_num_accepted_tokens_per_pos":
            width = max((len(v) for v in values), default=0)
            value = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
        elif f.name.endswith("lora_adapters"):
            value = sorted({name for v in values for name in v})
        else:
            value = sum(values)
        setattr(out, f.name, value)
    return out


class DPCoreClient:
    """N CoreProcClients, one per data-parallel replica, started together."""

    def __init__(self, kiln_config, executor_class: type, front_end_cores: int = 0):
        from kiln.engine.core_interpreter import CoreInterpreter

        pc = kiln_config.parallel_config
        cuda = (visible_cuda_devices() if kiln_config.device_config.device_obj.type == "cuda"
                else None)
        self.clients: list[CoreProcClient] = []
        try:
            for i in range(pc.data_parallel_size):
                env, cores = replica_placement(i, kiln_config, sorted(os.sched_getaffinity(0)),
                                               front_end_cores, cuda)
                replica_config = kiln_config.thawed_copy()
                replica_config.parallel_config = dataclasses.replace(pc, data_parallel_rank=i)
                replica_config.parallel_config.freeze()
                replica_config.freeze()
                # The front end's cores were kept out of the replicas' shares already.
                self.clients.append(CoreProcClient(
                    replica_config, executor_class, CoreInterpreter(env, cores),
                    0 if cores is not None else front_end_cores))
        except BaseException:
            self.shutdown()
            raise
        # Per replica: the num_sent of each add its latest stats have not seen yet.
        self._unseen: list[list[int]] = [[] for _ in self.clients]
        self._turn = 0  # where ties start: equal replicas take new requests in turn
        self.last_step_engines: list[int] = []  # the replica of each of step()'s last steps
        self.startup_timings: dict = {}

    def wait_until_ready(self) -> None:
        try:
            for client in self.clients:
                client.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        first = self.clients[0]
        self.startup_timings = first.startup_timings
        # Every replica holds what the least of them does.
        self.num_blocks = min(c.num_blocks for c in self.clients)
        self.max_model_len = min(c.max_model_len for c in self.clients)
        self.num_threads = first.num_threads
        self.pid = first.pid
        self.pids = [c.pid for c in self.clients]

    # ---- requests ----------------------------------------------------------------------------
    def loads(self) -> list[tuple[int, int]]:
        """(waiting, running) per replica, as dp_balance.replica_load reckons them."""
        out = []
        for client, unseen in zip(self.clients, self._unseen):
            unseen[:] = [n for n in unseen if n > client.stats_inputs_handled]
            stats = client.step_stats()
            out.append(replica_load(stats.num_waiting, stats.num_running, len(unseen),
                                    client.num_unfinished))
        return out

    def add_request(self, request: Request, child_ids: Sequence[str] = ()) -> int:
        """Send it to the least loaded replica; returns that replica's index."""
        index = pick_replica(self.loads(), self._turn)
        self._turn = (index + 1) % len(self.clients)
        client = self.clients[index]
        try:
            client.add_request(request, child_ids)
        except Exception as e:
            if engine_gone(e):
                raise self._named_error(index, e) from e
            raise
        self._unseen[index].extend([client.num_sent] * max(1, len(child_ids)))
        return index

    def replica_of(self, req_id: str) -> int | None:
        """The replica that has `req_id` (a core request id) unfinished; None: none has."""
        return next((i for i, c in enumerate(self.clients) if c.owns(req_id)), None)

    def _by_replica(self, req_ids) -> dict[int, list[str]]:
        req_ids = [req_ids] if isinstance(req_ids, str) else list(req_ids)
        out: dict[int, list[str]] = {}
        for req_id in req_ids:
            index = self.replica_of(req_id)
            if index is not None:  # finished already: nothing of it is left anywhere
                out.setdefault(index, []).append(req_id)
        return out

    def abort_requests(self, req_ids: list[str]) -> None:
        for index, ids in self._by_replica(req_ids).items():
            self.clients[index].abort_requests(ids)

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> None:
        for index, ids in self._by_replica(req_ids).items():
            self.clients[index].finish_requests(ids, status)

    def has_unfinished_requests(self) -> bool:
        return any(c.has_unfinished_requests() for c in self.clients)

    def step(self) -> list[list[EngineCoreOutput]]:
        """Every replica's core steps since the last call, waiting up to _STEP_WAIT_MS for one
        of them (any replica's outputs or death ends the wait)."""
        busy = [c for c in self.clients if c.has_unfinished_requests()]
        steps = self._steps(busy)
        if steps or not busy:
            return steps
        poller = zmq.Poller()
        for c in busy:
            poller.register(c._output, zmq.POLLIN)
            poller.register(c._sentinel, zmq.POLLIN)
        locks = [c._reading for c in busy]  # the exit watcher may read a socket too
        for lock in locks:
            lock.acquire()
        try:
            poller.poll(_STEP_WAIT_MS)
        finally:
            for lock in locks:
                lock.release()
        return self._steps(busy)

    def _steps(self, busy: list[CoreProcClient]) -> list[list[EngineCoreOutput]]:
        """The `busy` replicas' steps so far, noting each one's replica (last_step_engines)."""
        steps, self.last_step_engines = [], []
        for client in busy:
            mine = self._step(client)
            steps += mine
            self.last_step_engines += [self.clients.index(client)] * len(mine)
        return steps

    def _step(self, client: CoreProcClient) -> list[list[EngineCoreOutput]]:
        """The replica's steps so far; its death raised naming it."""
        try:
            return client.step(0)
        except Exception as e:
            if engine_gone(e):
                raise self._named_error(self.clients.index(client), e) from e
            raise

    # ---- utility calls: every replica --------------------------------------------------------
    def _each(self, method: str, *args) -> list:
        return [getattr(c, method)(*args) for c in self.clients]

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        return all(self._each("reset_prefix_cache", reset_running_requests, reset_connector))

    def sleep(self, level: int, mode: str) -> None:
        self._each("sleep", level, mode)

    def wake_up(self, tags: list[str] | None) -> None:
        self._each("wake_up", tags)

    def is_sleeping(self) -> bool:
        return any(self._each("is_sleeping"))

    def sleep_status(self) -> dict:
        """What any replica has asleep or missing (a batch must wait for every one)."""
        statuses = self._each("sleep_status")
        merged = dict(statuses[0])
        merged["asleep"] = sorted({tag for s in statuses for tag in s["asleep"]})
        merged["weights_missing"] = max(s["weights_missing"] for s in statuses)
        return merged

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None,
                       timeout: float | None = None) -> list:
        """Runs on every rank of every replica; returns replica 0's results, one per rank, as
        vLLM's data-parallel client (each replica holds the same model, and a caller written
        for one engine gets world_size results). The replicas run it at once, as vLLM's
        (`timeout` bounds each): one after another, a timeout fit for one engine ran out with
        two, and a replica past it left the later ones without the call."""
        with ThreadPoolExecutor(len(self.clients), thread_name_prefix="kiln-dp-rpc") as pool:
            calls = [pool.submit(client.collective_rpc, method, args, kwargs, timeout)
                     for client in self.clients]
            results = [call.result() for call in calls]
        return results[0]

    def make_stats(self) -> DPSchedulerStats:
        return merged_stats(self._each("make_stats"))

    def step_stats(self) -> DPSchedulerStats:
        return merged_stats(self._each("step_stats"))

    # ---- life and death ----------------------------------------------------------------------
    def add_death_callback(self, callback) -> None:
        """`callback(error)` once any replica's core dies unasked, naming the replica: the
        others' requests end too (vLLM's server goes down with one engine)."""
        for index, client in enumerate(self.clients):
            client.add_death_callback(self._named(index, callback))

    def _named(self, index: int, callback):
        def told(error: BaseException) -> None:
            callback(self._named_error(index, error))
        return told

    def _named_error(self, index: int, error: BaseException) -> EngineCoreDeadError:
        named = EngineCoreDeadError(f"data-parallel engine {index} of {len(self.clients)} (pid "
                                    f"{self.clients[index].pid}) died: {error}")
        named.__cause__ = error
        return named

    def shutdown(self, timeout: float | None = None) -> None:
        """Every replica at once: each waits for its core's goodbye (up to `timeout` s)."""
        clients = [c for c in getattr(self, "clients", ()) if c is not None]
        if len(clients) <= 1:
            for c in clients:
                c.shutdown(timeout)
            return
        with ThreadPoolExecutor(len(clients), thread_name_prefix="kiln-dp-stop") as pool:
            list(pool.map(lambda c: c.shutdown(timeout), clients))



def start_core_process(kiln_config, executor_class: type, core_interpreter,
                       front_end_cores: int, multiprocess: bool):
    """LLMEngine's core client being started: the core process, one per replica with data
    parallel; None for an in-process core (which data parallel cannot be)."""
    dp = kiln_config.parallel_config.data_parallel_size
    if dp > 1 and core_interpreter is not None:  # each replica's starts with its own placement
        core_interpreter.discard()
    if not multiprocess:
        if dp > 1:
            raise ConfigError(f"data_parallel_size {dp} runs each replica in a process of its "
                              "own; unset KILN_ENABLE_V1_MULTIPROCESSING=0 (or use "
                              "data_parallel_size=1)")
        return None
    if dp == 1:
        return CoreProcClient(kiln_config, executor_class, core_interpreter, front_end_cores)
    return DPCoreClient(kiln_config, executor_class, front_end_cores)
