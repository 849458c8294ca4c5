"""The scheduler's LoRA rule (vLLM's): the running requests use at most --max-loras distinct
adapters, so every step's adapters fit the model runner's slots; a waiting request whose
adapter would be one too many waits, and requests behind it may go first."""


def fits_lora_slots(request, running: list, max_loras: int | None) -> bool:
    lora = request.lora_request
    if lora is None or max_loras is None:
        return True
    active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in active or len(active) < max_loras
