"""How weights are loaded: auto (from the files), HF safetensors, GGUF, or dummy random."""
from dataclasses import dataclass

from kiln.config.frozen import FreezableConfig
from kiln.errors import ConfigError

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadConfig(FreezableConfig):
    load_format: str = "auto"

    def __post_init__(self):
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(
                f"load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
