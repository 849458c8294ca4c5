"""Phi-1 / Phi-1.5 / Phi-2 (PhiForCausalLM): one LayerNorm feeding attention and MLP in
parallel (parallel_block.py), biased q / k / v and output (`dense`) projections, rope over the
first `partial_rotary_factor` of each head, a non-gated GELU MLP (fc1 / fc2), an optional
per-head LayerNorm on q and k (`qk_layernorm`), a final LayerNorm and an LM head with a bias.

The checkpoint's names (self_attn.dense, mlp.fc1 / fc2, model.final_layernorm) are mapped to
Kiln's modules on load; q / k / v load into the merged QKV layer as Llama's do.
"""
import re

import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.layernorm import LayerNorm
from kiln.model.llama import LlamaStyleForCausalLM, LlamaStyleModel
from kiln.model.parallel_block import ParallelBlockDecoderLayer
from kiln.model.partial_rotary import PartialRotaryAttention
from kiln.model.starcoder2 import GeluMLP

# checkpoint name part -> Kiln's
_RENAMES = ((re.compile(r"^model\.final_layernorm\."), "model.norm."),
            (re.compile(r"\.self_attn\.dense\."), ".self_attn.o_proj."),
            (re.compile(r"\.mlp\.fc1\."), ".mlp.c_fc."),
            (re.compile(r"\.mlp\.fc2\."), ".mlp.c_proj."))
# Kiln module name part -> the checkpoint's (what a quantization_config's ignore list names)
_MODULE_NAMES = (("model.norm", "model.final_layernorm"), (".self_attn.o_proj", ".self_attn.dense"),
                 (".mlp.c_fc", ".mlp.fc1"), (".mlp.c_proj", ".mlp.fc2"))


class PhiMLP(GeluMLP):
    bias_field = None  # HF's fc1 / fc2 always carry one


class PhiAttention(PartialRotaryAttention):
    def __init__(self, hf_config, prefix: str):
        super().__init__(hf_config, prefix)
        self.qk_layernorm = bool(getattr(hf_config, "qk_layernorm", False))
        if self.qk_layernorm:  # one weight and bias over each head's dims, every head alike
            eps = hf_config.layer_norm_eps
            self.q_layernorm = LayerNorm(self.head_dim, eps)
            self.k_layernorm = LayerNorm(self.head_dim, eps)

    def qkv_bias(self, hf_config) -> bool:
        return True

    def o_proj_bias(self, hf_config) -> bool:
        return True

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.split_qkv(x)
        if self.qk_layernorm:
            num_tokens = x.shape[0]
            q = self.q_layernorm(q.reshape(num_tokens, self.num_heads, self.head_dim)
                                 ).view(num_tokens, self.q_size)
            k = self.k_layernorm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
                                 ).view(num_tokens, self.kv_size)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class PhiDecoderLayer(ParallelBlockDecoderLayer):
    attention_cls = PhiAttention
    mlp_cls = PhiMLP


@support_torch_compile
class PhiModel(LlamaStyleModel):
    layer_cls = PhiDecoderLayer


class PhiForCausalLM(LlamaStyleForCausalLM):
    model_cls = PhiModel
    lm_head_bias = True

    checkpoint_renames = _RENAMES
    checkpoint_module_names = _MODULE_NAMES
