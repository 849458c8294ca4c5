"""W8A8 int8 checkpoints in compressed-tensors' layout load (int8 weights, scales, `ignore`
honoured), schemes Kiln cannot run are refused naming the field, and online quantization
(`quantization="int8"`) quantizes the linears of a float checkpoint, HF or GGUF.
"""
import json
import re

import pytest
import torch
from model._attn_helper import kiln_config_for
from safetensors.torch import load_file

from kiln.errors import ConfigError
from kiln.model.layers.linear import LinearBase
from kiln.model.layers.quantization.compressed_tensors import UnsupportedQuantization
from kiln.model.layers.quantization.w8a8_int8 import int8_weight
from kiln.model.loader import get_model
from kiln.native import int8_ops

from w8a8_checkpoint import w8a8_quantization_config, write_w8a8_checkpoint


@pytest.fixture(scope="module")
def w8a8_dir(tiny_llama_dir, tmp_path_factory):
    return write_w8a8_checkpoint(tiny_llama_dir, tmp_path_factory.mktemp("w8a8"),
                                 scale_dtype=torch.bfloat16)


def _linears(model):
    return {n: m for n, m in model.named_modules() if isinstance(m, LinearBase)}


def _assert_packed_where_the_cpu_reads_panels(layer):
    """Packed into panels (the weight as stored let go) on a CPU whose GEMM reads them, else
    kept as stored; the same values either way (int8_weight)."""
    packed = int8_ops.packs_weights(layer.weight.shape[1], "cpu")
    assert (layer.weight_panels is not None) == packed and layer.weight.is_meta == packed
    assert int8_weight(layer).shape == layer.weight.shape


def test_checkpoint_loads_int8_weights_and_scales(w8a8_dir):
    cfg = kiln_config_for(w8a8_dir)
    assert cfg.model_config.quantization == "compressed-tensors"
    model = get_model(cfg)
    stored = load_file(str(w8a8_dir / "model.safetensors"))
    for layer in _linears(model).values():
        assert layer.weight.dtype == torch.int8 and layer.weight_scale.dtype == torch.float32
        assert layer.quant_method is not None
        _assert_packed_where_the_cpu_reads_panels(layer)
    qkv = model.model.layers[1].self_attn.qkv_proj
    prefix = "model.layers.1.self_attn."
    assert torch.equal(int8_weight(qkv), torch.cat([stored[prefix + p + ".weight"]
                                              for p in ("q_proj", "k_proj", "v_proj")]))
    assert torch.equal(qkv.weight_scale, torch.cat([
        stored[prefix + p + ".weight_scale"].float().reshape(-1)
        for p in ("q_proj", "k_proj", "v_proj")]))
    down = model.model.layers[0].mlp.down_proj  # row-parallel: its scales load whole
    assert torch.equal(down.weight_scale,
                       stored["model.layers.0.mlp.down_proj.weight_scale"].float().reshape(-1))
    # the LM head and the embedding stay float32 (lm_head is in `ignore`)
    assert model.lm_head.weight.dtype == torch.float32
    assert model.model.embed_tokens.weight.dtype == torch.float32


def test_ignore_list_leaves_those_layers_float(tiny_llama_dir, tmp_path):
    ignore = ["lm_head", "re:.*mlp.down_proj$", "model.layers.0.self_attn.o_proj"]
    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q", ignore=ignore)
    # a checkpoint stores ignored layers in float: put the float weights back for those
    from safetensors.torch import save_file
    floats = load_file(str(tiny_llama_dir / "model.safetensors"))
    state = load_file(str(d / "model.safetensors"))
    for name in list(state):
        if ".down_proj." in name or name.startswith("model.layers.0.self_attn.o_proj."):
            state.pop(name)
    for name, t in floats.items():
        if ".down_proj." in name or name.startswith("model.layers.0.self_attn.o_proj."):
            state[name] = t
    save_file(state, str(d / "model.safetensors"))
    model = get_model(kiln_config_for(d))
    layers = _linears(model)
    assert layers["model.layers.0.mlp.down_proj"].weight.dtype == torch.float32
    assert layers["model.layers.0.self_attn.o_proj"].weight.dtype == torch.float32
    assert layers["model.layers.1.self_attn.o_proj"].weight.dtype == torch.int8
    assert layers["model.layers.1.mlp.gate_up_proj"].weight.dtype == torch.int8


def _edited(src, dst, edit):
    d = write_w8a8_checkpoint(src, dst)
    config = json.loads((d / "config.json").read_text())
    edit(config["quantization_config"])
    (d / "config.json").write_text(json.dumps(config))
    return d


def _group(qc):
    return qc["config_groups"]["group_0"]


@pytest.mark.parametrize("edit, field", [
    (lambda qc: _group(qc)["input_activations"].update(dynamic=False, strategy="tensor"),
     "config_groups.group_0.input_activations.dynamic=False"),
    (lambda qc: _group(qc)["weights"].update(symmetric=False),
     "config_groups.group_0.weights.symmetric=False"),
    (lambda qc: _group(qc)["weights"].update(strategy="group", group_size=32),
     "config_groups.group_0.weights.strategy='group'"),
    (lambda qc: _group(qc)["weights"].update(num_bits=4),
     "config_groups.group_0.weights.num_bits=4"),
    (lambda qc: _group(qc).update(input_activations=None),
     "config_groups.group_0.input_activations=None"),
    (lambda qc: qc.update(format="pack-quantized"), "format='pack-quantized'"),
    # none given here nor in the group: the package's model says "fakequant", which the user
    # never wrote
    (lambda qc: qc.pop("format"), "config_groups.group_0.format=None"),
    (lambda qc: qc.update(ignore=[]), "ignore=[]"),
    # a rotation applied at run time, as QuIP / SpinQuant checkpoints hold
    (lambda qc: qc.update(transform_config={"config_groups": {"R4": {
        "type": "hadamard", "apply": [{"targets": ["re:.*down_proj$"], "location": "input"}]}}}),
     "transform_config="),
    (lambda qc: qc.update(sparsity_config={"format": "sparse-24-bitmask", "targets": ["Linear"]}),
     "sparsity_config.format='sparse-24-bitmask'"),
    # only q_proj targeted: Kiln's merged q/k/v would be part int8; the targets split it
    (lambda qc: _group(qc).update(targets=["re:.*q_proj$"]), "targets=['re:.*q_proj$']"),
    # a class other than Linear, or none: read as quantizing no linear, these were refused only
    # by the first int8 tensor's dtype, naming no field
    (lambda qc: _group(qc).update(targets=["Embedding"]),
     "config_groups.group_0.targets=['Embedding']"),
    (lambda qc: _group(qc).update(targets=["Linear", "LlamaAttention"]),
     "config_groups.group_0.targets=['Linear', 'LlamaAttention']"),
    (lambda qc: _group(qc).update(targets=[]), "config_groups.group_0.targets=[]"),
    (lambda qc: _group(qc).update(targets=["re:.*no_such_proj$"]),
     "config_groups targets=['re:.*no_such_proj$']"),
], ids=["static-activations", "asymmetric", "group-wise", "4-bit", "weight-only", "format",
        "no-format",
        "lm-head-quantized", "online-rotation", "sparse", "part-of-merged-targeted",
        "class-target", "class-target-beside-linear", "no-targets", "targets-match-nothing"])
def test_other_schemes_are_refused_naming_the_field(tiny_llama_dir, tmp_path, edit, field):
    d = _edited(tiny_llama_dir, tmp_path / "q", edit)
    with pytest.raises(UnsupportedQuantization, match=re.escape(f"quantization_config.{field}")):
        get_model(kiln_config_for(d))


def test_the_empty_sections_llm_compressor_writes_load(tiny_llama_dir, tmp_path):
    # actorder "weight": GPTQ's quantization order, stored like any per-channel weight
    d = _edited(tiny_llama_dir, tmp_path / "q", lambda qc: (qc.update(
        transform_config={}, sparsity_config={"format": "dense"}),
        _group(qc)["weights"].update(actorder="weight")))
    assert _linears(get_model(kiln_config_for(d)))[
        "model.layers.0.mlp.down_proj"].weight.dtype == torch.int8


@pytest.mark.parametrize("edit", [
    # compressed-tensors' int-quantized compressor is its naive-quantized one; vLLM takes both
    lambda qc: qc.update(format="naive-quantized"),
    # no top-level format, or "mixed-precision": each group's own says (helper-54)
    lambda qc: (qc.pop("format"), _group(qc).update(format="int-quantized")),
    lambda qc: (qc.update(format="mixed-precision"), _group(qc).update(format="int-quantized")),
], ids=["naive-quantized", "group-format", "mixed-precision"])
def test_int8_formats_load(tiny_llama_dir, tmp_path, edit):
    d = _edited(tiny_llama_dir, tmp_path / "q", edit)
    assert _linears(get_model(kiln_config_for(d)))[
        "model.layers.0.mlp.down_proj"].weight.dtype == torch.int8


def test_a_scheme_kept_as_compression_config_loads(tiny_llama_dir, tmp_path):
    """llm-compressor's first releases wrote it under config.json's compression_config (vLLM
    reads either): the checkpoint loaded as a float one and failed at its first int8 tensor."""
    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    config = json.loads((d / "config.json").read_text())
    config["compression_config"] = config.pop("quantization_config")
    (d / "config.json").write_text(json.dumps(config))
    cfg = kiln_config_for(d)
    assert cfg.model_config.quantization == "compressed-tensors"
    assert cfg.model_config.quant_kind == "int8"
    assert _linears(get_model(cfg))["model.layers.0.mlp.down_proj"].weight.dtype == torch.int8


def test_quant_method_is_read_in_any_case(tiny_llama_dir, tmp_path):
    """vLLM lowercases quant_method; Kiln refused "Compressed-Tensors" as an unknown method."""
    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    config = json.loads((d / "config.json").read_text())
    config["quantization_config"]["quant_method"] = "Compressed-Tensors"
    (d / "config.json").write_text(json.dumps(config))
    cfg = kiln_config_for(d)
    assert cfg.model_config.quantization == "compressed-tensors"
    assert _linears(get_model(cfg))["model.layers.0.mlp.down_proj"].weight.dtype == torch.int8


def test_symmetric_weights_zero_points_of_zero_are_skipped(tiny_llama_dir, tmp_path):
    """Older llm-compressor wrote a weight_zero_point of zeros beside symmetric int8 weights:
    nothing to apply, so it loads (it was refused as asymmetric); a nonzero one still is
    (test_tensors_of_unserved_schemes_are_refused_saying_what_they_are)."""
    from safetensors.torch import load_file, save_file

    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    files = sorted(d.glob("*.safetensors"))
    tensors = load_file(files[0])
    scales = [n for n in tensors if n.endswith(".weight_scale")]
    assert scales
    for n in scales:
        tensors[n.replace(".weight_scale", ".weight_zero_point")] = torch.zeros(
            tensors[n].shape, dtype=torch.int8)
    save_file(tensors, files[0], metadata={"format": "pt"})
    assert _linears(get_model(kiln_config_for(d)))[
        "model.layers.0.mlp.down_proj"].weight.dtype == torch.int8


@pytest.mark.parametrize("stage", [0, 1])
def test_a_pipeline_stage_whose_layers_are_all_ignored_loads_them_float(tiny_llama_dir, tmp_path,
                                                                        monkeypatch, stage):
    """Layer 0 int8, layer 1 stored float (ignored), a stage each at -pp 2: the stage holding
    layer 1 alone was refused as if targets / ignore selected no linear of the model."""
    from kiln.distributed import parallel_state

    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q", keep_float=r"model\.layers\.1\..*",
                              ignore=["lm_head", r"re:model\.layers\.1\..*"])
    monkeypatch.setitem(parallel_state._groups, "pp",
                        parallel_state.GroupInfo("pp", (0, 1), stage))
    layers = _linears(get_model(kiln_config_for(d)))
    assert layers and {name.split(".")[2] for name in layers} == {str(stage)}
    dtype = torch.float32 if stage else torch.int8
    assert all(m.weight.dtype == dtype for m in layers.values())
    # targets selecting nothing anywhere are still refused at -pp, by the first int8 tensor
    nothing = _edited(tiny_llama_dir, tmp_path / "none",
                      lambda qc: _group(qc).update(targets=["re:.*no_such_proj$"]))
    with pytest.raises(ConfigError, match="checkpoint dtype torch.int8 where torch.float32"):
        get_model(kiln_config_for(nothing))


@pytest.mark.parametrize("tensor, dtype, says", [
    # A GPTQ column order stored as a g_idx would change what the weight means: not read.
    ("weight_g_idx", torch.int32, "a group index"),
    # left over from a static or asymmetric scheme the config does not declare: it blamed
    # num_hidden_layers
    ("input_scale", torch.float32, "a static activation scale"),
    ("weight_zero_point", torch.int8, "a weight zero point"),
])
def test_tensors_of_unserved_schemes_are_refused_saying_what_they_are(tiny_llama_dir, tmp_path,
                                                                      tensor, dtype, says):
    from safetensors.torch import save_file

    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    state = load_file(str(d / "model.safetensors"))
    state[f"model.layers.0.mlp.down_proj.{tensor}"] = torch.ones(128, dtype=dtype)
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match=f"down_proj.{tensor} is {says}") as e:
        get_model(kiln_config_for(d))
    assert "num_hidden_layers" not in str(e.value)


def test_other_quant_methods_and_conflicting_flags_are_refused(tiny_llama_dir, w8a8_dir,
                                                                tmp_path):
    with pytest.raises(ConfigError, match="drop --quantization"):
        kiln_config_for(w8a8_dir, quantization="int8")
    d = _edited(tiny_llama_dir, tmp_path / "bnb",
                lambda qc: qc.update(quant_method="bitsandbytes"))
    with pytest.raises(ConfigError, match="quant_method='bitsandbytes' is not supported"):
        kiln_config_for(d)
    with pytest.raises(ConfigError, match="quantization must be one of int8, fp8, ptpc_fp8, "
                                          "compressed-tensors"):
        kiln_config_for(tiny_llama_dir, quantization="fp4")
    with pytest.raises(ConfigError, match="needs a checkpoint whose config.json has a "
                                          "quantization_config"):
        kiln_config_for(tiny_llama_dir, quantization="compressed-tensors")


def test_a_float_tensor_where_int8_is_expected_is_refused(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file
    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    state = load_file(str(d / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].float()
    save_file(state, str(d / "model.safetensors"))
    with pytest.raises(ConfigError, match="up_proj.weight: checkpoint dtype torch.float32 where "
                                          "torch.int8 is expected"):
        get_model(kiln_config_for(d))


def test_w8a8_preset_is_what_compressed_tensors_writes():
    """The tests' config is compressed-tensors' own W8A8 preset (not a hand-made look-alike)."""
    from compressed_tensors.quantization import preset_name_to_scheme
    preset = preset_name_to_scheme("W8A8", ["Linear"])
    group = w8a8_quantization_config()["config_groups"]["group_0"]
    for part in ("weights", "input_activations"):
        for key in ("num_bits", "type", "symmetric", "strategy", "dynamic"):
            assert group[part][key] == getattr(getattr(preset, part), key), (part, key)


@pytest.mark.parametrize("arch", ["llama", "phi3", "granite", "gemma", "olmo2", "gemma3",
                                  "starcoder2", "gpt_neox", "phi", "cohere"])
def test_online_int8_quantizes_linears_per_channel(arch, request):
    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    float_model = get_model(kiln_config_for(model_dir))
    # unrotated: the stored weights themselves quantized (llama's are rotated first by default)
    model = get_model(kiln_config_for(model_dir, quantization="int8",
                                      quantization_rotation="none"))
    floats = _linears(float_model)
    for name, layer in _linears(model).items():
        w = floats[name].weight
        assert layer.weight.dtype == torch.int8
        _assert_packed_where_the_cpu_reads_panels(layer)
        assert torch.equal(layer.weight_scale, w.abs().amax(1) / 127)
        # per channel: dequantized within half a step of the float weight
        err = (int8_weight(layer).float() * layer.weight_scale[:, None] - w).abs()
        assert (err <= layer.weight_scale[:, None] * 0.5 * (1 + 1e-5)).all()
    assert model.lm_head.weight.dtype == torch.float32


def test_gpt_neox_checkpoint_loads_by_its_own_names(tiny_gpt_neox_dir, tmp_path):
    """GPT-NeoX's W8A8 checkpoint: its per-head fused query_key_value and scales split into
    q / k / v rows, an ignore list and the head written against its names (embed_out)."""
    d = write_w8a8_checkpoint(tiny_gpt_neox_dir, tmp_path / "q", keep_float=r".*dense_4h_to_h",
                              ignore=["embed_out", "re:.*dense_4h_to_h$"])
    model = get_model(kiln_config_for(d))
    layers = _linears(model)
    assert layers["model.layers.0.mlp.c_proj"].weight.dtype == torch.float32
    qkv = layers["model.layers.1.self_attn.qkv_proj"]
    stored = load_file(str(d / "model.safetensors"))
    name = "gpt_neox.layers.1.attention.query_key_value."
    per_head = [stored[name + t].reshape(4, 3, 16, -1) for t in ("weight", "weight_scale")]
    weight, scale = (t.transpose(0, 1).reshape(3 * 64, -1) for t in per_head)  # q | k | v
    assert torch.equal(int8_weight(qkv), weight)
    assert torch.equal(qkv.weight_scale, scale.float().reshape(-1))
    assert layers["model.layers.0.mlp.c_fc"].weight.dtype == torch.int8


def test_phi_checkpoint_loads_by_its_own_names(tiny_phi_dir, tmp_path):
    """Phi's W8A8 checkpoint: dense / fc1 / fc2 and their scales load into o_proj / c_fc /
    c_proj, an ignore list written against its names keeps fc2 float; the head's bias loads."""
    d = write_w8a8_checkpoint(tiny_phi_dir, tmp_path / "q", keep_float=r".*fc2",
                              ignore=["lm_head", "re:.*fc2$"])
    model = get_model(kiln_config_for(d))
    layers = _linears(model)
    stored = load_file(str(d / "model.safetensors"))
    assert layers["model.layers.0.mlp.c_proj"].weight.dtype == torch.float32
    assert torch.equal(int8_weight(layers["model.layers.1.mlp.c_fc"]),
                       stored["model.layers.1.mlp.fc1.weight"])
    dense = layers["model.layers.1.self_attn.o_proj"]
    assert torch.equal(int8_weight(dense), stored["model.layers.1.self_attn.dense.weight"])
    assert torch.equal(dense.bias, stored["model.layers.1.self_attn.dense.bias"])
    assert torch.equal(model.lm_head.bias, stored["lm_head.bias"])


def test_online_int8_on_a_gguf_file(tiny_llama_dir, tmp_path):
    from model.test_gguf_vs_hf import write_gguf

    from kiln.model.layers import cpu_gemm
    from kiln.native import linear_op

    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama_dir)
    model = get_model(kiln_config_for(path, quantization="int8"))
    layers = _linears(model)
    assert layers and all(m.weight.dtype == torch.int8 for m in layers.values())
    assert model.model.embed_tokens.weight.dtype == torch.float32
    if linear_op.available():  # the float weights' GGUF blocks went with them
        assert not any(cpu_gemm.held(m).blocks for m in layers.values())


@pytest.mark.parametrize("arch, tensor", [
    ("llama", "model.layers.0.self_attn.q_proj.weight_scale"),
    ("mixtral", "model.layers.1.block_sparse_moe.experts.2.w2.weight_scale")])
def test_a_scale_holding_nan_is_refused_naming_it(arch, tensor, request, tmp_path):
    """A damaged scale loaded and ran: its rows computed NaN and the model generated token 0
    forever."""
    from safetensors.torch import save_file

    d = write_w8a8_checkpoint(request.getfixturevalue(f"tiny_{arch}_dir"), tmp_path / "q",
                              ignore=["lm_head", "re:.*block_sparse_moe.gate$"])
    state = load_file(str(d / "model.safetensors"))
    state[tensor][3] = float("nan")
    save_file(state, str(d / "model.safetensors"))
    # (the loader names Mixtral's block `mlp`, as transformers 5 does)
    named = tensor.split("layers.")[1].split(".", 2)[2]
    with pytest.raises(ConfigError, match=re.escape(named) + ": weight_scale holds 1 NaN"):
        get_model(kiln_config_for(d))
