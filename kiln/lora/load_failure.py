"""An adapter the engine core cannot read when it first needs it (its files deleted or
rewritten after the front end checked them): the requests under that adapter end with the
error, the rest of the step is recomputed, and the core keeps serving (vLLM fails only the
requests of a LoRA that fails to load). Under tensor parallelism every rank raises it together
and answers the step with a LoRALoadFailure, which the executor raises again as the error."""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import RequestStatus
from kiln.logger import init_logger

logger = init_logger(__name__)


class LoRALoadError(RuntimeError):
    """Raised by the model runner's LoRAManager: adapter `lora_int_id` failed to load."""

    def __init__(self, lora_int_id: int, message: str, own: bool = True):
        super().__init__(message)
        self.lora_int_id = lora_int_id
        self.own = own  # False: another tensor-parallel rank could not read it (no reason here)


@dataclass(frozen=True)
class LoRALoadFailure:
    """A rank's execute_model answer where its step raised LoRALoadError (raising would fail
    the ranks, and the engine with them)."""
    lora_int_id: int
    message: str
    own: bool

    @classmethod
    def of(cls, error: LoRALoadError) -> "LoRALoadFailure":
        return cls(error.lora_int_id, str(error), error.own)


def agree_on_failure(failure: LoRALoadError | None,
                     device: torch.device) -> LoRALoadError | None:
    """The tensor-parallel ranks' common verdict on a step's adapter reads: the failure of the
    highest adapter id any rank saw, or None. Every rank of the group must call it."""
    from kiln.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return failure
    flag = torch.tensor([0 if failure is None else failure.lora_int_id], dtype=torch.int64,
                        device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group.group)
    agreed = int(flag.item())
    if agreed == 0:
        return None
    if failure is not None and failure.lora_int_id == agreed:
        return failure
    return LoRALoadError(agreed, f"LoRA adapter {agreed} failed to load on another tensor-"
                                 "parallel rank", own=False)


def raise_rank_failure(replies: list) -> None:
    """Raise the ranks' LoRALoadFailure as LoRALoadError, with the reason a rank that read the
    adapter gave (every rank answers with one, or none does)."""
    failures = [r for r in replies if isinstance(r, LoRALoadFailure)]
    if failures:
        best = next((f for f in failures if f.own), failures[0])
        raise LoRALoadError(best.lora_int_id, best.message, best.own)


def end_adapter_requests(scheduler, error: LoRALoadError) -> list[EngineCoreOutput]:
    """Abort every request (waiting or running) of the adapter that failed, saying why; the
    failed step has been undone, so the others run again in the next step."""
    ending = [r for r in scheduler.requests.values()
              if r.lora_request is not None and r.lora_request.lora_int_id == error.lora_int_id]
    logger.error("LoRA adapter %d failed to load: %s; ending its %d request(s)",
                 error.lora_int_id, error, len(ending))
    scheduler.finish_requests([r.request_id for r in ending], RequestStatus.FINISHED_ABORTED)
    return [EngineCoreOutput(request_id=r.request_id, new_token_ids=[],
                             finish_reason=r.get_finish_reason(), num_cached_tokens=0,
                             first_scheduled_time=r.first_scheduled_time, error=str(error))
            for r in ending]
