"""Scheduler configuration: batch limits (token budget, sequences per step) and the policy."""
from dataclasses import dataclass

from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError


@dataclass
class SchedulerConfig(FreezableConfig):
    max_num_seqs: int = 64
    # Token budget per step; None: derived from max_model_len by KilnConfig.
    max_num_batched_tokens: int | None = None
    max_model_len: int = 2048  # mirrored from ModelConfig by KilnConfig
    # vLLM's --scheduling-policy: "fcfs" (arrival order) or "priority" (lower request priority
    # first, then arrival); kiln/core/request_queue.py
    policy: str = "fcfs"
    # vLLM's: a hybrid sliding-window model's layers share one block table (every block kept)
    # instead of KV cache groups (kiln/core/kv_cache_groups.py)
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's --enable-chunked-prefill: False prefills each prompt in one step (one that does not
    # fit what is left of a step's budget waits, and later ones behind it); the budget is then at
    # least max_model_len (KilnConfig), so every prompt fits an empty step.
    enable_chunked_prefill: bool = True

    def __post_init__(self):
        if self.policy not in ("fcfs", "priority"):
            raise ConfigError(f"--scheduling-policy must be fcfs or priority, got "
                              f"{self.policy!r}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
