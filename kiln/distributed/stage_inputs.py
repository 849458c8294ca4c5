"""What a pipeline stage after the first receives each step: the previous stage's hidden
states and residual, both [num_tokens, hidden] in the model dtype.
"""
import torch

from kiln.distributed.communication_op import recv_from_prev_stage


class StageInputs:
    def __init__(self, hidden_size: int, dtype: torch.dtype):
        self.hidden_size, self.dtype = hidden_size, dtype

    def recv(self, num_tokens: int, device: torch.device) -> list[torch.Tensor]:
        shape = (num_tokens, self.hidden_size)
        return recv_from_prev_stage([shape, shape], self.dtype, device)

    def zeros(self, num_tokens: int, device: torch.device) -> list[torch.Tensor]:
        return [torch.zeros(num_tokens, self.hidden_size, dtype=self.dtype, device=device)
                for _ in range(2)]
