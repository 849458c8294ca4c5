"""quantization_rotation's resolution (kiln/config/quantization_rotation.py): "auto" (the default)
is "hadamard" for online int8 on a model of Llama's residual stream (Llama, Mistral, Qwen2 / 3,
Granite, ERNIE-4.5, Seed-OSS, SmolLM3, Phi-3) on one pipeline stage (any -tp), by the generate
runner, without LoRA or an EAGLE head, else "none", saying why; an explicit "hadamard" is
refused where "auto" would be "none"; what runs is never "auto", and a config resolved again
decides again.
"""
import argparse
import dataclasses
import logging

import pytest

from kiln.config import KilnConfig, ParallelConfig
from kiln.config import quantization_rotation as qr
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError

LLAMA = "LlamaForCausalLM"


def engine_parser() -> argparse.ArgumentParser:
    return EngineArgs.add_cli_args(argparse.ArgumentParser())
APPLIES = {"quantization": "int8", "architecture": LLAMA}


@pytest.mark.parametrize("change, fact", [
    ({"quantization": None}, "quantization=None"),
    ({"quantization": "fp8"}, "quantization='fp8'"),
    ({"quantization": "compressed-tensors"}, "quantization='compressed-tensors'"),
    ({"quantization": "gptq"}, "quantization='gptq'"),
    ({"architecture": "GemmaForCausalLM"}, "GemmaForCausalLM (only LlamaForCausalLM"),
    ({"architecture": "Qwen3MoeForCausalLM"}, "Qwen3MoeForCausalLM (only LlamaForCausalLM"),
    ({"architecture": "LlamaForSequenceClassification"}, "LlamaForSequenceClassification"),
    ({"pipeline_parallel_size": 2}, "pipeline_parallel_size=2"),
    ({"runner_type": "pooling"}, "runner='pooling'"),
    ({"lora": True}, "--enable-lora"),
    ({"speculative_method": "eagle"}, "speculative_config.method='eagle'"),
    ({"speculative_method": "eagle3"}, "speculative_config.method='eagle3'"),
])
def test_each_blocker_turns_auto_off_and_refuses_hadamard(change, fact):
    blocker = qr.rotation_blocker(**{**APPLIES, **change})
    assert blocker is not None and blocker[0].startswith(fact)
    assert qr.resolve_rotation("auto", blocker) == "none"
    assert qr.resolve_rotation("none", blocker) == "none"
    with pytest.raises(ConfigError, match="^--quantization-rotation hadamard: .*drop"):
        qr.resolve_rotation("hadamard", blocker)


@pytest.mark.parametrize("spec", [None, "ngram", "draft_model"])
def test_auto_rotates_online_int8_llama(spec):
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                 "GraniteForCausalLM", "Ernie4_5ForCausalLM", "SeedOssForCausalLM",
                 "SmolLM3ForCausalLM", "Phi3ForCausalLM"):
        blocker = qr.rotation_blocker("int8", arch, speculative_method=spec)
        assert blocker is None
        assert qr.resolve_rotation("auto", blocker) == "hadamard"
        assert qr.resolve_rotation("hadamard", blocker) == "hadamard"
        assert qr.resolve_rotation("none", blocker) == "none"


def test_requested_values():
    assert [qr.requested_rotation(v) for v in ("auto", "hadamard", "none", None)] == [
        "auto", "hadamard", "none", "none"]
    with pytest.raises(ConfigError, match=r"--quantization-rotation\) must be one of auto, "
                                          "hadamard, none, got 'givens'"):
        qr.requested_rotation("givens")


def test_cli_and_engine_args_default_to_auto():
    assert EngineArgs().quantization_rotation == "auto"
    args = engine_parser().parse_args([])
    assert args.quantization_rotation == "auto"
    assert engine_parser().parse_args(["--quantization-rotation", "none"]
                                      ).quantization_rotation == "none"


def _config(model_dir, **kw):
    return EngineArgs(model=str(model_dir), **kw).create_kiln_config()


@pytest.mark.parametrize("kw, want", [
    ({"quantization": "int8"}, "hadamard"),
    ({"quantization": "int8", "tensor_parallel_size": 2}, "hadamard"),
    ({"quantization": "int8", "quantization_rotation": "none"}, "none"),
    ({"quantization": "int8", "quantization_rotation": None}, "none"),
    ({}, "none"),
    ({"quantization": "fp8"}, "none"),
])
def test_engine_config_holds_the_resolved_value(tiny_llama_dir, kw, want):
    m = _config(tiny_llama_dir, **kw).model_config
    assert m.quantization_rotation == want


def test_auto_off_says_why_once(tiny_llama_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kiln"):
        m = _config(tiny_llama_dir, quantization="int8", pipeline_parallel_size=2).model_config
    assert m.quantization_rotation == "none"
    said = [r.getMessage() for r in caplog.records if "quantization-rotation" in r.getMessage()]
    assert len(said) == 1 and "pipeline_parallel_size=2" in said[0], said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kiln"):
        _config(tiny_llama_dir)  # not int8: nothing to say
        _config(tiny_llama_dir, quantization="int8")  # rotated
    assert not [r for r in caplog.records if "quantization-rotation" in r.getMessage()]


def test_a_resolved_config_resolved_again_decides_again(tiny_llama_dir):
    """What was asked is kept: auto resolved to hadamard in one engine is none in a split one,
    not an explicit hadamard refused there."""
    config = _config(tiny_llama_dir, quantization="int8")
    assert config.model_config.quantization_rotation == "hadamard"
    split = KilnConfig(model_config=config.model_config,
                       parallel_config=ParallelConfig(pipeline_parallel_size=2))
    assert split.model_config.quantization_rotation == "none"
    again = dataclasses.replace(config, parallel_config=ParallelConfig())
    assert again.model_config.quantization_rotation == "hadamard"
    assert again.compute_hash() == config.compute_hash()


def test_none_crosses_to_the_cli_as_its_name():
    args = EngineArgs(quantization_rotation=None)
    assert args.quantization_rotation == "none"
    argv = args.to_cli_args()
    assert argv == ["--quantization-rotation", "none"]
    parsed = EngineArgs.from_cli_args(engine_parser().parse_args(argv))
    assert parsed.quantization_rotation == "none"
