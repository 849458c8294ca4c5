"""The scheduler's LoRA rule (vLLM's): the running requests use at most --max-loras distinct
adapters, so every step's adapters fit the model runner's slots; a waiting request whose
adapter would be one too many waits, and requests behind it may go first.

Unlike vLLM, that may not go on for ever: once a request has waited STARVATION_STEPS steps
for a slot, the LoRA requests queued behind it wait too (the base model's still go by), so
the running adapters drain and free a slot. Else a steady stream of requests for a running
adapter keeps its slot busy and the waiting request starves. An offline batch mixing adapters
still runs each adapter's requests together (a request waits fewer steps than that there)."""

STARVATION_STEPS = 64


def fits_lora_slots(request, running: list, max_loras: int | None,
                    one_is_starving: bool = False) -> bool:
    """`one_is_starving`: an earlier request in the queue has waited too long for a slot."""
    lora = request.lora_request
    if lora is None or max_loras is None:
        return True
    if one_is_starving:
        return False
    active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in active or len(active) < max_loras


def starves(request) -> bool:
    """Count a step `request` waits for a slot; True once it has waited STARVATION_STEPS."""
    request.lora_slot_waits = getattr(request, "lora_slot_waits", 0) + 1
    return request.lora_slot_waits >= STARVATION_STEPS


def adapter_names(requests) -> list[str]:
    """The adapters `requests` use, by name, each once, sorted."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})


def lora_stats(running, waiting) -> dict:
    """SchedulerStats' running_lora_adapters / waiting_lora_adapters."""
    return {"running_lora_adapters": adapter_names(running),
            "waiting_lora_adapters": adapter_names(waiting)}
