"""Gemma-3's decisions without an engine: each kind of layer roped from its own entry of
rope_parameters nested by layer type (also under --disable-sliding-window), the length not
rescaled by the global layers' linear factor (as vLLM reads Gemma-3's), the legacy rope
overrides landing in the right entry, no attention soft cap. Greedy tokens and logprobs against
HF: tests/e2e/test_sliding_window.py; GGUF files: tests/model/test_gguf_families.py."""
import pytest
import torch

from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.config.hf_overrides import apply_hf_overrides
from kiln.config.rope import get_rope_config
from kiln.errors import ConfigError
from kiln.model.loader import get_model
from model._attn_helper import kiln_config_for

LOCAL = {"rope_type": "default", "rope_theta": 100.0}
GLOBAL = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}


def _nested(**extra) -> HFConfigSnapshot:
    return HFConfigSnapshot({"architectures": ["Gemma3ForCausalLM"], "rope_parameters": {
        "sliding_attention": dict(LOCAL), "full_attention": dict(GLOBAL)}, **extra})


def test_each_layer_type_reads_its_own_rope_entry():
    config = _nested()
    assert get_rope_config(config, "sliding_attention") == (100.0, None)
    theta, scaling = get_rope_config(config, "full_attention")
    assert theta == 10000.0 and scaling["rope_type"] == "linear" and scaling["factor"] == 4.0
    with pytest.raises(ConfigError, match="no entry for the layer type 'chunked_attention'"):
        get_rope_config(config, "chunked_attention")
    # a family that ropes every layer alike still refuses the nested form, naming itself
    with pytest.raises(ConfigError, match="nested by layer type .* not supported for "
                                          "Gemma3ForCausalLM"):
        get_rope_config(config)


def test_the_legacy_rope_overrides_reach_their_layer_type():
    out = apply_hf_overrides(_nested(), {"rope_theta": 5e5, "rope_local_base_freq": 50.0})
    assert out.rope_parameters == {"sliding_attention": {**LOCAL, "rope_theta": 50.0},
                                   "full_attention": {**GLOBAL, "rope_theta": 5e5}}
    out = apply_hf_overrides(_nested(), {"rope_scaling": None})
    assert get_rope_config(out, "full_attention") == (10000.0, None)
    assert get_rope_config(out, "sliding_attention") == (100.0, None)


def test_the_model_ropes_by_layer_type_and_keeps_the_length(tiny_gemma3_dir):
    """Layer 0 slides (base 100), layer 1 is global (base 10000, positions / 4); the window
    disabled keeps each layer's rope. max_position_embeddings is not multiplied by the factor."""
    def inv_freq(base, factor=1.0):
        return 1.0 / (base ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16)) / factor

    for disable in (False, True):
        cfg = kiln_config_for(tiny_gemma3_dir, disable_sliding_window=disable)
        assert cfg.model_config.max_model_len == (8 if disable else 512)
        layers = get_model(cfg).model.layers
        torch.testing.assert_close(layers[0].self_attn.rotary_emb.inv_freq, inv_freq(100.0))
        torch.testing.assert_close(layers[1].self_attn.rotary_emb.inv_freq,
                                   inv_freq(10000.0, 4.0))
        assert [layer.self_attn.attn.sliding_window for layer in layers] == \
            ([None, None] if disable else [8, None])


def test_attention_soft_cap_is_not_applied():
    """HF's Gemma-3 attention passes no soft cap to its attention, whatever the config says."""
    from kiln.model.gemma3 import Gemma3Attention

    config = HFConfigSnapshot({"attn_logit_softcapping": 50.0})
    assert Gemma3Attention.logits_soft_cap(None, config) is None


def _table(arch: str, layers: int, **meta) -> dict:
    values = {"block_count": layers, "context_length": 4096, "embedding_length": 5376,
              "feed_forward_length": 64, "attention.head_count": 32,
              "attention.head_count_kv": 16, "attention.layer_norm_rms_epsilon": 1e-6,
              "attention.key_length": 128, **meta}
    metadata = {f"{arch}.{k}": {"type": "UINT32" if isinstance(v, int) else "FLOAT32",
                                "value": v} for k, v in values.items()}
    metadata["tokenizer.ggml.tokens"] = {"type": "ARRAY", "count": 1000}
    return {"architecture": arch, "metadata": metadata,
            "tensors": [{"name": "token_embd.weight"}]}


@pytest.mark.parametrize("arch, layers_27b", [("gemma2", 46), ("gemma3", 62)])
def test_gguf_configs_read_what_llama_cpp_reads(arch, layers_27b):
    """llama.cpp's attention scale: 1 / sqrt(hidden / heads) for the 27B models (by layer
    count), 1 / sqrt(head_dim) else; Gemma-2's soft caps 50 / 30 where the file has none;
    Gemma-3's local base 10000; the vocabulary the file's tokens (Gemma-3 files drop rows)."""
    from kiln.config.gguf_arch_config import build_config

    small = build_config(_table(arch, 6, **{"attention.sliding_window": 16}))
    big = build_config(_table(arch, layers_27b, **{"attention.sliding_window": 16}))
    assert small.query_pre_attn_scalar == 128 and big.query_pre_attn_scalar == 5376 // 32
    assert small.vocab_size == 1000 and small.sliding_window == 16
    every = 2 if arch == "gemma2" else 6
    assert small.layer_types == ["full_attention" if (i + 1) % every == 0 else
                                 "sliding_attention" for i in range(6)]
    if arch == "gemma2":
        assert (small.attn_logit_softcapping, small.final_logit_softcapping) == (50.0, 30.0)
    else:
        assert small.final_logit_softcapping is None
        assert get_rope_config(small, "sliding_attention") == (10000.0, None)
        no_window = build_config(_table(arch, 6))  # llama.cpp: every layer global
        assert set(no_window.layer_types) == {"full_attention"}


def test_the_multimodal_checkpoint_is_refused_pointing_to_the_text_ones(tmp_path):
    """gemma-3-4b and up are Gemma3ForConditionalGeneration (a vision tower beside the text)."""
    import json

    from kiln.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": {"model_type": "gemma3_text", "hidden_size": 64,
                        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16},
        "vision_config": {"model_type": "siglip_vision_model"}}))
    with pytest.raises(ConfigError, match=r"Gemma3ForConditionalGeneration is not supported "
                       r"\(its vision tower is not .*Gemma3ForCausalLM: gemma-3-270m"):
        ModelConfig(model=str(tmp_path))
