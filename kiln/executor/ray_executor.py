"""`RayExecutor`: the same rank workers as Ray actors, one per bundle of a placement group, so
ranks can live on several machines (`ray start --head` / `ray start --address`, then
`kiln serve -tp N -pp M --distributed-executor-backend ray`).

It joins the cluster at RAY_ADDRESS when set (else starts a local Ray). Each call's arguments
are pickled once and put in Ray's object store for every rank; a dead actor fails the call with
an error naming its rank, and the executor then stops every actor.
"""
import os
import pickle
import time

from kiln.core.outputs import ModelRunnerOutput, SchedulerOutput
from kiln.distributed.model_split import check_parallel_split
from kiln.executor.abstract import Executor
from kiln.executor.multiproc_executor import STARTUP_TIMEOUT_S, WorkerFailedError
from kiln.logger import init_logger

logger = init_logger(__name__)


def import_ray():
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install "
                          "'kiln-llm[ray]' (or use --distributed-executor-backend mp on one "
                          "machine)") from None
    return ray


class RayRankActor:
    """The body of one rank's actor: placement facts first, then the rank worker itself."""

    def __init__(self):
        self.worker = None

    def node_ip_and_port(self) -> tuple[str, int]:
        import ray

        from kiln.executor.free_port import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def pid(self) -> int:
        return os.getpid()

    def start(self, kiln_config, rank: int, local_rank: int, local_world_size: int,
              init_method: str) -> None:
        from kiln.executor.rank_worker import RankWorker

        self.worker = RankWorker(kiln_config, rank, local_rank, local_world_size, init_method)

    def call_pickled(self, payload: bytes):
        return self.worker.call_pickled(payload)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


def local_ranks(node_ips: list[str]) -> list[tuple[int, int]]:
    """(local rank, ranks on that machine) for each global rank, from each rank's node IP."""
    out = []
    for rank, ip in enumerate(node_ips):
        same = [r for r, other in enumerate(node_ips) if other == ip]
        out.append((same.index(rank), len(same)))
    return out


class RayExecutor(Executor):
    def __init__(self, kiln_config):
        super().__init__(kiln_config)
        check_parallel_split(kiln_config)
        ray = self.ray = import_ray()
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pc = kiln_config.parallel_config
        self.world_size = pc.world_size
        self.failure: str | None = None
        self.actors: list = []
        self.broadcast_seconds, self.broadcast_calls = 0.0, 0
        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True)  # RAY_ADDRESS, when set, names the cluster
        device = kiln_config.device_config.device_obj
        bundle = {"GPU": 1, "CPU": 1} if device.type == "cuda" else {"CPU": 1}
        self.pg = placement_group([dict(bundle) for _ in range(self.world_size)],
                                  strategy="PACK")
        try:
            ray.get(self.pg.ready(), timeout=STARTUP_TIMEOUT_S)
        except Exception as e:
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"Ray could not place {self.world_size} ranks of {bundle} "
                               f"(cluster resources: {ray.cluster_resources()}): {e}") from None
        actor_cls = ray.remote(RayRankActor)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                        placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(
                num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=strategy, name=None).remote())
        try:
            places = self._gather([a.node_ip_and_port.remote() for a in self.actors],
                                  "placement")
            init_method = f"tcp://{places[0][0]}:{places[0][1]}"
            self._gather([actor.start.remote(kiln_config, rank, lr, lw, init_method)
                          for rank, (actor, (lr, lw)) in enumerate(
                              zip(self.actors, local_ranks([ip for ip, _ in places])))],
                         "start-up")
        except BaseException:
            self.shutdown()
            raise
        logger.info("%d Ray ranks started (tensor_parallel_size=%d, pipeline_parallel_size=%d)",
                    self.world_size, pc.tensor_parallel_size, pc.pipeline_parallel_size)

    def _fail(self, message: str) -> None:
        self.failure = message
        logger.error("%s; stopping every rank", message)
        self.shutdown(graceful=False)
        raise WorkerFailedError(message)

    def _gather(self, refs: list, what: str) -> list:
        """Each rank's result in rank order; the first rank whose call failed is named."""
        ray = self.ray
        pending = {ref: rank for rank, ref in enumerate(refs)}
        results = {}
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(f"worker rank {rank} (Ray actor) died during {what}: "
                               f"{str(e).splitlines()[0]}")
                except ray.exceptions.RayTaskError as e:
                    self._fail(f"worker rank {rank} failed during {what}:\n{e}")
        return [results[r] for r in range(len(refs))]

    def _run_on_all(self, method: str, *args) -> list:
        if self.failure is not None:
            raise WorkerFailedError(f"the engine's workers are gone: {self.failure}")
        start = time.perf_counter()
        payload = self.ray.put(pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL))
        refs = [actor.call_pickled.remote(payload) for actor in self.actors]
        if method == "execute_model":
            self.broadcast_seconds += time.perf_counter() - start
            self.broadcast_calls += 1
        return self._gather(refs, method)

    def determine_num_blocks(self) -> int:
        return min(self._run_on_all("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self._run_on_all("initialize_cache", num_blocks)

    def compile_or_warm_up_model(self) -> None:
        self._run_on_all("compile_or_warm_up_model")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return next(r for r in self._run_on_all("execute_model", scheduler_output)
                    if r is not None)

    def comm_stats(self) -> dict:
        return {"world_size": self.world_size,
                "scheduler_output_broadcast_s": self.broadcast_seconds,
                "scheduler_output_broadcasts": self.broadcast_calls,
                "ranks": self._run_on_all("comm_stats")}

    def reset_comm_stats(self) -> None:
        self._run_on_all("reset_comm_stats")
        self.broadcast_seconds, self.broadcast_calls = 0.0, 0

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
        if getattr(self, "pg", None) is not None:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
