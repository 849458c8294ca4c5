"""`LoRARequest`: vLLM's handle of one adapter (`from vllm.lora.request import LoRARequest`):
a name, an id unique per adapter (> 0) and the PEFT directory it loads from."""
from dataclasses import dataclass

from kiln.wire_ints import INT64_MAX


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # vLLM's field; the server's `parent`

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty str, got "
                             f"{self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) \
                or not 1 <= self.lora_int_id <= INT64_MAX:
            # past 64 bits the id could not cross to the engine core: msgpack's OverflowError
            # met it in the core client as the request was handed over
            raise ValueError(f"LoRARequest.lora_int_id must be an int in [1, {INT64_MAX}] "
                             f"(>= 1 as vLLM's; a 64-bit integer to cross to the engine "
                             f"core), got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest.lora_path must name the adapter's PEFT directory, "
                             f"got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def to_wire(self) -> list:
        return [self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name]

    @classmethod
    def from_wire(cls, fields: list | None) -> "LoRARequest | None":
        return None if fields is None else cls(*fields)

    def hash_key(self) -> bytes:
        """What the prefix cache's root block hash mixes in: blocks computed under one adapter
        are never another's (or the base model's)."""
        return repr(("lora", self.lora_int_id, self.lora_name, self.lora_path)).encode()
