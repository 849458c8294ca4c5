"""The engine front's side of LoRA: a request's adapter checked (enabled, fits --max-lora-rank,
matches the base model) before it is queued, so a bad adapter is the request's error and never
reaches the engine core."""
import threading

from kiln.lora.request import LoRARequest


def as_lora_request(value) -> LoRARequest | None:
    """vLLM's LoRARequest, or an object of its shape (lora_name, lora_int_id, lora_path)."""
    if value is None or isinstance(value, LoRARequest):
        return value
    try:
        return LoRARequest(value.lora_name, value.lora_int_id,
                           getattr(value, "lora_path", "") or getattr(value, "lora_local_path",
                                                                      ""),
                           getattr(value, "base_model_name", None))
    except AttributeError:
        raise ValueError(f"lora_request must be a LoRARequest (lora_name, lora_int_id, "
                         f"lora_path), got {type(value).__name__}") from None


class LoRAChecker:
    """Checks requests' adapters against one engine's config; an adapter read once per
    (id, path) while the engine lives."""

    def __init__(self, kiln_config):
        self.config = kiln_config.lora_config  # None: --enable-lora not given
        self.hf_config = kiln_config.model_config.hf_config
        self._checked: dict[int, str] = {}  # lora_int_id -> path it was checked with
        self._lock = threading.Lock()

    def check(self, value) -> LoRARequest | None:
        lora = as_lora_request(value)
        if lora is None:
            return None
        if self.config is None:
            raise ValueError(f"lora_request {lora.lora_name!r} needs LoRA enabled: start the "
                             "engine with --enable-lora (LLM(enable_lora=True))")
        with self._lock:
            known = self._checked.get(lora.lora_int_id)
            if known == lora.lora_path:
                return lora
            if known is not None:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is already adapter "
                                 f"{known!r}; give each adapter its own lora_int_id")
            from kiln.lora.adapter import load_adapter

            load_adapter(lora.lora_path, self.hf_config, self.config.max_lora_rank)
            self._checked[lora.lora_int_id] = lora.lora_path
        return lora


def with_lora(prompt, lora_request):
    """An engine prompt carrying its adapter (the input processor checks it)."""
    if lora_request is None:
        return prompt
    if isinstance(prompt, str):
        return {"prompt": prompt, "lora_request": lora_request}
    if isinstance(prompt, dict):
        return {**prompt, "lora_request": lora_request}
    return prompt  # not a prompt: the input processor says so


def per_prompt(lora_request, num_prompts: int) -> list:
    """vLLM's LLM.generate lora_request: one for every prompt, or a list of one per prompt."""
    if isinstance(lora_request, (list, tuple)):
        if len(lora_request) != num_prompts:
            raise ValueError(f"got {len(lora_request)} lora_request for {num_prompts} prompts; "
                             "pass one LoRARequest or one per prompt")
        return list(lora_request)
    return [lora_request] * num_prompts


def with_lora_request(output, lora_request):
    """A finished RequestOutput naming its adapter, as vLLM's (and each sample's)."""
    if lora_request is not None:
        output.lora_request = lora_request
        for sample in output.outputs:
            sample.lora_request = lora_request
    return output
