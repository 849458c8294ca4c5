"""Bad and unusual HF checkpoint directories: each loads right or fails at load naming the
tensor or file and the fix, never leaving a parameter at random init or ignoring a tensor.
"""
import json
import shutil

import pytest
import torch

from kiln.errors import ConfigError
from kiln.model.loader import get_model
from model._attn_helper import kiln_config_for


def _copy_with(src, dst, state=None, config_edit=None, weights=True):
    """dst: src's config and tokenizer, with `state` saved as model.safetensors."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    if weights:
        state = load_file(str(src / "model.safetensors")) if state is None else state
        save_file(state, str(dst / "model.safetensors"))
    if config_edit:
        config = json.loads((dst / "config.json").read_text())
        config_edit(config)
        (dst / "config.json").write_text(json.dumps(config))
    return dst


def _state(src):
    from safetensors.torch import load_file

    return load_file(str(src / "model.safetensors"))


def test_bias_the_config_does_not_declare_is_refused(tiny_llama_dir, tmp_path):
    """It used to be dropped with a log line: a model without the bias, unlike HF's."""
    state = {**_state(tiny_llama_dir), "model.layers.0.self_attn.q_proj.bias": torch.ones(64)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=r"model\.layers\.0\.self_attn\.q_proj\.bias matches no "
                                          r"parameter.*attention_bias=False"):
        get_model(kiln_config_for(path))


def test_layer_beyond_the_config_is_refused(tiny_llama_dir, tmp_path):
    state = {**_state(tiny_llama_dir), "model.layers.2.mlp.down_proj.weight": torch.ones(64, 128)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=r"model\.layers\.2\.mlp\.down_proj\.weight matches no "
                                          r"parameter.*num_hidden_layers=2"):
        get_model(kiln_config_for(path))


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.self_attn.k_proj.weight", (48, 64)),  # merged into qkv_proj
    ("model.layers.1.mlp.up_proj.weight", (100, 64)),  # merged into gate_up_proj
    ("model.layers.0.mlp.down_proj.weight", (64, 100)),
    ("model.embed_tokens.weight", (500, 64)),
])
def test_misshaped_tensor_is_named(tiny_llama_dir, tmp_path, name, shape):
    state = {**_state(tiny_llama_dir), name: torch.ones(shape)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=rf"checkpoint tensor {name}: weight shape mismatch.*"
                                          r"config"):
        get_model(kiln_config_for(path))


def test_integer_tensor_is_refused(tiny_llama_dir, tmp_path):
    state = {**_state(tiny_llama_dir), "model.norm.weight": torch.ones(64, dtype=torch.int64)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=r"model\.norm\.weight: checkpoint dtype torch\.int64"):
        get_model(kiln_config_for(path))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_weights_load_as_float32(tiny_llama_dir, tmp_path, dtype):
    state = {k: v.to(dtype) for k, v in _state(tiny_llama_dir).items()}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    params = dict(get_model(kiln_config_for(path)).named_parameters())
    assert params["lm_head.weight"].dtype == torch.float32
    assert torch.equal(params["lm_head.weight"], state["lm_head.weight"].float())


@pytest.mark.parametrize("zip_format", [True, False])
def test_pytorch_bin_checkpoint_loads_like_safetensors(tiny_llama_dir, tmp_path, zip_format):
    """Both torch.save formats: the legacy one (torch < 1.6, older hub checkpoints; HF and vLLM
    load it) was refused as "not a state dict of tensors only", since it cannot be mapped."""
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    torch.save(_state(tiny_llama_dir), path / "pytorch_model.bin",
               _use_new_zipfile_serialization=zip_format)
    ours = dict(get_model(kiln_config_for(path)).named_parameters())
    ref = dict(get_model(kiln_config_for(tiny_llama_dir)).named_parameters())
    assert all(torch.equal(ours[n], ref[n]) for n in ref)


def test_sharded_bin_checkpoint_loads(tiny_llama_dir, tmp_path):
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    state = _state(tiny_llama_dir)
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[::2],
              "pytorch_model-00002-of-00002.bin": names[1::2]}
    for fname, keys in shards.items():
        torch.save({k: state[k] for k in keys}, path / fname)
    (path / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f for f, keys in shards.items() for k in keys}}))
    params = dict(get_model(kiln_config_for(path)).named_parameters())
    assert torch.equal(params["model.norm.weight"], state["model.norm.weight"])


def test_bin_holding_code_is_not_run(tiny_llama_dir, tmp_path):
    """A .bin is a pickle: loaded with weights_only, anything but tensors is an error."""
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    torch.save({"model.norm.weight": torch.ones(64), "extra": object()}, path / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin.*convert it to safetensors"):
        get_model(kiln_config_for(path))


def test_cut_bin_says_what_failed(tiny_llama_dir, tmp_path):
    """A truncated download: the refusal said only "not a state dict of tensors only"."""
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    torch.save(_state(tiny_llama_dir), path / "pytorch_model.bin")
    whole = (path / "pytorch_model.bin").read_bytes()
    (path / "pytorch_model.bin").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"pytorch_model\.bin .*zip archive.*damaged or "
                                          r"incomplete \(download it again\)"):
        get_model(kiln_config_for(path))


def test_damaged_safetensors_names_the_file(tiny_llama_dir, tmp_path):
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    (path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"model\.safetensors as safetensors.*download it again"):
        get_model(kiln_config_for(path))


def test_config_only_directory_names_the_files_it_looked_for(tiny_llama_dir, tmp_path):
    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*pytorch_model\.bin"):
        get_model(kiln_config_for(path))


def test_unsupported_architecture_lists_the_supported(tiny_llama_dir, tmp_path):
    path = _copy_with(tiny_llama_dir, tmp_path / "m",
                      config_edit=lambda c: c.update(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        get_model(kiln_config_for(path))


def test_config_without_architectures_uses_its_model_type(tiny_qwen2_dir, tmp_path):
    path = _copy_with(tiny_qwen2_dir, tmp_path / "m",
                      config_edit=lambda c: c.pop("architectures"))
    assert type(get_model(kiln_config_for(path))).__name__ == "Qwen2ForCausalLM"


@pytest.mark.parametrize("kind", ["empty", "missing"])
def test_empty_or_missing_directory_is_refused_at_construction(tmp_path, kind):
    from kiln import LLM

    path = tmp_path / "m"
    if kind == "empty":
        path.mkdir()
    with pytest.raises(FileNotFoundError, match=str(path)):
        LLM(model=str(path), dtype="float32", enforce_eager=True)


def test_directory_of_several_gguf_files_asks_for_one(tmp_path):
    from kiln.config import ModelConfig

    for name in ("a-Q4_0.gguf", "a-Q8_0.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"2 GGUF files \(a-Q4_0.gguf, a-Q8_0.gguf\); "
                       r"pass one file as --model"):
        ModelConfig(model=str(tmp_path))


def test_unknown_tensor_in_an_existing_layer_blames_no_layer_count(tiny_llama_dir, tmp_path):
    """It said "(the config has num_hidden_layers=2)" of layer 0, sending the user to a
    config field that is right."""
    state = {**_state(tiny_llama_dir), "model.layers.0.self_attn.foo.weight": torch.ones(3)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=r"self_attn\.foo\.weight matches no parameter of this "
                       r"llama model \(no llama layer has such a tensor\)") as e:
        get_model(kiln_config_for(path))
    assert "num_hidden_layers" not in str(e.value)


def test_a_layer_tensor_without_a_layer_number_is_refused_naming_it(tiny_llama_dir, tmp_path):
    """model.layers.extra.weight failed as int()'s 'invalid literal' traceback (a bare
    ValueError, reported as a bug) instead of the unexpected tensor it is."""
    state = {**_state(tiny_llama_dir), "model.layers.extra.weight": torch.ones(3)}
    path = _copy_with(tiny_llama_dir, tmp_path / "m", state)
    with pytest.raises(ConfigError, match=r"model\.layers\.extra\.weight matches no parameter"):
        get_model(kiln_config_for(path))


def test_an_unsupported_architecture_is_refused_before_its_fields_are_read(tiny_llama_dir,
                                                                           tmp_path):
    """A GPT-2 checkpoint (n_embd, no hidden_size) failed at construction, in the memory
    checks, as an AttributeError traceback ('the model config has no field hidden_size'),
    before the load that names the architecture."""
    from transformers import GPT2Config

    path = _copy_with(tiny_llama_dir, tmp_path / "m", weights=False)
    GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=512,
               architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    with pytest.raises(ConfigError, match=r"GPT2LMHeadModel is not supported.*LlamaForCausalLM"):
        kiln_config_for(path)
