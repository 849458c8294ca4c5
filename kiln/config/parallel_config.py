"""Parallelism configuration: tensor / pipeline parallel sizes, executor backend, this rank, and
the data-parallel replicas (each a whole engine core of tp x pp ranks: dp_core_client.py).

Ranks are laid out as vLLM lays them out: rank = pp_rank * tensor_parallel_size + tp_rank.
"""
import dataclasses
import importlib.util
from dataclasses import dataclass

from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError

EXECUTOR_BACKENDS = ("uni", "mp", "ray")
DATA_PARALLEL_BACKENDS = ("mp",)  # vLLM's "ray" places replicas over a cluster: not built


def resolve_executor_backend(backend: str | None, world_size: int,
                             has_ray: bool | None = None) -> str:
    """The executor a world of `world_size` ranks runs on: the one asked for, else `uni` for one
    rank and `mp` (one process per rank) for more, as in vLLM. `ray` without Ray installed
    (`has_ray`; default: looked up) is refused here, before an engine process starts."""
    if backend == "ray":
        if has_ray is None:
            has_ray = importlib.util.find_spec("ray") is not None
        if not has_ray:
            raise ConfigError("distributed_executor_backend 'ray' needs Ray: pip install "
                              "'kiln-llm[ray]' (or use --distributed-executor-backend mp on one "
                              "machine)")
    if backend is None:
        return "mp" if world_size > 1 else "uni"
    if backend == "uni" and world_size > 1:
        raise ConfigError(f"distributed_executor_backend 'uni' runs one rank, but tensor_parallel_"
                          f"size x pipeline_parallel_size = {world_size}; use 'mp' or 'ray' "
                          "(--distributed-executor-backend)")
    return backend


@dataclass
class ParallelConfig(FreezableConfig):
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None (resolved) | "uni" | "mp" | "ray"
    rank: int = 0  # this process's global rank (set by the executor in each worker)
    # vLLM's data parallel: engine core replicas on this machine, requests balanced over them
    data_parallel_size: int = 1
    data_parallel_size_local: int | None = None  # None: all of them (one machine)
    data_parallel_backend: str = "mp"
    data_parallel_rank: int = 0  # the replica this config's core is (set per replica)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size
        if self.data_parallel_size_local != self.data_parallel_size:
            raise ConfigError(f"data_parallel_size_local={self.data_parallel_size_local!r} with "
                              f"data_parallel_size={self.data_parallel_size}: Kiln runs every "
                              "replica on this machine (multi-node data parallel is not built); "
                              "leave --data-parallel-size-local out or give it the same value")
        if self.data_parallel_backend not in DATA_PARALLEL_BACKENDS:
            raise ConfigError(f"--data-parallel-backend (data_parallel_backend) "
                              f"{self.data_parallel_backend!r} is not built: Ray-placed replicas "
                              "are not; use mp (one process per replica on this machine, the "
                              "default)")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ConfigError(f"data_parallel_rank {self.data_parallel_rank} is outside the "
                              f"{self.data_parallel_size} replicas")
        if self.distributed_executor_backend not in (None, *EXECUTOR_BACKENDS):
            raise ConfigError("distributed_executor_backend must be one of uni, mp, ray; got "
                              f"{self.distributed_executor_backend!r}")
        self.distributed_executor_backend = resolve_executor_backend(
            self.distributed_executor_backend, self.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside the world of {self.world_size} ranks")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        """vLLM's: every rank of every replica."""
        return self.world_size * self.data_parallel_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tensor_parallel_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tensor_parallel_size

    def for_rank(self, rank: int) -> "ParallelConfig":
        """A copy naming another rank (each worker process gets its own)."""
        return dataclasses.replace(self, rank=rank)
