"""`LoRAConfig`: vLLM's LoRA engine knobs (--max-loras, --max-lora-rank, --max-cpu-loras,
--lora-dtype, --fully-sharded-loras), checked where the engine is configured, naming the flag."""
from dataclasses import dataclass

import torch

from kiln.errors import ConfigError

LORA_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapters a batch may use at once (GPU slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept loaded in host memory; None: max_loras
    lora_dtype: str = "auto"  # the dtype adapters are held in; auto: the model's
    fully_sharded_loras: bool = False

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
        if self.lora_dtype != "auto" and self.lora_dtype not in LORA_DTYPES:
            raise ConfigError(f"--lora-dtype must be auto, {', '.join(LORA_DTYPES)}; got "
                              f"{self.lora_dtype!r}")
        if self.fully_sharded_loras:
            raise ConfigError("--fully-sharded-loras is not supported: Kiln shards only the "
                              "LoRA weight on the layer's split dimension (B of column-parallel "
                              "layers, A of row-parallel ones) and keeps the other whole on "
                              "every rank; drop the flag (the outputs are the same)")

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras or self.max_loras

    def torch_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype adapters are held and applied in (vLLM's: auto is the model's)."""
        return model_dtype if self.lora_dtype == "auto" else LORA_DTYPES[self.lora_dtype]

    def check_parallel(self, parallel_config) -> None:
        if parallel_config.pipeline_parallel_size > 1:
            raise ConfigError("--enable-lora is not supported with --pipeline-parallel-size "
                              "above 1 yet: serve LoRA adapters with --tensor-parallel-size "
                              "alone, or merge the adapter into the weights")
