"""GGUF files of Phi-3, Gemma, Gemma-2, Gemma-3, Granite and OLMo-2 written as llama.cpp's
converter writes them (Phi-3's fused attn_qkv and gate/up ffn_up, Gemma's norms stored as 1 + w
and no rope base, Gemma-2 / 3's pre/post block norms, soft caps and window as metadata,
Granite's permuted q/k rows and its four scales as metadata, OLMo-2's post-block norms): Kiln's
logits from the file against HF's from the checkpoint (the values gguf dequantizes the file's
tensors to), in mixed storage types."""
import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from kiln.config import gguf_metadata
from kiln.model.loader.gguf_names import unpermute_rope_rows
from model.test_gguf import llama_cpp_permute
from model.test_gguf_vs_hf import TOL, logits_diff

from checkpoints import make_tiny_checkpoint
from gguf_blocks import quantized_blocks

_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_FAMILY_PARTS = {"phi3": {"self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"},
                 **{arch: {"post_attention_layernorm": "post_attention_norm",
                           "post_feedforward_layernorm": "post_ffw_norm"}
                    for arch in ("olmo2", "exaone4")},
                 "glm4": {"post_self_attn_layernorm": "post_attention_norm",
                          "post_mlp_layernorm": "post_ffw_norm", "mlp.gate_up_proj": "ffn_up"},
                 "seed_oss": {"post_attention_layernorm": "post_attention_norm"},
                 **{arch: {"post_attention_layernorm": "post_attention_norm",
                           "pre_feedforward_layernorm": "ffn_norm",
                           "post_feedforward_layernorm": "post_ffw_norm"}
                    for arch in ("gemma2", "gemma3")}}
GEMMAS = ("gemma", "gemma2", "gemma3")
PERMUTED = ("granite", "smollm3")  # llama.cpp's LlamaModel-style q/k row permutation
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))


def _metadata(w, arch: str, c) -> None:
    """The metadata llama.cpp's converter writes for `arch` (gemma, gemma2: no rope base;
    gemma2 / 3: the window and soft caps, gemma3's global rope base and linear scaling)."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in GEMMAS:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch in ("gemma2", "gemma3"):
        w.add_sliding_window(c.sliding_window)
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
    elif arch == "gemma3":
        rope = c.rope_parameters["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    elif arch != "gemma":
        rope = c.rope_parameters.get("full_attention", c.rope_parameters)  # OLMo-3's nested
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1)))
        if rope["rope_type"] == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch in ("olmo2", "exaone4") and getattr(c, "sliding_window", None):  # OLMo-3 / EXAONE-4
        w.add_sliding_window(c.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        w.add_sliding_window(0)
    if arch == "granite":
        w.add_attention_scale(c.attention_multiplier)
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_logit_scale(c.logits_scaling)
    tokens = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(3, c.vocab_size)]
    w.add_tokenizer_model("llama" if arch in (*GEMMAS, "phi3") else "gpt2")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types([1] * len(tokens))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def write_family_gguf(path, hf_dir, arch: str, types: dict | None = None, skip: tuple = ()):
    """hf_dir's checkpoint as an `arch` GGUF (types: llama.cpp name part -> Q8_0 / Q4_0 / F16,
    F32 elsewhere; a tied head not stored, Gemma's never; `skip`: GGUF names left out);
    hf_dir's weights are then replaced by what gguf dequantizes the file's to, HF's
    reference."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, c)
    scaling = c.rope_parameters
    if scaling.get("rope_type") == "longrope":  # Phi-3 128k: factors as tensors
        w.add_rope_scaling_attn_factors(0.9)  # not HF's default: it must come from the file
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
        c.rope_parameters = {**scaling, "attention_factor": 0.9}
    parts = {**_PARTS, **_FAMILY_PARTS.get(arch, {})}
    state = load_file(str(hf_dir / "model.safetensors"))
    for name, t in sorted(state.items()):
        if name == "lm_head.weight" and (c.tie_word_embeddings or arch in GEMMAS):
            continue
        p = name.split(".")
        gname = _GLOBAL.get(name) or f"blk.{p[2]}.{parts['.'.join(p[3:-1])]}.{p[-1]}"
        if gname in skip:
            continue
        a = t.float().numpy()
        heads = None
        if arch in PERMUTED and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = c.num_attention_heads if ".attn_q." in gname else c.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        if arch in GEMMAS and name.endswith("norm.weight"):
            a = a + 1  # Gemma's (1 + w), as the converter stores it (q/k norms too)
        kind = (types or {}).get(gname.split(".")[-2], "F32") if t.dim() == 2 else "F32"
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        data = a.astype(np.float32 if kind == "F32" else np.float16) if kind in ("F32", "F16") \
            else quantized_blocks(a, kind)
        w.add_tensor(gname, data, raw_dtype=qtype)
        if kind != "F32":  # the reference: what gguf dequantizes, in HF's row order
            back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(a.shape)
            state[name] = t.new_tensor(back if heads is None else unpermute_rope_rows(back, heads))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c.save_pretrained(hf_dir)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("arch, tie, overrides, types", [
    # fused attn_qkv / ffn_up in kernel types: their blocks are the merged weights' whole
    ("phi3", False, {}, {"attn_qkv": "Q8_0", "ffn_up": "Q4_0", "output": "Q8_0"}),
    # head_dim 32 over hidden 64 (key_length), no rope base in the file (10000)
    ("gemma", True, {"attention_bias": True}, {"attn_q": "Q8_0", "ffn_gate": "F16"}),
    ("granite", False, {"rope_theta": 5e5}, {"attn_q": "Q8_0", "attn_k": "Q8_0"}),
    ("olmo2", True, {"rope_theta": 5e5}, {"attn_v": "Q8_0", "ffn_down": "Q4_0"}),
    # soft caps 2 / 3 from the file; query_pre_attn_scalar: llama.cpp's head_dim (not a 27B)
    ("gemma2", True, {"query_pre_attn_scalar": 16}, {"attn_q": "Q8_0", "ffn_down": "F16"}),
    # llama.cpp's fixed layout: every 6th layer global, sliding ones roped with base 10000; the
    # global base 10000 and linear x4 from the file; window 8, so 30 tokens outgrow it
    ("gemma3", True, {"num_hidden_layers": 6, "sliding_window_pattern": 6,
                      "query_pre_attn_scalar": 16, "rope_local_base_freq": 10000.0,
                      "rope_theta": 1e6}, {"attn_k": "Q8_0", "ffn_up": "Q4_0"}),
], ids=["phi3", "gemma", "granite", "olmo2", "gemma2", "gemma3"])
def test_family_gguf_matches_hf(arch, tie, overrides, types, tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", arch, tie=tie, **overrides)
    path = write_family_gguf(tmp_path / "m.gguf", hf_dir, arch, types)
    assert logits_diff(path, hf_dir, hf_attn="eager") < TOL
    tok = gguf_metadata.load_tokenizer(path)  # transformers converts no config of Gemma / ...
    assert tok.convert_tokens_to_ids("w7") == 7 and tok.eos_token_id == 2


def test_phi3_longrope_gguf_matches_hf(tmp_path):
    """A 128k-style file: longrope's factors as rope_factors_long / _short tensors, the original
    context length and attention factor as metadata. An engine within the original length (the
    short factors; its start saves the weight snapshot), then one past it: the snapshot kept
    the first one's rotary cache, and the second ran the short factors."""
    hf_dir = make_tiny_checkpoint(
        tmp_path / "hf", "phi3", tie=False, original_max_position_embeddings=32,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)],
                      "long_factor": [1.5 + i for i in range(8)]})
    path = write_family_gguf(tmp_path / "m.gguf", hf_dir, "phi3")
    config = gguf_metadata.load_config(path)
    assert config.rope_parameters["rope_type"] == "longrope" and config.sliding_window is None
    assert logits_diff(path, hf_dir, seq_len=30, max_model_len=32) < TOL
    assert logits_diff(path, hf_dir, seq_len=45) < TOL


def test_a_phi3_file_lacking_its_fused_tensor_names_it(tmp_path):
    from kiln.errors import ConfigError
    from kiln.model.loader import get_model
    from model._attn_helper import kiln_config_for

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "phi3", tie=False)
    path = write_family_gguf(tmp_path / "m.gguf", hf_dir, "phi3", skip=("blk.1.attn_qkv.weight",))
    with pytest.raises(ConfigError, match=r"lacks the tensor\(s\) blk\.1\.attn_qkv\.weight that"):
        get_model(kiln_config_for(path))
