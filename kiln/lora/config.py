"""`LoRAConfig`: vLLM's LoRA engine knobs (--max-loras, --max-lora-rank, --max-cpu-loras),
checked where the engine is configured, naming the flag."""
from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters a batch may use at once (GPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory; None: max_loras

    def __post_init__(self):
        for flag, value in (("--max-loras", self.max_loras),
                            ("--max-lora-rank", self.max_lora_rank)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{flag} must be an int >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                                or cpu < self.max_loras):
            raise ConfigError(f"--max-cpu-loras ({cpu!r}) must be an int >= --max-loras "
                              f"({self.max_loras})")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def check_parallel(self, parallel_config) -> None:
        if parallel_config.tensor_parallel_size > 1 or parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora is not supported with --tensor-parallel-size or "
                              "--pipeline-parallel-size above 1 yet: serve LoRA adapters on one "
                              "rank, or merge the adapter into the weights")
