"""llama.cpp tensor names against HF ones, per GGUF architecture, and what llama.cpp's converter
did to a tensor's values that loading undoes (q/k rows permuted, Gemma-1/2/3's norms stored as
1 + w, q/k norms included).

Phi-3 files keep q/k/v and gate/up fused (attn_qkv, and ffn_up holding gate then up), named
here as the HF Phi-3 checkpoint's qkv_proj / gate_up_proj, which its model splits on load (GLM-4
files their gate_up_proj alike).
Mixtures of experts keep each layer's experts stacked (ffn_*_exps, [E, ...]): named here as
Kiln's stacked parameters, and loaded as each expert's HF tensor (`expert_tensors`).
"""
import re

import numpy as np

# llama.cpp permutes q/k rows only for the architectures it ropes in the "normal" (GPT-J) style
# (LlamaModel's converter and those built on it: Granite's, SmolLM3's). GLM-4 and ERNIE-4.5 are
# roped that way too, but their HF checkpoints already pair dimensions so: written unpermuted.
PERMUTED_ARCHITECTURES = ("llama", "mistral", "granite", "smollm3")
# Architectures whose norms llama.cpp stores as 1 + w (Gemma's RMSNorm scales by 1 + w).
_SHIFTED_NORM_ARCHITECTURES = ("gemma", "gemma2", "gemma3")

GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixtures of experts: the router, Qwen2-MoE's shared expert and its sigmoid gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# llama.cpp's stacked expert tensors -> (Kiln's stacked parameter, each expert's HF tensor)
EXPERT_STACKS = {"ffn_gate_exps": ("w13_weight", "gate_proj"),
                 "ffn_up_exps": ("w13_weight", "up_proj"),
                 "ffn_down_exps": ("w2_weight", "down_proj")}
# Each architecture's names that differ from (or add to) the common ones.
_ARCH_BLOCK_NAMES = {
    "phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # OLMo-2 / 3 and EXAONE-4 normalise block outputs: no attn_norm / ffn_norm
    **{arch: {"post_attention_norm": "post_attention_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"} for arch in ("olmo2", "exaone4")},
    # GLM-4's sandwich norms under its own HF names; ffn_up holds gate then up, as Phi-3's
    "glm4": {"post_attention_norm": "post_self_attn_layernorm",
             "post_ffw_norm": "post_mlp_layernorm", "ffn_up": "mlp.gate_up_proj"},
    # Seed-OSS's pre-MLP norm is post_attention_norm in llama.cpp (its ffn_norm elsewhere)
    "seed_oss": {"post_attention_norm": "post_attention_layernorm"},
    # Gemma-2 / 3 normalise each block's input and output: ffn_norm is the pre-feed-forward one
    **{arch: {"post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"} for arch in ("gemma2", "gemma3")},
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def block_names(arch: str | None) -> dict[str, str]:
    """llama.cpp block tensor part -> HF module path within a layer, for `arch` (one name per
    HF module: OLMo-2's post_attention_layernorm is post_attention_norm, not ffn_norm)."""
    own = _ARCH_BLOCK_NAMES.get(arch or "", {})
    taken = set(own.values())
    return {**{k: v for k, v in _BLOCK_NAMES.items() if v not in taken}, **own}


def gguf_to_hf_name(name: str, arch: str | None = None) -> str | None:
    """HF parameter name for a llama.cpp tensor name; None for tensors Kiln does not use."""
    m = _BLOCK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        if part in EXPERT_STACKS and kind == "weight":
            return f"model.layers.{layer}.mlp.experts.{EXPERT_STACKS[part][0]}"
        hf = block_names(arch).get(part)
        return f"model.layers.{layer}.{hf}.{kind}" if hf else None
    m = _GLOBAL_RE.match(name)
    if m and m.group(1) in GLOBAL_NAMES:
        return f"{GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    return None


def hf_to_gguf_name(hf_name: str, arch: str | None = None) -> str | None:
    """The llama.cpp tensor name that fills an HF parameter (gguf_to_hf_name's inverse)."""
    m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf_name)
    if m:
        part = next((k for k, v in block_names(arch).items() if v == m.group(2)), None)
        return None if part is None else f"blk.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = hf_name.rpartition(".")
    part = next((k for k, v in GLOBAL_NAMES.items() if v == base), None)
    return None if part is None else f"{part}.{kind}"


def gguf_sources(hf_name: str, arch: str | None = None) -> list[str | None]:
    """The llama.cpp tensors that fill an HF tensor or Kiln parameter: hf_to_gguf_name's, or
    for a stacked expert parameter the stacks it is made of (w13_weight: gate's, then up's)."""
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(w13_weight|w2_weight)$", hf_name)
    if m is None:
        return [hf_to_gguf_name(hf_name, arch)]
    return [f"blk.{m.group(1)}.{part}.weight" for part, (param, _) in EXPERT_STACKS.items()
            if param == m.group(2)]


def expert_tensors(name: str, values: np.ndarray) -> list[tuple[str, np.ndarray]] | None:
    """Each expert's (HF tensor name, [out, in] values) of a stacked expert tensor ([E, out,
    in]); None for any other tensor."""
    m = _BLOCK_RE.match(name)
    if m is None or m.group(2) not in EXPERT_STACKS or m.group(3) != "weight":
        return None
    part = EXPERT_STACKS[m.group(2)][1]
    return [(f"model.layers.{m.group(1)}.mlp.experts.{e}.{part}.weight", values[e])
            for e in range(values.shape[0])]


def to_hf_shape(name: str, values: np.ndarray) -> np.ndarray:
    """A tensor in its HF shape: Qwen2-MoE's shared-expert gate is one row, [1, H], that
    llama.cpp's loader also takes as [H]."""
    if ".ffn_gate_inp_shexp." in name and values.ndim == 1:
        return values.reshape(1, -1)
    return values


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's q/k permutation: per head, rows [pairs interleaved] -> [halves]."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permuted_heads(arch: str | None, name: str, num_heads: int, num_kv_heads: int) -> int | None:
    """The head count a tensor's rows were permuted over by llama.cpp, or None if they were not."""
    if arch not in PERMUTED_ARCHITECTURES:
        return None
    return num_heads if ".attn_q." in name else num_kv_heads if ".attn_k." in name else None


def norm_shift(arch: str | None, hf_name: str) -> float:
    """What llama.cpp's converter added to a tensor (Gemma's norms: 1), to subtract on load."""
    return 1.0 if arch in _SHIFTED_NORM_ARCHITECTURES and hf_name.endswith("norm.weight") else 0.0
