"""The pooling runner's step: the model's final hidden states (after the final norm, what the
LM head would read) pooled per request once its prefill ends; nothing is sampled.

A classify engine's model (kiln/model/seq_cls.py) turns the pooled states into its score
head's logits here, on the device. A prompt prefilled in chunks pools over all its chunks:
MEAN keeps a running float32 sum (and CLS the first position's state) between steps. A
preempted request is recomputed from its first token (the prefix cache is off for MEAN and
CLS), which starts its sum again.
"""
import torch

from kiln.core.outputs import ModelRunnerOutput, SchedulerOutput
from kiln.pooling.pooler_config import PoolerConfig


class RunnerPooler:
    def __init__(self, config: PoolerConfig, device: torch.device):
        self.pooling_type = config.pooling_type
        self.device = device
        # req_id -> what the chunks so far left ([H] float32): MEAN's sum, CLS's first state
        self._partial: dict[str, torch.Tensor] = {}
        self.classify = config.task == "classify"
        self.head = None  # [N, H] -> [N, num_labels] float32, once the model is loaded

    def attach(self, model) -> None:
        if self.classify:
            self.head = model.classify

    def step(self, so: SchedulerOutput, req_ids: list[str], hidden: torch.Tensor,
             requests: dict) -> ModelRunnerOutput:
        """`hidden` [tokens, H]: this step's rows, each request's consecutive in `req_ids`
        order; `requests`: the runner's states (num_computed_tokens before this step)."""
        for gone in so.finished_req_ids | so.preempted_req_ids:
            self._partial.pop(gone, None)
        done_ids, vectors = [], []
        start = 0
        for req_id in req_ids:
            n = so.num_scheduled_tokens[req_id]
            state = requests[req_id]
            rows, first = hidden[start:start + n], state.num_computed_tokens
            start += n
            vector = self._pool(req_id, rows, first, len(state.prompt_token_ids))
            if vector is not None:
                done_ids.append(req_id)
                vectors.append(vector)
        if vectors:
            stacked = torch.stack(vectors)  # [N, H] float32
            if self.head is not None:
                stacked = self.head(stacked)  # [N, num_labels] float32
            pooled = stacked.cpu().tolist()  # the read waits for the step
        else:
            pooled = []
            if self.device.type != "cpu":
                # Nothing was read back: the next step must not overwrite the pinned input
                # buffers while this step's copies from them may be in flight.
                torch.cuda.current_stream(self.device).synchronize()
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=[[] for _ in req_ids],
                                 pooler_output=dict(zip(done_ids, pooled)))

    def _pool(self, req_id: str, rows: torch.Tensor, first: int,
              prompt_len: int) -> torch.Tensor | None:
        """This chunk's part (prompt positions first .. first + len(rows)); the pooled [H]
        float32 vector once the chunk reaches the prompt's end, else None."""
        end = first + rows.shape[0]
        if first == 0:
            self._partial.pop(req_id, None)  # a fresh (or recomputed) prefill
        elif self.pooling_type != "LAST" and req_id not in self._partial:
            raise RuntimeError(f"request {req_id!r}: {self.pooling_type} pooling got a chunk "
                               f"from position {first} without the earlier ones (a prefix "
                               "cache hit?); the pooling runner pools every prompt position")
        if self.pooling_type == "MEAN":
            total = rows.float().sum(dim=0)
            if first > 0:
                total = total + self._partial.pop(req_id)
            if end < prompt_len:
                self._partial[req_id] = total
                return None
            return total / prompt_len
        if self.pooling_type == "CLS":
            if first == 0:
                # a copy: a graph's output buffer is overwritten by the next step
                self._partial[req_id] = rows[0].float().clone()
            return self._partial.pop(req_id) if end >= prompt_len else None
        return rows[prompt_len - 1 - first].float() if end >= prompt_len else None
