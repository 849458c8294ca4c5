"""`RayRankActor`: what runs in each rank's Ray actor, the placement facts the executor asks for
first (node, port, GPUs, process), then the rank worker itself, whose calls arrive pickled.
"""
import os


class RayRankActor:
    """The body of one rank's actor: placement facts first, then the rank worker itself."""

    def __init__(self):
        self.worker = None

    def node_ip_and_port(self) -> tuple[str, int]:
        import ray

        from kiln.executor.free_port import free_port

        ip = ray.util.get_node_ip_address()
        return ip, free_port("0.0.0.0")

    def gpu_ids(self) -> list[str]:
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def pid(self) -> int:
        return os.getpid()

    def node_id_and_pid(self) -> tuple[str, int]:
        import ray

        return ray.get_runtime_context().get_node_id(), os.getpid()

    def see_devices(self, visible_devices: str) -> None:
        """CUDA_VISIBLE_DEVICES, in a call of its own before `start`, whose arguments (the
        config) are unpickled before it runs: nothing may initialize CUDA before this."""
        os.environ["CUDA_VISIBLE_DEVICES"] = visible_devices

    def start(self, kiln_config, rank: int, local_rank: int, local_world_size: int,
              init_method: str, float32_matmul_precision: str | None = None) -> None:
        from kiln.executor.rank_worker import RankWorker

        self.worker = RankWorker(kiln_config, rank, local_rank, local_world_size, init_method,
                                 float32_matmul_precision)

    def call_pickled(self, payload: bytes):
        return self.worker.call_pickled(payload)

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
