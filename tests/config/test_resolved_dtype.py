"""ModelConfig.dtype is the torch.dtype the model runs in once resolved, as vLLM's is (scripts
compare `llm.llm_engine.model_config.dtype == torch.bfloat16`); it read "auto"."""
import dataclasses

import pytest
import torch
from transformers import LlamaConfig

from kiln.config import KilnConfig, ModelConfig
from kiln.errors import ConfigError


def _model_config(dtype, config_dtype="bfloat16") -> ModelConfig:
    hf = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                     max_position_embeddings=128, dtype=config_dtype)
    return ModelConfig(model="unused", hf_config=hf, load_format="dummy", dtype=dtype)


@pytest.mark.parametrize("dtype, expected", [
    ("auto", torch.float32),  # the CPU platform's default for a bfloat16 checkpoint
    ("bfloat16", torch.bfloat16), ("half", torch.float16), (torch.float16, torch.float16)])
def test_dtype_reads_the_resolved_torch_dtype(dtype, expected):
    config = KilnConfig(model_config=_model_config(dtype))
    model = config.model_config
    assert model.dtype == expected and isinstance(model.dtype, torch.dtype)
    assert model.torch_dtype == expected and model.requested_dtype == dtype
    # a second engine given this config, and a replace() of it, resolve to the same
    assert KilnConfig(model_config=model).model_config.dtype == expected
    assert KilnConfig(model_config=dataclasses.replace(model)).model_config.dtype == expected
    hash(model.dtype)


def test_a_bad_dtype_still_names_what_was_asked():
    with pytest.raises(ConfigError, match="got 'float8'"):
        _model_config("float8")
