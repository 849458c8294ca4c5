"""Every family Kiln serves with an fp8 KV cache takes a checkpoint's per-layer k_scale / v_scale:
each tiny HF checkpoint, given llm-compressor's KV-cache-only quantization_config (what makes
vLLM read the scales) and scales under the names its attention block gives them
(llm-compressor's `<attention>.k_scale`, its older `k_proj.output_scale`, a fused projection's
`qkv_proj.k_scale`), loads them into each Attention layer; a scale for a layer the model lacks
is skipped with a warning naming it (as vLLM does), not refused."""
import pytest
import torch
from safetensors.torch import load_file

from kiln.engine.arg_utils import EngineArgs
from kiln.model.layers.attention import Attention
from kiln.model.loader import build_model

from kv_cache_checkpoint import with_quantization_config

# ARCH_CONFIGS' families with a paged KV cache (DeepSeek's MLA latent cache takes no fp8)
FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "granite", "gemma", "olmo2", "starcoder2",
            "gpt_neox", "phi", "cohere", "mistral_window", "gemma2", "gemma3", "olmo3", "smollm3",
            "exaone4", "glm4", "seed_oss", "ernie4_5", "mixtral", "qwen2_moe", "qwen3_moe")
# the projection whose weight marks a layer's attention block in the checkpoint (HF's names)
_QKV = (".k_proj.weight", ".qkv_proj.weight", ".query_key_value.weight")


def _attention_blocks(tensors: dict) -> dict[int, tuple[str, str]]:
    """layer -> (its attention block's checkpoint prefix, the K projection's name part)."""
    blocks = {}
    for name in tensors:
        for suffix in _QKV:
            if name.endswith(suffix):
                prefix = name[:-len(suffix)]
                blocks[int(prefix.split(".layers.")[1].split(".")[0])] = (prefix, suffix[1:-7])
    return blocks


def _scales(layer: int) -> tuple[float, float]:
    return 0.25 + 0.125 * layer, 3.0 + layer


def _scale_names(prefix: str, proj: str, layer: int) -> tuple[str, str]:
    """Layer 0: the block's own k_scale / v_scale (llm-compressor's current names); layer 1:
    the projections' (k/v_proj.output_scale, or the fused projection's qkv_proj.k_scale)."""
    if layer == 0:
        return f"{prefix}.k_scale", f"{prefix}.v_scale"
    if proj == "k_proj":
        return f"{prefix}.k_proj.output_scale", f"{prefix}.v_proj.output_scale"
    return f"{prefix}.{proj}.k_scale", f"{prefix}.{proj}.v_scale"


def _load(model_dir, extra: dict, tmp_path):
    model_dir = with_quantization_config(model_dir, tmp_path / "kv")
    config = EngineArgs(model=str(model_dir), kv_cache_dtype="fp8").create_kiln_config()
    model = build_model(config)
    tensors = {**load_file(str(model_dir / "model.safetensors")), **extra}
    with torch.no_grad():
        model.load_weights(iter(tensors.items()))
    return {name: m for name, m in model.named_modules() if isinstance(m, Attention)}


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_its_attention_scales(family, request, tmp_path):
    model_dir = request.getfixturevalue(f"tiny_{family}_dir")
    blocks = _attention_blocks(load_file(str(model_dir / "model.safetensors")))
    assert sorted(blocks) == [0, 1], blocks
    extra = {}
    for layer, (prefix, proj) in blocks.items():
        for name, value in zip(_scale_names(prefix, proj, layer), _scales(layer)):
            extra[name] = torch.tensor(value)
    layers = _load(model_dir, extra, tmp_path)
    assert len(layers) == 2
    for name, attention in layers.items():
        layer = int(name.split(".layers.")[1].split(".")[0])
        assert (attention.impl.k_scale, attention.impl.v_scale) == _scales(layer), (family, name)


def test_a_scale_for_a_missing_layer_is_skipped_with_a_warning_naming_it(tiny_llama_dir,
                                                                         kiln_logs, tmp_path):
    extra = {"model.layers.0.self_attn.k_scale": torch.tensor(0.5),
             "model.layers.0.self_attn.v_scale": torch.tensor(2.0),
             # no layer 7 (2 layers), and no attention in an MLP
             "model.layers.7.self_attn.k_scale": torch.tensor(0.5),
             "model.layers.1.mlp.k_scale": torch.tensor(0.5)}
    layers = _load(tiny_llama_dir, extra, tmp_path)
    first = layers["model.layers.0.self_attn.attn"]
    assert (first.impl.k_scale, first.impl.v_scale) == (0.5, 2.0)
    second = layers["model.layers.1.self_attn.attn"]
    assert (second.impl.k_scale, second.impl.v_scale) == (1.0, 1.0)
    assert "2 KV cache scale tensor(s)" in kiln_logs.text
    assert "model.layers.7.self_attn.k_scale (for model.layers.7.self_attn.attn)" in kiln_logs.text
    assert "model.layers.1.mlp.k_scale (for model.layers.1.mlp.attn)" in kiln_logs.text
