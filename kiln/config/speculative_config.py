"""`SpeculativeConfig`: vLLM's --speculative-config / LLM(speculative_config=...), of which Kiln
serves the model-free n-gram method (prompt lookup), a separate draft model ("draft_model") and
an EAGLE-1 head ("eagle") and an EAGLE-3 head ("eagle3"; kiln/spec_decode/). Fields, defaults and
limits are vLLM's; mtp, medusa are refused by name."""
import json
from dataclasses import dataclass, field, fields

from kiln.config.field_types import annotation_kinds, fits
from kiln.errors import ConfigError

METHODS = ("ngram", "draft_model", "eagle", "eagle3")  # "[ngram]", model="ngram": vLLM's older spellings
# the methods whose drafts a model in the worker proposes (the scheduler keeps them per request)
RUNNER_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM's other methods, refused with what to use instead
_REFUSED = {"mtp": "a model's own multi-token-prediction layers are not served",
            "medusa": "Medusa heads are not served",
            "mlp_speculator": "MLP speculators are not served",
            "suffix": "suffix decoding is not served"}
_FLAG = "--speculative-config"
# vLLM's fields for a draft model that Kiln takes at one value only: (field, value, why)
_FIXED = (("draft_sample_method", "greedy", "the draft proposes its argmax, one-hot in the "
           "rejection sampler (vLLM's default)"),
          ("rejection_sample_method", "standard", "vLLM's standard rejection sampler"),
          ("quantization", None, "a quantized draft checkpoint is read by its own "
           "quantization_config"),
          ("parallel_drafting", False, "the draft proposes its tokens one forward at a time"))


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str | None = None  # None: inferred from `model` (_method_of), as vLLM's
    num_speculative_tokens: int | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None  # the draft model ("ngram": vLLM's older way to say the method)
    draft_tensor_parallel_size: int | None = None  # vLLM's; the target's (unset: it)
    enforce_eager: bool | None = None  # vLLM's; True: the draft stays eager under mode 3
    revision: str | None = None  # the draft's hub revision
    draft_sample_method: str = "greedy"
    rejection_sample_method: str = "standard"
    quantization: str | None = None
    max_model_len: int | None = None  # the draft's: it drafts for shorter requests only
    parallel_drafting: bool = False
    # The draft's resolved ModelConfig, set by KilnConfig (resolve_draft_model_config)
    draft_model_config: object = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self):
        self._check_types()
        method = "ngram" if self.method == "[ngram]" else self.method
        if method is None and self.model is None:  # vLLM refuses it too
            raise ConfigError(f"{_FLAG}: speculative_config has neither a method nor a model (a "
                              "num_speculative_tokens without a speculative model); add "
                              "\"method\": \"ngram\" for prompt lookup, or a draft \"model\"")
        if method is None:  # vLLM infers it from `model`
            method = _method_of(self.model)
        if method not in METHODS:
            why = f" ({_REFUSED[method]})" if method in _REFUSED else ""
            raise ConfigError(f"{_FLAG}: speculative_config.method={method!r} is not supported"
                              f"{why}; Kiln takes method='ngram' (prompt lookup), 'draft_model' "
                              "(a small model with the target's vocabulary, in 'model') or "
                              "'eagle' / 'eagle3' (an EAGLE-1 / EAGLE-3 head for a Llama "
                              "target, in 'model')")
        object.__setattr__(self, "method", method)
        k = self.num_speculative_tokens
        if k is None:
            raise ConfigError(f"{_FLAG}: speculative_config.num_speculative_tokens is required "
                              f"with method={method!r} (e.g. 3)")
        if method in RUNNER_METHODS:
            self._check_draft_model()
        else:
            self._check_ngram()

    def _check_types(self) -> None:
        """Each init field's JSON type against its annotation, named (a `revision: 5` reached
        the hub as a revision, a `parallel_drafting: 0` passed as False); None only where the
        annotation takes it; integers are > 0 and never a bool."""
        for f in fields(self):
            kinds = annotation_kinds(f.type)
            value = getattr(self, f.name)
            if not f.init or (value is None and type(None) in kinds):
                continue
            kind = next(k for k in kinds if k is not type(None))
            if kind is int:
                _check_int(f.name, value)
            elif not fits(value, kind):
                what = "a string" if kind is str else "true or false"
                raise ConfigError(f"{_FLAG}: speculative_config.{f.name} must be {what}, got "
                                  f"{value!r}")

    def _check_ngram(self) -> None:
        if self.model is not None and self.model not in ("ngram", "[ngram]"):
            raise ConfigError(f"{_FLAG}: speculative_config.model={self.model!r} names a draft "
                              "model, which method='ngram' does not run; drop 'model' or use "
                              "method='draft_model'")
        draft_only = [f.name for f in fields(self) if f.name in _DRAFT_ONLY
                      and getattr(self, f.name) != f.default]
        if draft_only:
            raise ConfigError(f"{_FLAG}: speculative_config.{draft_only[0]} is not supported "
                              "with method='ngram' (it sets up a draft model)")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
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

    def _check_draft_model(self) -> None:
        if not isinstance(self.model, str) or self.model in ("", "ngram", "[ngram]"):
            what = {"eagle": "the EAGLE head's path or hub id (e.g. "
                             "yuhuili/EAGLE-LLaMA3-Instruct-8B)",
                    "eagle3": "the EAGLE-3 head's path or hub id (e.g. "
                              "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B)"}.get(
                self.method, "the draft model's path or hub id (e.g. a smaller model of the "
                "target's family)")
            raise ConfigError(f"{_FLAG}: method={self.method!r} needs speculative_config.model, "
                              f"{what}")
        for name in ("prompt_lookup_max", "prompt_lookup_min"):
            if getattr(self, name) is not None:
                raise ConfigError(f"{_FLAG}: speculative_config.{name} is n-gram's; drop it "
                                  f"with method={self.method!r}")
        for name, value, why in _FIXED:
            if getattr(self, name) != value:
                raise ConfigError(f"{_FLAG}: speculative_config.{name}={getattr(self, name)!r} "
                                  f"is not supported; Kiln takes {value!r} ({why})")

    @property
    def runner_proposes(self) -> bool:
        """Whether a model in the worker proposes the drafts (not the scheduler's n-grams)."""
        return self.method in RUNNER_METHODS

    @property
    def is_eagle(self) -> bool:
        """An EAGLE head (1 or 3): it reads the target's hidden states, and its K/V at a
        block's last position read the token after the block."""
        return self.method in ("eagle", "eagle3")

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
        known = {f.name for f in fields(cls) if f.init}
        unknown = sorted(set(value) - known, key=str)  # a Python dict's keys may be any type
        if "tensor_parallel_size" in unknown:  # vLLM warns about this one by name too
            raise ConfigError(f"{_FLAG}: speculative_config.tensor_parallel_size: the draft's "
                              "is draft_tensor_parallel_size")
        if unknown:
            raise ConfigError(f"{_FLAG}: speculative_config.{unknown[0]} is not supported "
                              f"(Kiln takes {', '.join(sorted(known))})")
        return cls(**value)

    def to_dict(self) -> dict:
        if self.method == "ngram":
            return {"method": self.method, "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_max": self.prompt_lookup_max,
                    "prompt_lookup_min": self.prompt_lookup_min}
        out = {"method": self.method, "model": self.model,
               "num_speculative_tokens": self.num_speculative_tokens}
        for name in ("draft_tensor_parallel_size", "enforce_eager", "revision",
                     "max_model_len"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out


# fields that only a draft model reads: refused with n-gram when changed
_DRAFT_ONLY = ("draft_tensor_parallel_size", "enforce_eager", "revision", "quantization",
               "max_model_len")


def _method_of(model) -> str:
    """vLLM's method for an unset one: ngram for its older spellings, an EAGLE head by its
    name."""
    if model in ("ngram", "[ngram]"):
        return "ngram"
    name = str(model).lower()
    if "eagle3" in name:
        return "eagle3"
    return "eagle" if "eagle-" in name else "draft_model"


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{_FLAG}: speculative_config.{name} must be an integer > 0, got "
                          f"{value!r}")


def check_speculative(config: SpeculativeConfig | None, parallel, max_model_len: int) -> None:
    """Refuse what speculative decoding does not run with: pipeline parallelism (the stages
    before the last learn one token per request a step), a draft on other ranks than the
    target's (a draft model or EAGLE head is sharded over the target's ranks, as vLLM's), and
    more drafts a step than a sequence can hold (the scheduler keeps a counter per draft
    position: 2**63 of them crashed the engine core, 10**8 took gigabytes)."""
    if config is None:
        return
    if config.num_speculative_tokens >= max_model_len:
        raise ConfigError(f"{_FLAG}: speculative_config.num_speculative_tokens="
                          f"{config.num_speculative_tokens} must be below --max-model-len "
                          f"{max_model_len} (a sequence holds at most {max_model_len - 1} "
                          "drafted tokens after its first); lower it")
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(f"{_FLAG} is not supported with --pipeline-parallel-size "
                          f"{parallel.pipeline_parallel_size}: drop one of them (-tp works "
                          "with every method)")
    tp, draft_tp = parallel.tensor_parallel_size, config.draft_tensor_parallel_size
    if config.runner_proposes and draft_tp not in (None, tp):
        raise ConfigError(f"{_FLAG}: speculative_config.draft_tensor_parallel_size="
                          f"{draft_tp} differs from --tensor-parallel-size {tp}; the draft "
                          f"(method={config.method!r}) runs on the target's ranks: set it to "
                          f"{tp} or leave it unset")
