"""GGUF files of OLMo-3, SmolLM3, EXAONE-4, GLM-4, Seed-OSS and ERNIE-4.5 as llama.cpp's converter
writes them (OLMo-3 as olmo2 with a window and a per-layer pattern, SmolLM3's q/k rows permuted and
its every 4th layer NoPE by llama.cpp's rule, EXAONE-4's window and pattern, GLM-4's fused ffn_up,
sandwich norms and rope.dimension_count of half a head, Seed-OSS's o_proj bias, ERNIE-4.5's biases
and interleaved rope left unpermuted): Kiln's logits from the file (eager) against HF's from the
checkpoint (on the values gguf dequantizes the file's tensors to)."""
import pytest

from kiln.config import gguf_metadata
from model.test_gguf_families import write_family_gguf
from model.test_gguf_vs_hf import TOL, logits_diff

from checkpoints import make_tiny_checkpoint

_SHARED_BASE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))


@pytest.mark.parametrize("family, arch, overrides, types, expect", [
    # llama.cpp ropes both kinds from one base, the global layer linearly x2; window 8
    ("olmo3", "olmo2", {"rope_parameters": _SHARED_BASE}, {"attn_q": "Q8_0"},
     {"architectures": ["Olmo3ForCausalLM"], "sliding_window": 8,
      "layer_types": ["sliding_attention", "full_attention"]}),
    # 4 layers: the 4th NoPE, which llama.cpp fixes (the file says nothing of it)
    ("smollm3", "smollm3", {"num_hidden_layers": 4, "no_rope_layers": [1, 1, 1, 0]},
     {"attn_k": "F16"}, {"no_rope_layers": [1, 1, 1, 0]}),
    ("exaone4", "exaone4", {}, {"ffn_up": "F16"},
     {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}),
    ("glm4", "glm4", {}, {"ffn_up": "F16"}, {"head_dim": 16}),
    ("seed_oss", "seed_oss", {}, {}, {"attention_out_bias": True}),
    ("ernie4_5", "ernie4_5", {}, {"attn_output": "F16"}, {"use_bias": True}),
], ids=["olmo3", "smollm3", "exaone4", "glm4", "seed_oss", "ernie4_5"])
def test_new_family_gguf_matches_hf(family, arch, overrides, types, expect, tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", family, tie=family != "seed_oss",
                                  **overrides)
    path = write_family_gguf(tmp_path / "m.gguf", hf_dir, arch, types)
    config = gguf_metadata.load_config(path)
    assert {field: getattr(config, field) for field in expect} == expect
    # 30 tokens: past the window of 8 where there is one; prefill and 4 decode steps
    assert logits_diff(path, hf_dir) < TOL


def test_a_glm4_rotary_count_other_than_half_a_head_follows_the_file(tmp_path):
    """GLM-4's share of each head roped is the file's rope.dimension_count (llama.cpp's n_rot),
    not a fixed half: a quarter here, HF's partial_rotary_factor 0.25."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "glm4", tie=True,
                                  partial_rotary_factor=0.25)
    path = write_family_gguf(tmp_path / "m.gguf", hf_dir, "glm4")
    from kiln.config.rope import partial_rotary_factor_of

    assert partial_rotary_factor_of(gguf_metadata.load_config(path)) == 0.25
    assert logits_diff(path, hf_dir) < TOL
