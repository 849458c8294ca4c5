"""GGUF files of the other architectures Kiln runs, written as llama.cpp's converter writes them
(no q/k row permutation outside llama/mistral; qwen2's q/k/v biases, qwen3's per-head q/k norms,
as attn_q.bias / attn_q_norm.weight), in mixed storage types per tensor: Kiln's logits against
HF's on the values gguf dequantizes them to."""
import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from model.test_gguf_vs_hf import TOL, logits_diff

from checkpoints import make_tiny_checkpoint
from gguf_blocks import K_SCALE_OFFSETS, quantized_blocks

_PARTS = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
          "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
_GLOBAL = {"model.embed_tokens.weight": "token_embd.weight",
           "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))


def write_arch_gguf(path, hf_dir, arch: str, types: dict, theta: float):
    """hf_dir's checkpoint as an `arch` GGUF (types: llama.cpp name part -> F16 / BF16 / Q8_0 /
    Q4_0 / Q4_1 / Q5_0 / Q5_1 / a K-quant, F32 elsewhere; a tied head not stored); hf_dir's
    weights are then replaced by what gguf dequantizes the file's to, HF's reference."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    w = gguf.GGUFWriter(str(path), arch)
    for add, value in ((w.add_block_count, c.num_hidden_layers),
                       (w.add_context_length, c.max_position_embeddings),
                       (w.add_embedding_length, c.hidden_size),
                       (w.add_feed_forward_length, c.intermediate_size),
                       (w.add_head_count, c.num_attention_heads),
                       (w.add_head_count_kv, c.num_key_value_heads),
                       (w.add_key_length, c.head_dim), (w.add_value_length, c.head_dim),
                       (w.add_rope_dimension_count, c.head_dim),
                       (w.add_layer_norm_rms_eps, c.rms_norm_eps), (w.add_rope_freq_base, theta),
                       (w.add_vocab_size, c.vocab_size)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"w{i}" for i in range(c.vocab_size)])
    state = load_file(str(hf_dir / "model.safetensors"))
    for i, (name, t) in enumerate(sorted(state.items())):
        if c.tie_word_embeddings and name == "lm_head.weight":
            continue
        parts = name.split(".")
        gname = _GLOBAL.get(name) or \
            f"blk.{parts[2]}.{_PARTS['.'.join(parts[3:-1])]}.{parts[-1]}"
        kind = types.get(gname.split(".")[-2], "F32") if t.dim() == 2 else "F32"
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        a = t.float().numpy()
        data = a.astype(np.float32 if kind == "F32" else np.float16) if kind in ("F32", "F16") \
            else gguf.quants.quantize(a, qtype) if kind == "BF16" \
            else quantized_blocks(a, kind, seed=i)
        if kind in K_SCALE_OFFSETS:  # random blocks: super-scales cut to a trained model's size
            blocks = data.reshape(*data.shape[:-1], -1, gguf.GGML_QUANT_SIZES[qtype][1])
            for offset in K_SCALE_OFFSETS[kind]:
                scale = blocks[..., offset:offset + 2].copy().view(np.float16) * 0.05
                blocks[..., offset:offset + 2] = scale.view(np.uint8)
        w.add_tensor(gname, data, raw_dtype=qtype)
        state[name] = t.new_tensor(gguf.quants.dequantize(data, qtype).reshape(a.shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    c.rope_parameters = {**c.rope_parameters, "rope_theta": theta}
    c.save_pretrained(hf_dir)
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_qwen2_with_biases_tied_and_another_rope_base(tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen2", tie=True, head_dim=16)
    path = write_arch_gguf(tmp_path / "m.gguf", hf_dir, "qwen2", theta=1e6, types={
        "token_embd": "Q8_0", "attn_q": "Q8_0", "attn_k": "Q5_0", "attn_v": "Q5_1",
        "attn_output": "BF16", "ffn_gate": "Q4_0", "ffn_up": "Q4_1", "ffn_down": "F16"})
    assert logits_diff(path, hf_dir) < TOL


def test_qwen3_with_qk_norms_wider_heads_and_k_quants(tmp_path):
    """Heads of 32 over a hidden size of 64 (4 of them, 1 KV head); K-quant blocks are random
    (gguf_blocks), the head Q6_K and the embedding Q8_0, untied."""
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen3", tie=False, hidden_size=256,
                                  intermediate_size=512, num_key_value_heads=1, head_dim=32)
    path = write_arch_gguf(tmp_path / "m.gguf", hf_dir, "qwen3", theta=5e5, types={
        "token_embd": "Q8_0", "output": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q5_K",
        "attn_v": "Q6_K", "attn_output": "F16", "ffn_gate": "Q4_K", "ffn_up": "Q4_K",
        "ffn_down": "Q6_K"})
    # logits up to ~36, of which HF's float32 ones are 5e-5 off float64's: a few times that
    assert logits_diff(path, hf_dir) < 1e-3
