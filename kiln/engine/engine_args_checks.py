"""EngineArgs' own checks, before any config is built: each argument's type (named when wrong),
a torch.dtype taken by its name, and vLLM's arguments whose other values Kiln refuses."""
import os
from dataclasses import fields
from typing import Any

from kiln.config import SchedulerConfig
from kiln.config.field_types import annotation_kinds, fits
from kiln.config.hf_overrides import check_hf_overrides

DEFAULT_MAX_NUM_SEQS = SchedulerConfig.__dataclass_fields__["max_num_seqs"].default


class EngineArgsChecks:
    """EngineArgs' mixin for its argument checks (called first by create_kiln_config)."""

    def _check_types(self) -> None:
        """A value of the wrong type names its argument (LLM(max_model_len="64") used to fail
        deep inside a config)."""
        self.dtype = dtype_name(self.dtype)  # (set after construction, too)
        self.lora_dtype = dtype_name(self.lora_dtype)
        check_hf_overrides(self.hf_overrides)  # vLLM's function form is named as such
        if self.max_num_seqs is None:
            # vLLM's None: its default (lm-eval's vllm backend passes max_num_seqs=None unless
            # given max_batch_size)
            self.max_num_seqs = DEFAULT_MAX_NUM_SEQS
        for name in ("model", "tokenizer", "download_dir", "chat_template",
                     "generation_config"):  # a pathlib.Path is a path too
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        for f in fields(self):
            if f.type is Any:
                continue
            kinds = annotation_kinds(f.type)
            value = getattr(self, f.name)
            if not any(fits(value, kind) for kind in kinds):
                names = " or ".join("None" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"{f.name} must be {names}, got {value!r} "
                                 f"({type(value).__name__})")

    def _check_vllm_only_defaults(self) -> None:
        if self.tokenizer_mode not in ("auto", "hf"):
            raise ValueError(f"tokenizer_mode={self.tokenizer_mode!r} is not supported: the "
                             "model's fast tokenizer is used ('auto' or 'hf')")
        if not self.swap_space >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB, got {self.swap_space}")


def dtype_name(dtype):
    """vLLM takes a torch.dtype too (LLM(dtype=torch.bfloat16), common in RL trainers): its
    name. A torch.dtype kept as given became `--dtype torch.bfloat16` in to_cli_args' child
    command line, which refuses it."""
    if type(dtype).__name__ == "dtype" and str(dtype).startswith("torch."):
        return str(dtype).removeprefix("torch.")
    return dtype
