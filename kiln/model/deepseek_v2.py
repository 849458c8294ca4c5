"""DeepSeek-V2 and V3: Multi-head Latent Attention (kiln/model/layers/mla.py) over DeepSeek's
MoE: routed experts (the fused_moe op, with DeepSeek's own routing: deepseek_routing.py) plus
n_shared_experts' dense MLP every token runs; the first first_k_dense_replace layers (and those
off moe_layer_freq) dense. The multi-token-prediction layers a checkpoint may carry past
num_hidden_layers (num_nextn_predict_layers) are skipped on load, as vLLM does when not
speculating with them.
"""
import re

import torch
import torch.nn.functional as F
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.distributed.communication_op import tensor_model_parallel_all_reduce
from kiln.errors import ConfigError
from kiln.model.layers.deepseek_routing import deepseek_topk, routing_of
from kiln.model.layers.fused_moe import FusedMoE
from kiln.model.layers.linear import ReplicatedLinear, default_weight_loader
from kiln.model.layers.mla import MLAttention
from kiln.model.llama import (
    LlamaDecoderLayer,
    LlamaMLP,
    LlamaStyleForCausalLM,
    LlamaStyleModel,
    layer_index,
)


def is_moe_layer(hf_config, index: int) -> bool:
    """vLLM's rule: routed experts from layer first_k_dense_replace on, every
    moe_layer_freq-th (HF's classes read no moe_layer_freq: 1 in every checkpoint)."""
    freq = getattr(hf_config, "moe_layer_freq", 1) or 1
    return (bool(getattr(hf_config, "n_routed_experts", None))
            and index >= (getattr(hf_config, "first_k_dense_replace", 0) or 0)
            and index % freq == 0)


class DeepseekMoE(nn.Module):
    """`gate` (the router [E, H], with noaux_tc its e_score_correction_bias [E]), `experts`
    (n_routed_experts of moe_intermediate_size) and `shared_experts` (one dense MLP of
    n_shared_experts x moe_intermediate_size), summed; ranks' partial sums reduced once."""

    def __init__(self, hf_config, prefix: str, v3: bool):
        super().__init__()
        hidden = hf_config.hidden_size
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ConfigError(f"{prefix}: hidden_act {hf_config.hidden_act!r} is not supported "
                              "for experts; only 'silu'")
        self.routing = routing_of(hf_config, v3)
        self.gate = ReplicatedLinear(hidden, self.routing.num_experts, bias=False)
        self.gate.online_quantization = False
        # a float32 router, as HF (gate.weight kept float32) and vLLM run it: logits rounded to
        # bfloat16 moved every routing weight and flipped near-tied expert choices
        self.gate.weight.data = self.gate.weight.data.float()
        self.gate.supports_cpu_packing = False  # router_logits runs it, not the packed GEMM
        if self.routing.uses_bias:
            self.gate.e_score_correction_bias = nn.Parameter(
                torch.zeros(self.routing.num_experts, dtype=torch.float32), requires_grad=False)
            self.gate.e_score_correction_bias.weight_loader = default_weight_loader
        # renormalize is the routing's (deepseek_topk); the op takes the weights as given
        self.experts = FusedMoE(self.routing.num_experts, self.routing.top_k, hidden,
                                hf_config.moe_intermediate_size, renormalize=False)
        self.tp_size = self.experts.tp_size
        shared = (getattr(hf_config, "n_shared_experts", None) or 0) * \
            hf_config.moe_intermediate_size
        self.shared_experts = LlamaMLP(hf_config, f"{prefix}.shared_experts", shared,
                                       reduce_results=False) if shared else None

    def router_logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.gate.weight)  # [T, E] float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.router_logits(x)  # [T, E]
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = deepseek_topk(logits, self.routing, bias)  # [T, k] each
        out = self.experts(x, logits, weights, ids)  # [T, H]
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


def check_config(hf_config) -> None:
    """What Kiln does not build of a DeepSeek config, refused by field."""
    for field in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        value = getattr(hf_config, field, None)
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{field} must be an integer >= 1, got {value!r}")
    if hf_config.qk_rope_head_dim % 2:
        raise ConfigError(f"qk_rope_head_dim ({hf_config.qk_rope_head_dim}) must be even")
    if bool(getattr(hf_config, "mlp_bias", False)) and getattr(hf_config, "n_routed_experts",
                                                                 None):
        raise ConfigError("mlp_bias true is not supported for DeepSeek's experts (they have no "
                          "biases); set it false")


class DeepseekV2DecoderLayer(LlamaDecoderLayer):
    attention_cls = MLAttention
    v3 = False

    def mlp_cls(self, hf_config, prefix: str):
        if is_moe_layer(hf_config, layer_index(prefix)):
            return DeepseekMoE(hf_config, prefix, self.v3)
        return LlamaMLP(hf_config, prefix)


class DeepseekV3DecoderLayer(DeepseekV2DecoderLayer):
    v3 = True


@support_torch_compile
class DeepseekV2Model(LlamaStyleModel):
    layer_cls = DeepseekV2DecoderLayer

    def __init__(self, *, kiln_config, prefix: str = "model"):
        check_config(kiln_config.model_config.hf_config)
        super().__init__(kiln_config=kiln_config, prefix=prefix)


@support_torch_compile
class DeepseekV3Model(DeepseekV2Model):
    layer_cls = DeepseekV3DecoderLayer


def num_mtp_layers(hf_config) -> int:
    """The multi-token-prediction layers stored after the decoder's (V3's config.json
    num_nextn_predict_layers; transformers 5 names it num_mtp_layers)."""
    for field in ("num_nextn_predict_layers", "num_mtp_layers"):
        value = getattr(hf_config, field, None)
        if value:
            return int(value)
    return 0


class DeepseekV2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = DeepseekV2Model
    # q_proj (no q LoRA) is one whole projection, not the q part of a merged qkv_proj
    checkpoint_renames = ((re.compile(r"\.self_attn\.q_proj\."), ".self_attn.q_heads_proj."),)
    checkpoint_module_names = ((".self_attn.q_heads_proj", ".self_attn.q_proj"),)

    def owns(self, name: str) -> bool:
        if ".mlp.shared_experts." in name and not getattr(self.config, "n_shared_experts", None):
            return False  # n_shared_experts 0: HF saves its shared MLP empty ([0, hidden])
        if name.startswith("model.layers."):
            index = name.split(".")[2]
            first = self.config.num_hidden_layers
            if index.isdigit() and first <= int(index) < first + num_mtp_layers(self.config):
                return False  # an MTP layer: not served (no speculation from it)
        return super().owns(name)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    model_cls = DeepseekV3Model
