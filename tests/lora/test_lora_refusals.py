"""What a PEFT adapter may ask for that Kiln does not apply is refused naming the field: DoRA,
modules_to_save, embedding / lm_head LoRA, a rank above --max-lora-rank, LoRA biases; and the
flags' own checks."""
import json

import pytest
import torch
from lora_adapters import write_adapter

from kiln.errors import ConfigError
from kiln.lora.adapter import load_adapter
from kiln.lora.config import LoRAConfig
from kiln.lora.request import LoRARequest
from kiln.lora.serving import lora_module_flag, lora_requests

from checkpoints import make_tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("lora_base"), "llama", tie=False)
    from transformers import AutoConfig

    return path, AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("extra, field", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
    ({"bias": "all"}, "bias"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
    ({"r": 32}, "--max-lora-rank"),
    # a runtime load's files are the client's: a 500 (TypeError) before these were checked
    ({"target_modules": 5}, "target_modules"),
    ({"target_modules": ["q_proj", 1]}, "target_modules"),
    # json reads Infinity: every output of the adapter was NaN
    ({"lora_alpha": float("inf")}, "lora_alpha"),
    ({"lora_alpha": float("nan")}, "lora_alpha"),
])
def test_unsupported_adapter_fields_are_refused_by_name(base, tmp_path, extra, field):
    path, config = base
    adapter = write_adapter(tmp_path / "a", path)
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**cfg, **extra}))
    with pytest.raises(ConfigError, match=field):
        load_adapter(str(adapter), config, max_lora_rank=16)


def test_unsupported_tensors_are_refused_by_name(base, tmp_path):
    from safetensors.torch import load_file, save_file

    path, config = base
    adapter = write_adapter(tmp_path / "a", path)
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    save_file({**tensors, key: tensors[key.replace("lora_magnitude_vector", "lora_A.weight")].clone()},
              str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="DoRA"):
        load_adapter(str(adapter), config, max_lora_rank=16)
    save_file({**tensors, "base_model.model.lm_head.lora_A.weight": tensors[key.replace(
        "lora_magnitude_vector", "lora_A.weight")].clone()}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match="lm_head"):
        load_adapter(str(adapter), config, max_lora_rank=16)


def test_an_adapter_of_another_model_is_refused_with_shapes(base, tmp_path):
    path, config = base
    other = make_tiny_checkpoint(tmp_path / "other", "llama", tie=False, hidden_size=32)
    adapter = write_adapter(tmp_path / "a", other)
    with pytest.raises(ConfigError, match="lora_A"):
        load_adapter(str(adapter), config, max_lora_rank=16)
    with pytest.raises(ConfigError, match="adapter_config.json"):
        load_adapter(str(tmp_path), config, max_lora_rank=16)


def test_flags_and_requests_check_their_values():
    with pytest.raises(ConfigError, match="--max-loras"):
        LoRAConfig(max_loras=0)
    with pytest.raises(ConfigError, match="--max-cpu-loras"):
        LoRAConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="lora_int_id"):
        LoRARequest("a", 0, "/x")
    # past 64 bits the core client's encoder raised OverflowError as the request was handed over
    with pytest.raises(ValueError, match=r"lora_int_id must be an int in \[1, 9223372036854775807\]"):
        LoRARequest("a", 2 ** 64, "/x")
    assert LoRARequest("a", 2 ** 63 - 1, "/x").lora_int_id == 2 ** 63 - 1
    assert lora_module_flag("sql=/a/b") == {"name": "sql", "path": "/a/b",
                                           "base_model_name": None}
    assert lora_module_flag('{"name": "s", "path": "/p", "base_model_name": "m"}')[
        "base_model_name"] == "m"
    with pytest.raises(Exception, match="name=path"):
        lora_module_flag("nopath")
    assert [r.lora_int_id for r in lora_requests([lora_module_flag("a=/1"),
                                                 lora_module_flag("b=/2")])] == [1, 2]
    with pytest.raises(ValueError, match="twice"):
        lora_requests([lora_module_flag("a=/1"), lora_module_flag("a=/2")])


def test_cli_flags_reach_the_engine_and_lm_eval_rank_is_harmless():
    import argparse

    from kiln.engine.arg_utils import EngineArgs

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(
        ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "4",
         "--lora-dtype", "bfloat16", "--no-fully-sharded-loras"]))
    assert args.lora_config() == LoRAConfig(max_loras=3, max_lora_rank=32, max_cpu_loras=4,
                                            lora_dtype="bfloat16")
    assert EngineArgs.from_cli_args(parser.parse_args(args.to_cli_args())) == args
    # vLLM takes a torch.dtype too; a name outside vLLM's is refused by the flag
    assert EngineArgs(enable_lora=True, lora_dtype=torch.float16).lora_config().lora_dtype == \
        "float16"
    with pytest.raises(ConfigError, match="--lora-dtype"):
        EngineArgs(enable_lora=True, lora_dtype="int8").lora_config()
    # lm-eval's vllm backend passes max_lora_rank=16 with enable_lora False: no LoRA
    assert EngineArgs(max_lora_rank=16).lora_config() is None


def test_the_adapter_crosses_to_the_core_process():
    """The engine core runs in its own process: a request's adapter goes over the wire."""
    from kiln.core.core_messages import from_wire, input_codec, to_wire
    from kiln.core.request import Request
    from kiln.sampling_params import SamplingParams

    encoder, decoder = input_codec()
    lora = LoRARequest("a", 3, "/p", "base")
    for value in (lora, None):
        request = Request("r", [1, 2], SamplingParams(max_tokens=1), lora_request=value)
        assert from_wire(decoder.decode(encoder.encode(to_wire(request)))).lora_request == value


def test_a_home_relative_adapter_path_is_expanded(base, tmp_path, monkeypatch):
    """vLLM expands `~` in an adapter path (a JSON --lora-modules value or the runtime load
    API's lora_path, which no shell expands); Kiln said it was not a directory."""
    path, config = base
    write_adapter(tmp_path / "a", path)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert load_adapter("~/a", config, max_lora_rank=16).rank == 4


def test_a_phi_adapter_of_modules_phi_lacks_is_refused_by_name(tmp_path, tiny_phi_dir):
    """Phi's targets are q/k/v, dense, fc1 / fc2: Llama's o_proj / down_proj, the fused
    qkv_proj and modules that are no projection (q_layernorm) are refused naming the tensor
    and Phi's names; its own modules load, on Kiln's layers."""
    from lora_adapters import PHI_TARGETS
    from transformers import AutoConfig

    from kiln.lora.adapter import PHI_TARGETS as KILN_PHI_TARGETS

    cfg = AutoConfig.from_pretrained(tiny_phi_dir)
    adapter = load_adapter(str(write_adapter(tmp_path / "ok", tiny_phi_dir, targets=PHI_TARGETS)),
                           cfg, 16)
    assert {m for _, m in adapter.weights} == set(PHI_TARGETS) == set(KILN_PHI_TARGETS)
    for bad in ("o_proj", "down_proj", "qkv_proj"):
        path = write_adapter(tmp_path / bad, tiny_phi_dir, targets=("q_proj", bad))
        with pytest.raises(ConfigError, match=rf"\.{bad}\.lora_A.* one of phi's q_proj/k_proj/"
                                              r"v_proj/dense/fc1/fc2 projections"):
            load_adapter(str(path), cfg, 16)
    path = write_adapter(tmp_path / "norm", tiny_phi_dir, targets=("q_proj",))
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.self_attn.q_layernorm.lora_A.weight"] = \
        torch.zeros(4, 8)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    with pytest.raises(ConfigError, match=r"q_layernorm\.lora_A.*one of phi's"):
        load_adapter(str(path), cfg, 16)
