"""`RayExecutor`: the same rank workers as Ray actors, one per bundle of a placement group, so
ranks can live on several machines (`ray start --head` / `ray start --address`, then
`kiln serve -tp N -pp M --distributed-executor-backend ray`).

It joins the cluster at RAY_ADDRESS when set (else starts a local Ray); a placement the cluster
cannot hold fails at once, and one that waits for resources says so. Each call's arguments are
pickled once and put in Ray's object store for every rank; a dead actor, or a step some rank does
not answer within KILN_EXECUTE_MODEL_TIMEOUT_SECONDS, fails the call with an error naming the
rank (and, for a rank on this machine, why: stopped, stuck in the kernel), and the executor then
stops every actor. The engine's KILN_* settings go with each actor
(as vLLM copies VLLM_* to its Ray workers): an actor's process is the cluster's, started with the
environment of `ray start`, not the engine's.
"""
import os
import pickle
import signal
import threading
import time

import msgspec

from kiln import envs
from kiln.core.core_messages import failure_report
from kiln.distributed.model_split import check_parallel_split
from kiln.executor.abstract import RankFanOutExecutor
from kiln.executor.rank_errors import (
    STARTUP_TIMEOUT_S,
    WorkerFailedError,
    past,
    startup_error,
    unanswered_message,
    wait_slice,
)
from kiln.executor.ray_placement import (
    check_ray_address,
    kiln_env_vars,
    local_ranks,
    never_fits,
    node_visible_devices,
    placement_error,
    wait_for_placement,
)
from kiln.executor.ray_rank_actor import RayRankActor
from kiln.logger import init_logger

logger = init_logger(__name__)

# How long a rank's error waits for a peer's death to show: a killed rank's peers fail their
# collective at once (gloo: "Connection reset by peer"), and that error can reach the engine
# before Ray has seen the actor die (the raylet tells the owner through the GCS).
PEER_DEATH_S = 2.0


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install "
                          "'kiln-llm[ray]' (or use --distributed-executor-backend mp on one "
                          "machine)") from None
    return ray


def _init_keeping_sigterm(ray) -> None:
    """ray.init (RAY_ADDRESS, when set, names the cluster), keeping this process's SIGTERM
    handler: Ray's driver puts in its own (print a stack, then abort), which killed an engine
    core that leaves the group's SIGTERM to its front end (kiln/process_signals.py)."""
    check_ray_address(os.environ.get("RAY_ADDRESS"))  # else ray.init waits on it for good
    handler = signal.getsignal(signal.SIGTERM)
    ray.init(ignore_reinit_error=True)
    if handler is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)


class RayExecutor(RankFanOutExecutor):
    idle_check_s = 1.0  # one ping per actor a second: next to nothing beside Ray's own RPCs

    def __init__(self, kiln_config):
        super().__init__(kiln_config)
        check_parallel_split(kiln_config)
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = kiln_config.parallel_config
        self.world_size = pc.world_size
        self.step_timeout_s = envs.execute_model_timeout_s()  # checked before any rank starts
        self.failure: str | None = None
        self.actors: list = []
        # Rank -> process id of the ranks on this machine, so a rank that does not answer is
        # named with why where /proc tells (stopped, stuck in the kernel), as mp names it.
        self.local_pids: dict[int, int] = {}
        self.pg = None
        self.broadcast_seconds, self.broadcast_calls = 0.0, 0
        # Health pings in flight (ref -> rank) and when they were sent: check_health.
        self._pings: dict = {}
        self._pinged_at = 0.0
        # A local Ray this executor starts is its to stop: an engine core leaves by os._exit,
        # which runs no atexit handler, and Ray's agents outlived it by a minute or more.
        self.started_ray = not ray.is_initialized()
        if self.started_ray:
            _init_keeping_sigterm(ray)
        device = kiln_config.device_config.device_obj
        bundle = {"GPU": 1, "CPU": 1} if device.type == "cuda" else {"CPU": 1}
        bundles = [dict(bundle) for _ in range(self.world_size)]
        if never_fits(bundles, ray.cluster_resources()):  # Ray would wait for nothing
            error = placement_error(bundles, "the whole cluster holds less",
                                    ray.cluster_resources(), ray.available_resources())
            self.shutdown()
            raise error
        self.pg = placement_group(bundles, strategy="PACK")
        try:
            wait_for_placement(ray, self.pg, bundles, STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        actor_cls = ray.remote(RayRankActor)
        env_vars = kiln_env_vars(os.environ)
        runtime_env = {"env_vars": env_vars} if env_vars else None
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=strategy, runtime_env=runtime_env, name=None).remote())
        try:
            places = self._gather([a.node_ip_and_port.remote() for a in self.actors],
                                  "placement")
            init_method = f"tcp://{places[0][0]}:{places[0][1]}"
            ips = [ip for ip, _ in places]
            self.local_pids = self._local_pids()
            if device.type == "cuda":
                visible = node_visible_devices(
                    ips, self._gather([a.gpu_ids.remote() for a in self.actors], "placement"))
                self._gather([a.see_devices.remote(v) for a, v in zip(self.actors, visible)],
                             "placement")
            import torch

            precision = torch.get_float32_matmul_precision()  # an actor starts at torch's
            self._gather([actor.start.remote(kiln_config, rank, lr, lw, init_method, precision)
                          for rank, (actor, (lr, lw)) in enumerate(
                              zip(self.actors, local_ranks(ips)))],
                         "start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray ranks started (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def _local_pids(self) -> dict[int, int]:
        """Rank -> process id of the ranks on this node (another node's pid means nothing to
        this machine's /proc)."""
        here = self.ray.get_runtime_context().get_node_id()
        nodes = self._gather([a.node_id_and_pid.remote() for a in self.actors], "placement")
        return {rank: pid for rank, (node, pid) in enumerate(nodes) if node == here}

    def _fail(self, message: str) -> None:
        self.failure = message
        logger.error("%s; stopping every rank", message)
        self.shutdown(graceful=False)
        raise WorkerFailedError(message)

    def _fail_with(self, e, rank: int, what: str) -> None:
        """A rank's call raised `e` (Ray's RayTaskError around it): the user's error raised as
        itself, in one line (rank_errors.py), any other as WorkerFailedError."""
        cause = getattr(e, "cause", None)
        error = None
        if isinstance(cause, BaseException):
            report = msgspec.structs.replace(failure_report(cause), traceback=str(e))
            error = startup_error(report, rank, what)
        if error is None:
            self._fail(f"worker rank {rank} failed during {what}:\n{e}")
        self.failure = f"worker rank {rank} failed during {what}: {error}"
        self.shutdown(graceful=False)
        raise error

    def check_health(self) -> None:
        """Non-blocking: read the pings sent last time (a dead actor's fails at once), then
        ping again once all have answered; one unanswered past the step timeout is a stuck
        rank."""
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's workers are gone: {self.failure}")
        ray = self.ray
        if self._pings:
            ready, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
            for ref in ready:
                rank = self._pings.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as e:
                    self._fail(f"worker rank {rank} (Ray actor) died between steps: "
                               f"{str(e).splitlines()[0]}")
            waited = time.monotonic() - self._pinged_at
            if self._pings and waited > self.step_timeout_s:
                self._fail(unanswered_message("a health check between steps",
                                              sorted(self._pings.values()), self.step_timeout_s,
                                              self.local_pids))
        if not self._pings:
            self._pings = {actor.pid.remote(): rank for rank, actor in enumerate(self.actors)}
            self._pinged_at = time.monotonic()

    def _gather(self, refs: list, what: str, timeout: float | None = None) -> list:
        """Each rank's result in rank order; the first rank whose call failed is named, as are
        the ranks that did not answer within `timeout` s."""
        ray = self.ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=wait_slice(deadline))
            if not ready and not past(deadline):
                continue  # one slice of a very long timeout
            if not ready:
                self._fail(unanswered_message(what, sorted(pending.values()), timeout,
                                              self.local_pids))
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"worker rank {rank} (Ray actor) died during {what}: "
                               f"{str(e).splitlines()[0]}")
                except ray.exceptions.RayTaskError as e:
                    dead = self._dead_rank(pending)  # the cause, where a peer died
                    if dead is not None:
                        self._fail(f"worker rank {dead[0]} (Ray actor) died during {what}: "
                                   f"{dead[1]}")
                    self._fail_with(e, rank, what)
        return [results[r] for r in range(len(refs))]

    def _dead_rank(self, pending: dict) -> tuple[int, str] | None:
        """A rank of `pending` (its call's ref -> rank) whose actor died, and Ray's line on it,
        waiting up to PEER_DEATH_S for one; None if none did."""
        ray = self.ray
        left = dict(pending)
        deadline = time.monotonic() + PEER_DEATH_S
        while left and (wait_s := deadline - time.monotonic()) > 0:
            for ref in ray.wait(list(left), num_returns=1, timeout=wait_s)[0]:
                rank = left.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    return rank, str(e).splitlines()[0]
                except ray.exceptions.RayError:
                    pass  # another rank's own error, or the same peer's death seen by it
        return None

    def _run_on_all(self, method: str, *args) -> list:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's workers are gone: {self.failure}")
        start = time.perf_counter()
        payload = self.ray.put(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        refs = [actor.call_pickled.remote(payload) for actor in self.actors]
        if method == "execute_model":
            self.broadcast_seconds += time.perf_counter() - start
            self.broadcast_calls += 1
        timeout = self.step_timeout_s if method == "execute_model" else None
        return self._gather(refs, method, timeout)

    def shutdown(self, graceful: bool = True) -> None:
        ray = self.ray
        if graceful and self.failure is None and self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=30)
            except Exception:  # a rank already gone: killing below is all that is left
                pass
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.pg is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
        if self.started_ray:  # (joined through RAY_ADDRESS: this only leaves the cluster)
            ray.shutdown()
            self.started_ray = False
