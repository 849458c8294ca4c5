"""The scheduler's LoRA rule (vLLM's): the running requests use at most --max-loras distinct
adapters, so every step's adapters fit the model runner's slots; a waiting request whose
adapter would be one too many waits, and requests behind it may go first.

Unlike vLLM, once a request waits for a slot the LoRA requests queued behind it wait too (the
base model's still go by): else a steady stream of requests for the running adapters keeps
that adapter's slot busy for ever and the waiting request starves."""


def fits_lora_slots(request, running: list, max_loras: int | None,
                    one_is_waiting: bool = False) -> bool:
    """`one_is_waiting`: an earlier request in the queue is waiting for a slot this step."""
    lora = request.lora_request
    if lora is None or max_loras is None:
        return True
    if one_is_waiting:
        return False
    active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in active or len(active) < max_loras
