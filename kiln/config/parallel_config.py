"""Parallelism configuration (tensor parallel size, executor backend)."""
from dataclasses import dataclass


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None | "uni" | "mp" | "ray"
    rank: int = 0

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError("distributed_executor_backend must be one of uni, mp, ray; got "
                             f"{self.distributed_executor_backend!r}")
