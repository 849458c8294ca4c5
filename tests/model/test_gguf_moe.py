"""GGUF files of the mixtures of experts, written as llama.cpp's converter writes them (each layer's
experts stacked as ffn_gate_exps / ffn_up_exps / ffn_down_exps [E, ...], the router ffn_gate_inp,
Qwen2-MoE's shared expert *_shexp; Mixtral as architecture llama with expert_count, its q/k rows
permuted): Kiln's logits from the file against HF's from the checkpoint holding what gguf
dequantizes the file's tensors to (F32, Q8_0 and Q4_K stacks), and greedy tokens through LLM."""
import shutil

import gguf
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from kiln.config import gguf_metadata
from kiln.model.loader.gguf_names import unpermute_rope_rows
from model.test_gguf import llama_cpp_permute
from model.test_gguf_families import _GLOBAL, _PARTS, _metadata
from model.test_gguf_vs_hf import TOL, logits_diff

from checkpoints import make_tiny_checkpoint
from gguf_blocks import quantized_blocks

# HF checkpoint arch -> GGUF architecture
_GGUF_ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_MOE_PARTS = {"block_sparse_moe.gate": "ffn_gate_inp", "mlp.gate": "ffn_gate_inp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
              "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
_STACKS = {"w1": "ffn_gate_exps", "gate_proj": "ffn_gate_exps", "w3": "ffn_up_exps",
           "up_proj": "ffn_up_exps", "w2": "ffn_down_exps", "down_proj": "ffn_down_exps"}


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    """A cache root of the test's own, seeded with the machine's kernel builds: an engine's
    start compiles Kiln's CPU kernels into an empty one (minutes on 2 busy cores)."""
    from kiln import envs

    if (envs.cache_root() / "kernels").is_dir():
        shutil.copytree(envs.cache_root() / "kernels", tmp_path / "cache" / "kernels",
                        ignore=shutil.ignore_patterns(".lock", "*.tmp"))
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))


def _stored(a: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
    """(the file's data of `a` in type `kind`, the float32 values gguf dequantizes it to); a
    stack [E, out, in] is quantized as its E * out rows."""
    if kind == "F32":
        return a, a
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    data = quantized_blocks(a.reshape(-1, a.shape[-1]), kind)
    back = gguf.quants.dequantize(data, qtype).astype(np.float32).reshape(a.shape)
    return data.reshape(*a.shape[:-1], -1), back


def write_moe_gguf(path, hf_dir, arch: str, types: dict | None = None, skip: tuple = (),
                   metadata: dict | None = None):
    """hf_dir's `arch` checkpoint as llama.cpp's converter writes it (types: llama.cpp name part
    -> Q8_0 / Q4_K, F32 elsewhere; `skip`: GGUF names left out; `metadata`: key -> (value,
    GGUFValueType) written instead of the converter's, or None to leave it out); hf_dir's
    weights are then replaced by what gguf dequantizes the file's to, HF's reference."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(hf_dir)
    garch = _GGUF_ARCH[arch]
    w = gguf.GGUFWriter(str(path), garch)
    _metadata(w, garch, c)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_expert_count(getattr(c, "num_local_experts", None) or c.num_experts)
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    for key, entry in (metadata or {}).items():
        w.kv_data[0].pop(key, None)
        if entry is not None:
            w.add_key_value(key, *entry)
    parts = {**_PARTS, **_MOE_PARTS}
    state = load_file(str(hf_dir / "model.safetensors"))
    stacks: dict[str, dict[int, tuple[str, np.ndarray]]] = {}
    tensors = {}
    for name, t in sorted(state.items()):
        p = name.split(".")
        if ".experts." in name:  # model.layers.L.<block>.experts.E.<part>.weight
            gname = f"blk.{p[2]}.{_STACKS[p[-2]]}.weight"
            stacks.setdefault(gname, {})[int(p[-3])] = (name, t.float().numpy())
            continue
        gname = _GLOBAL.get(name) or f"blk.{p[2]}.{parts['.'.join(p[3:-1])]}.{p[-1]}"
        a, heads = t.float().numpy(), None
        if arch == "mixtral" and gname.split(".")[-2] in ("attn_q", "attn_k"):
            heads = c.num_attention_heads if ".attn_q." in gname else c.num_key_value_heads
            a = llama_cpp_permute(a, heads)
        data, back = _stored(a, (types or {}).get(gname.split(".")[-2], "F32"))
        tensors[gname] = data
        state[name] = t.new_tensor(back if heads is None else unpermute_rope_rows(back, heads))
    for gname, experts in stacks.items():
        data, back = _stored(np.stack([experts[e][1] for e in sorted(experts)]),
                             (types or {}).get(gname.split(".")[-2], "F32"))
        tensors[gname] = data
        for e, (name, _) in experts.items():
            state[name] = state[name].new_tensor(back[e])
    for gname, data in sorted(tensors.items()):
        if gname not in skip:
            kind = (types or {}).get(gname.split(".")[-2], "F32")
            w.add_tensor(gname, data, raw_dtype=getattr(gguf.GGMLQuantizationType, kind))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    save_file(state, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("arch, overrides, types", [
    ("mixtral", {}, {}),
    # layer 1 dense (no router: mlp_only_layers)
    # the shared expert's gate and up in Q8_0: its merged gate_up keeps the blocks
    ("qwen2_moe", {}, {"ffn_gate_exps": "Q8_0", "ffn_down_exps": "Q8_0", "ffn_up_shexp": "Q8_0",
                       "ffn_gate_shexp": "Q8_0"}),
    ("qwen3_moe", {}, {"ffn_up_exps": "Q8_0", "attn_q": "Q8_0", "ffn_gate_inp": "Q8_0"}),
    # K-quant stacks: 256-value blocks, so rows of 256
    ("mixtral", {"hidden_size": 256, "intermediate_size": 256},
     {"ffn_gate_exps": "Q4_K", "ffn_up_exps": "Q4_K", "ffn_down_exps": "Q4_K"}),
], ids=["mixtral-f32", "qwen2_moe-q8_0", "qwen3_moe-q8_0", "mixtral-q4_k"])
def test_moe_gguf_matches_hf(arch, overrides, types, tmp_path):
    hf_dir = make_tiny_checkpoint(tmp_path / "hf", arch, tie=False, **overrides)
    path = write_moe_gguf(tmp_path / "m.gguf", hf_dir, arch, types)
    assert logits_diff(path, hf_dir) < TOL


def test_the_config_is_sized_and_routed_as_llama_cpp_reads_the_file(tmp_path):
    """transformers' own conversion left the experts' and shared expert's sizes at its defaults
    (1408, 5632) and Qwen3-MoE's routing unnormalized; a llama file with experts was a Llama."""
    hf_dir = make_tiny_checkpoint(tmp_path / "q2", "qwen2_moe", tie=False)
    config = gguf_metadata.load_config(write_moe_gguf(tmp_path / "q2.gguf", hf_dir, "qwen2_moe"))
    assert (config.architectures, config.moe_intermediate_size,
            config.shared_expert_intermediate_size, config.norm_topk_prob,
            config.mlp_only_layers) == (["Qwen2MoeForCausalLM"], 32, 48, False, [1])
    hf_dir = make_tiny_checkpoint(tmp_path / "q3", "qwen3_moe", tie=False)
    config = gguf_metadata.load_config(write_moe_gguf(tmp_path / "q3.gguf", hf_dir, "qwen3_moe"))
    assert (config.architectures, config.moe_intermediate_size, config.norm_topk_prob,
            config.head_dim) == (["Qwen3MoeForCausalLM"], 32, True, 16)
    hf_dir = make_tiny_checkpoint(tmp_path / "mx", "mixtral", tie=False)
    config = gguf_metadata.load_config(write_moe_gguf(tmp_path / "mx.gguf", hf_dir, "mixtral"))
    assert (config.architectures, config.num_local_experts, config.num_experts_per_tok,
            config.intermediate_size) == (["MixtralForCausalLM"], 4, 2, 128)


def test_greedy_tokens_match_hf_through_llm(tmp_path):
    from kiln import LLM, SamplingParams

    from checkpoints import hf_greedy

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "qwen3_moe", tie=False)
    path = write_moe_gguf(tmp_path / "m.gguf", hf_dir, "qwen3_moe", {"ffn_down_exps": "Q8_0"})
    prompts = [[5, 6, 7, 8, 9], [300, 301, 302, 40, 41, 42, 43], [77]]
    llm = LLM(model=str(path), tokenizer=str(hf_dir), dtype="float32", enforce_eager=True,
              max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(hf_dir, prompts, 6)


def test_a_missing_expert_stack_is_named(tmp_path):
    from kiln.errors import ConfigError
    from kiln.model.loader import get_model
    from model._attn_helper import kiln_config_for

    hf_dir = make_tiny_checkpoint(tmp_path / "hf", "mixtral", tie=False)
    path = write_moe_gguf(tmp_path / "m.gguf", hf_dir, "mixtral",
                          skip=("blk.1.ffn_up_exps.weight",))
    with pytest.raises(ConfigError, match=r"lacks the tensor\(s\) blk\.1\.ffn_up_exps\.weight "):
        get_model(kiln_config_for(path))
