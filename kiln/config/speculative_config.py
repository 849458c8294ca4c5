"""`SpeculativeConfig`: vLLM's --speculative-config / LLM(speculative_config=...), of which Kiln
serves the model-free n-gram method (prompt lookup, kiln/spec_decode/). Fields, defaults and
limits are vLLM's; any other method (a draft model, eagle, medusa, mtp) is refused by name."""
import json
from dataclasses import dataclass, fields

from kiln.errors import ConfigError

METHODS = ("ngram",)  # what Kiln takes ("[ngram]" and model="ngram" are vLLM's older spellings)
_FLAG = "--speculative-config"


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # vLLM's older way to say method="ngram"

    def __post_init__(self):
        method = "ngram" if self.method == "[ngram]" else self.method
        if method not in METHODS:
            raise ConfigError(f"{_FLAG}: speculative_config.method={method!r} is not supported; "
                              "Kiln takes only method='ngram' (prompt lookup, no draft model)")
        if self.model is not None and self.model not in ("ngram", "[ngram]"):
            raise ConfigError(f"{_FLAG}: speculative_config.model={self.model!r} names a "
                              "draft model, which Kiln does not run; only "
                              "speculative_config.method='ngram' (prompt lookup) is taken")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError(f"{_FLAG}: speculative_config.num_speculative_tokens is required "
                              "with method='ngram' (e.g. 3)")
        _check_int("num_speculative_tokens", k)
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _check_int(name, value)
        # vLLM's defaults: both unset -> 5 and 5; one set -> the other equals it
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        if lo > hi:
            raise ConfigError(f"{_FLAG}: speculative_config.prompt_lookup_min={lo} must be <= "
                              f"prompt_lookup_max={hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    @classmethod
    def from_value(cls, value) -> "SpeculativeConfig | None":
        """None / {} -> None; a SpeculativeConfig, a dict or its JSON text -> the config."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{_FLAG}: not a JSON object ({e}); e.g. "
                                  "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}'"
                                  ) from None
        if not isinstance(value, dict):
            raise ConfigError(f"{_FLAG}: expected a JSON object, got {value!r}")
        if not value:
            return None
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"{_FLAG}: speculative_config.{unknown[0]} is not supported with "
                              f"method='ngram' (Kiln takes {', '.join(sorted(known))})")
        return cls(**value)

    def to_dict(self) -> dict:
        return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_max": self.prompt_lookup_max,
                "prompt_lookup_min": self.prompt_lookup_min}


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_FLAG}: speculative_config.{name} must be an integer > 0, got "
                          f"{value!r}")


def check_speculative(config: SpeculativeConfig | None, parallel) -> None:
    """Refuse what speculative decoding does not run with: pipeline parallelism (the stages
    before the last learn one token per request a step)."""
    if config is not None and parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{_FLAG} is not supported with --pipeline-parallel-size "
                          f"{parallel.pipeline_parallel_size}: drop one of them (-tp works)")
