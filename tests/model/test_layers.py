"""Unit tests of the model's building blocks: rope config/frequencies, linear loaders, registry."""
import pytest
import torch

from kiln.config.rope import get_rope_config
from kiln.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from kiln.model.layers.rotary_embedding import compute_inv_freq
from kiln.model.registry import get_model_class

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def test_rope_config_from_transformers_config():
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=LLAMA3)
    theta, scaling = get_rope_config(cfg)
    assert theta == 500000.0 and scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    theta, scaling = get_rope_config(LlamaConfig(rope_theta=1234.0))
    assert theta == 1234.0 and scaling is None


def test_rope_config_legacy_attributes_and_rejects_unknown():
    class Legacy:
        rope_theta = 5e5
        rope_scaling = {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}

    theta, scaling = get_rope_config(Legacy())
    assert theta == 5e5 and scaling["rope_type"] == "llama3"

    class Dynamic:
        rope_parameters = {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4.0}

    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        get_rope_config(Dynamic())

    class YarnWithoutLength:  # HF's default original length is max_position_embeddings
        rope_parameters = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}

    with pytest.raises(ValueError, match="original_max_position_embeddings must be a finite "
                                         "number > 0 for rope_type 'yarn', got None"):
        get_rope_config(YarnWithoutLength())


@pytest.mark.parametrize("scaling", [None, LLAMA3, {"rope_type": "linear", "factor": 2.0}])
def test_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = dict(hidden_size=256, num_attention_heads=4, rope_theta=500000.0,
              max_position_embeddings=131072)
    cfg = LlamaConfig(**kw, rope_scaling=scaling) if scaling else LlamaConfig(**kw)
    theta, parsed = get_rope_config(cfg)
    ours = compute_inv_freq(64, theta, parsed)
    if scaling is None:
        ref = 1.0 / (theta ** (torch.arange(0, 64, 2, dtype=torch.int64).float() / 64))
    else:
        ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    assert torch.allclose(ours, ref, rtol=1e-6, atol=0)


def test_qkv_loader_places_shards_and_splits_for_tensor_parallel():
    hidden, hd, nh, nkv = 8, 2, 4, 2
    q = torch.arange(nh * hd * hidden, dtype=torch.float32).view(nh * hd, hidden)
    k, v = q[: nkv * hd] + 1000, q[: nkv * hd] + 2000
    full = QKVParallelLinear(hidden, hd, nh, nkv, bias=False)
    for sid, t in (("q", q), ("k", k), ("v", v)):
        full.weight.weight_loader(full.weight, t, sid)
    assert torch.equal(full.weight, torch.cat([q, k, v]))
    rank1 = QKVParallelLinear(hidden, hd, nh, nkv, bias=False, tp_rank=1, tp_size=2)
    for sid, t in (("q", q), ("k", k), ("v", v)):
        rank1.weight.weight_loader(rank1.weight, t, sid)
    assert torch.equal(rank1.weight, torch.cat([q[4:], k[2:], v[2:]]))


def test_merged_gate_up_loader_and_shape_check():
    layer = MergedColumnParallelLinear(3, [4, 4], bias=False)
    gate, up = torch.randn(4, 3), torch.randn(4, 3)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    assert torch.equal(layer.weight, torch.cat([gate, up]))
    with pytest.raises(ValueError, match="shape mismatch"):
        layer.weight.weight_loader(layer.weight, torch.randn(5, 3), 0)


def test_registry():
    assert get_model_class("MistralForCausalLM") is get_model_class("LlamaForCausalLM")
    assert get_model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    with pytest.raises(ValueError, match="architecture GPT2LMHeadModel is not supported; "
                                         "supported: .*LlamaForCausalLM"):
        get_model_class("GPT2LMHeadModel")
