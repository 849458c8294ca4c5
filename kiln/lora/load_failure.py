"""An adapter the engine core cannot read when it first needs it (its files deleted or
rewritten after the front end checked them): the requests under that adapter end with the
error, the rest of the step is recomputed, and the core keeps serving (vLLM fails only the
requests of a LoRA that fails to load)."""
from kiln.core.outputs import EngineCoreOutput
from kiln.core.request import RequestStatus
from kiln.logger import init_logger

logger = init_logger(__name__)


class LoRALoadError(RuntimeError):
    """Raised by the model runner's LoRAManager: adapter `lora_int_id` failed to load."""

    def __init__(self, lora_int_id: int, message: str):
        super().__init__(message)
        self.lora_int_id = lora_int_id


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
