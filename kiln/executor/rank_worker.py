"""`RankWorker`: one rank of a multi-rank engine, in its own process (mp) or Ray actor.

It binds its cores, joins the process groups, builds its `Worker` and answers the executor's
calls; only the output rank (last pipeline stage, first TP rank) returns the sampled tokens.
"""
import dataclasses
import pickle
import time

from kiln import envs
from kiln.distributed import comm_timing
from kiln.logger import init_logger
from kiln.lora.load_failure import LoRALoadError, LoRALoadFailure

logger = init_logger(__name__)

# The executor methods a rank answers (anything else is a programming error in the executor).
METHODS = ("determine_num_blocks", "initialize_cache", "compile_or_warm_up_model",
           "execute_model", "comm_stats", "reset_comm_stats", "compile_stats", "collective_rpc")


class RankWorker:
    def __init__(self, kiln_config, rank: int, local_rank: int, local_world_size: int,
                 init_method: str, float32_matmul_precision: str | None = None):
        """`float32_matmul_precision`: the engine's torch setting, which a rank's own
        interpreter (spawned, or a Ray actor) does not inherit: a GGUF model's float32 kernels
        read it (gguf_matmul.float32_limbs), so every rank computes as a one-rank engine."""
        import torch

        from kiln.distributed.cpu_binding import bind_this_process
        from kiln.distributed.parallel_state import init_distributed
        from kiln.worker.worker import Worker

        if float32_matmul_precision is not None:
            torch.set_float32_matmul_precision(float32_matmul_precision)
        kiln_config = kiln_config.for_rank(rank)  # this rank's view: its own rank, its own layers
        self.rank = rank
        device = kiln_config.device_config.device_obj
        self.cores = None
        if device.type == "cpu":
            self.cores = bind_this_process(envs.cpu_omp_threads_bind(), local_rank,
                                           local_world_size)
        pc = kiln_config.parallel_config
        init_distributed(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size, init_method,
                         device)
        self.is_output_rank = (pc.pp_rank == pc.pipeline_parallel_size - 1 and pc.tp_rank == 0)
        self.worker = Worker(kiln_config, rank=rank, local_rank=local_rank,
                             local_world_size=local_world_size)
        self.worker.init_device()
        self.worker.load_model()
        self.unpickle_seconds = 0.0
        logger.info("rank %d ready (tp rank %d, pp stage %d, cores %s, float32 matmul "
                    "precision %s)", rank, pc.tp_rank, pc.pp_rank,
                    self.cores if self.cores is not None else "unbound",
                    torch.get_float32_matmul_precision())

    def call(self, method: str, args: tuple):
        if method not in METHODS:
            raise ValueError(f"rank {self.rank}: unknown executor call {method!r}")
        if method == "comm_stats":
            from kiln.compilation.counters import compilation_counter

            return {"rank": self.rank, "comm": comm_timing.snapshot(),
                    "scheduler_output_unpickle_s": self.unpickle_seconds,
                    "compilation": dataclasses.asdict(compilation_counter)}
        if method == "compile_stats":  # what `kiln compile` reports, this rank's
            from kiln.compilation.monitor import process_compile_state

            return {"rank": self.rank, **process_compile_state()}
        if method == "reset_comm_stats":
            comm_timing.reset()
            self.unpickle_seconds = 0.0
            return None
        if method == "collective_rpc":  # a worker's error is the caller's, not the rank's end
            from kiln.core.rpc_wire import guarded, rank_result

            return rank_result(guarded(self.worker.collective_rpc, *args))
        try:
            result = getattr(self.worker, method)(*args)
        except LoRALoadError as e:  # every rank's (load_failure.py): the engine ends its requests
            return LoRALoadFailure.of(e)
        if method == "execute_model" and not self.is_output_rank:
            return None  # the output rank's tokens are the step's; the others' are the same
        return result

    def call_pickled(self, payload: bytes):
        """A call whose (method, args) arrive pickled once for every rank by the executor."""
        start = time.perf_counter()
        method, args = pickle.loads(payload)
        self.unpickle_seconds += time.perf_counter() - start
        return self.call(method, args)

    def shutdown(self) -> None:
        from kiln.distributed.parallel_state import destroy_model_parallel

        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
        destroy_model_parallel()
