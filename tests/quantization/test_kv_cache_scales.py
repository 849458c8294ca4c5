"""An fp8 KV cache's checkpoint scales without a model: the tensor names vLLM remaps to a layer's
k_scale / v_scale, their checks, the scales a layer runs with (vLLM's rules), and the
compressed-tensors kv_cache_scheme Kiln accepts (static symmetric per-tensor 8-bit float)."""
import pytest
import torch

from kiln.attention.kv_cache_dtype import from_cache, through_cache, to_cache
from kiln.attention.kv_cache_scales import (
    checkpoint_cache_dtype,
    checkpoint_scale,
    effective_scales,
    kv_scale_target,
)
from kiln.errors import ConfigError
from kiln.model.layers.quantization.compressed_tensors import (
    UnsupportedQuantization,
    parse_no_linear,
    parse_w8a8_int8,
    quantizes_no_linear,
)

from w8a8_checkpoint import w8a8_quantization_config

KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


@pytest.mark.parametrize("name,want", [
    ("model.layers.3.self_attn.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.k_proj.output_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_proj.output_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.attn.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.attn.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.kv_scale", ("model.layers.3.self_attn.attn", "kv")),
    ("model.layers.3.self_attn.q_proj.output_scale", ("model.layers.3.self_attn.attn", "q")),
    ("model.layers.3.self_attn.attn.prob_scale", ("model.layers.3.self_attn.attn", "prob")),
    # vLLM's other remapped names: ModelOpt's, a fused projection's (Phi-3, GPT-NeoX after
    # Kiln's renames), Hunyuan's, the fp8 config's prob scale
    ("model.layers.3.self_attn.k_proj.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_proj.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.qkv_proj.k_scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.qkv_proj.v_scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.k_cache.scale", ("model.layers.3.self_attn.attn", "k")),
    ("model.layers.3.self_attn.v_cache.scale", ("model.layers.3.self_attn.attn", "v")),
    ("model.layers.3.self_attn.q.scale", ("model.layers.3.self_attn.attn", "q")),
    ("model.layers.3.self_attn.prob_output_scale", ("model.layers.3.self_attn.attn", "prob")),
    ("model.layers.3.self_attn.k_proj.weight_scale", None),
    ("model.layers.3.self_attn.qkv_proj.weight_scale", None),
    ("model.layers.3.self_attn.qkv_proj.output_scale", None),
    ("model.layers.3.self_attn.k_proj.input_scale", None),
    ("model.layers.3.self_attn.k_proj.weight", None),
    ("model.layers.3.mlp.q.scale", None),  # Hunyuan's names only inside self_attn
])
def test_checkpoint_names_map_to_their_attention_layer_as_vllm_remaps_them(name, want):
    assert kv_scale_target(name) == want


def test_a_scale_must_be_one_finite_positive_value_naming_the_tensor():
    assert checkpoint_scale("a.k_scale", torch.tensor(0.5, dtype=torch.bfloat16)) == 0.5
    assert checkpoint_scale("a.k_scale", torch.tensor([2.0])) == 2.0
    for bad in (float("nan"), 0.0, -1.0, float("inf")):
        with pytest.raises(ConfigError, match=r"checkpoint tensor x\.v_scale is .*finite and > 0"):
            checkpoint_scale("x.v_scale", torch.tensor(bad))
    with pytest.raises(ConfigError, match=r"x\.k_scale has shape \[4\].*one scale per layer"):
        checkpoint_scale("x.k_scale", torch.ones(4))


def test_the_scales_a_layer_runs_with_follow_vllm():
    assert effective_scales("fp8", 0.5, 2.0) == (0.5, 2.0)
    assert effective_scales("fp8", None, None) == (1.0, 1.0)  # none in the checkpoint
    assert effective_scales("fp8", 0.25, None) == (0.25, 0.25)  # a single kv_scale
    # "auto": read, and not used (vLLM's BaseKVCacheMethod: 1.0 whatever the checkpoint gives)
    assert effective_scales("auto", 0.5, 2.0) == (1.0, 1.0)


def test_the_torch_write_divides_and_the_read_multiplies():
    x = torch.tensor([1.0, -3.0, 100.0, 1000.0])
    stored = to_cache(x, torch.float8_e4m3fn, 4.0)
    assert stored.float().tolist() == [0.25, -0.75, 24.0, 256.0]
    assert from_cache(stored, torch.float32, 4.0).tolist() == [1.0, -3.0, 96.0, 1024.0]
    assert torch.equal(through_cache(x, torch.float8_e4m3fn, 4.0), from_cache(stored, x.dtype, 4.0))
    # saturated after the division: 448 * scale is the largest a scaled e4m3 cache holds
    assert to_cache(torch.tensor([1e6]), torch.float8_e4m3fn, 2.0).float().item() == 448.0
    assert torch.equal(to_cache(x, torch.float8_e4m3fn, 1.0).view(torch.uint8),
                       to_cache(x, torch.float8_e4m3fn).view(torch.uint8))


def test_a_per_tensor_static_symmetric_fp8_kv_cache_scheme_is_accepted():
    parse_w8a8_int8(w8a8_quantization_config(kv_cache_scheme=KV_SCHEME))


@pytest.mark.parametrize("field,value", [
    ("strategy", "channel"), ("strategy", "attn_head"), ("dynamic", True),
    ("symmetric", False), ("num_bits", 4), ("type", "int"),
])
def test_any_other_kv_cache_scheme_is_refused_naming_its_field(field, value):
    scheme = {**KV_SCHEME, field: value}
    with pytest.raises(UnsupportedQuantization,
                       match=rf"kv_cache_scheme\.{field}={value!r} is not supported"):
        parse_w8a8_int8(w8a8_quantization_config(kv_cache_scheme=scheme))


def test_a_kv_cache_scheme_makes_auto_an_fp8_cache_as_vllm_does():
    ct = {"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME}
    assert checkpoint_cache_dtype("auto", ct) == "fp8"
    assert checkpoint_cache_dtype("fp8_e4m3", ct) == "fp8_e4m3"  # asked for: kept
    assert checkpoint_cache_dtype("fp8_e5m2", ct) == "fp8_e5m2"  # refused later, by flag
    assert checkpoint_cache_dtype("auto", {**ct, "kv_cache_scheme": None}) == "auto"
    assert checkpoint_cache_dtype("auto", None) == "auto"
    assert checkpoint_cache_dtype("auto", {"quant_method": "gptq", "bits": 4}) == "auto"


def test_a_kv_cache_scheme_alone_quantizes_no_linear():
    kv_only = w8a8_quantization_config(config_groups={}, kv_cache_scheme=KV_SCHEME)
    assert quantizes_no_linear(kv_only)
    assert "only the KV cache is quantized" in parse_no_linear(kv_only)
    assert not quantizes_no_linear(w8a8_quantization_config(kv_cache_scheme=KV_SCHEME))
    with pytest.raises(UnsupportedQuantization, match=r"config_groups=\{\} is not supported.*"
                                                      r"needs at least one group"):
        parse_w8a8_int8(w8a8_quantization_config(config_groups={}))
    with pytest.raises(UnsupportedQuantization, match=r"kv_cache_scheme\.dynamic=True"):
        parse_no_linear({**kv_only, "kv_cache_scheme": {**KV_SCHEME, "dynamic": True}})


def test_a_kv_cache_scheme_alone_may_leave_config_groups_out_or_null():
    """quantizes_no_linear takes a config without config_groups (left out, as vLLM reads it, or
    null) as KV-cache-only, and the engine resolves it so (float linears, an fp8 cache): its
    check must take it too; compressed-tensors' own model requires the field, so it was
    refused at load as 'not a valid compressed-tensors config'."""
    kv_only = w8a8_quantization_config(config_groups={}, kv_cache_scheme=KV_SCHEME)
    for raw in ({k: v for k, v in kv_only.items() if k != "config_groups"},
                {**kv_only, "config_groups": None}):
        assert quantizes_no_linear(raw)
        parse_no_linear(raw)
        with pytest.raises(UnsupportedQuantization, match=r"kv_cache_scheme\.dynamic=True"):
            parse_no_linear({**raw, "kv_cache_scheme": {**KV_SCHEME, "dynamic": True}})


def test_the_default_scale_warning_is_for_an_e4m3_cache_left_at_one():
    from kiln.attention.kv_cache_scales import default_scale_warning

    scheme = {"quant_method": "compressed-tensors", "kv_cache_scheme": KV_SCHEME}
    text = default_scale_warning("fp8", 3, 4, scheme)
    assert "kv_cache_scheme" in text and "3 of its 4 attention layer(s)" in text
    assert "llm-compressor" in text
    assert "--kv-cache-dtype fp8_e4m3 runs" in default_scale_warning("fp8_e4m3", 1, 1, None)
    assert default_scale_warning("fp8", 0, 4, scheme) is None  # every layer scaled
    assert default_scale_warning("fp8_e5m2", 4, 4, None) is None  # vLLM: e5m2 runs unscaled
    assert default_scale_warning("auto", 4, 4, scheme) is None
