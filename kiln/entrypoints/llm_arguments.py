"""Checks of `LLM`'s vLLM-shaped arguments (lora_request, priority) and vLLM's methods Kiln
lacks, kept apart from the class so kiln/entrypoints/llm.py reads as the batch API alone.
"""
from kiln.core.request_queue import check_priority


def refuse_lora(lora_request, method: str) -> None:
    # vLLM takes one LoRARequest or one per prompt; None (or a list of Nones) asks for none
    if isinstance(lora_request, (list, tuple)) and all(r is None for r in lora_request):
        return
    if lora_request is not None:
        raise ValueError(f"lora_request is not supported by LLM.{method}() yet; use "
                         "generate() or chat() with it")


def request_priorities(priority, num_prompts: int) -> list[int]:
    """vLLM's `priority` (one int per prompt; None: all 0) as one per prompt. Lower is served
    first under scheduling_policy="priority"; under the default fcfs it is accepted and ignored,
    as vLLM V1 does (V0 refused a non-zero one)."""
    if priority is None:
        return [0] * num_prompts
    if not isinstance(priority, (list, tuple)) or len(priority) != num_prompts:
        raise ValueError(f"priority must be a list of one int per prompt ({num_prompts}), got "
                         f"{priority!r}")
    for i, p in enumerate(priority):
        try:
            check_priority(p)
        except ValueError as e:
            raise ValueError(f"priority[{i}]: {e}") from None
    return list(priority)


def unsupported(method: str, why: str):
    """vLLM's LLM methods that Kiln does not have: a call says so by name (not an
    AttributeError that reads like a typo)."""
    def refuse(self, *args, **kwargs):
        raise ValueError(f"LLM.{method}() is not supported: {why}")
    refuse.__name__ = method
    refuse.__doc__ = f"vLLM's LLM.{method}(): refused ({why})."
    return refuse
