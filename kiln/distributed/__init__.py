"""torch.distributed for Kiln's ranks: process groups (gloo on CPU, NCCL on CUDA), the tensor /
pipeline parallel groups, the collectives the model and the runner call, each pipeline stage's
layers and what it receives, and each rank's CPU cores (cpu_binding.py).
"""
from kiln.distributed.parallel_state import (
                                             destroy_model_parallel,
                                             get_pp_group,
                                             get_tp_group,
                                             init_distributed,
                                             model_parallel_initialized,
)

__all__ = ["destroy_model_parallel", "get_pp_group", "get_tp_group", "init_distributed",
           "model_parallel_initialized"]
