"""What Qwen2-MoE and Qwen3-MoE share: which layers hold a sparse MoE block (the others a dense MLP
of intermediate_size: `mlp_only_layers`, `decoder_sparse_step`) and the block's sizes.

Qwen2-MoE adds a shared expert (shared_expert_intermediate_size) gated by sigmoid per token.
"""
from kiln.model.layers.fused_moe import SparseMoeBlock, num_experts_of
from kiln.model.llama import LlamaMLP


def is_sparse_layer(hf_config, index: int) -> bool:
    """HF's rule: a layer not in mlp_only_layers, every decoder_sparse_step-th, has experts."""
    step = getattr(hf_config, "decoder_sparse_step", 1) or 1
    return (index not in (getattr(hf_config, "mlp_only_layers", None) or [])
            and num_experts_of(hf_config) > 0 and (index + 1) % step == 0)


def qwen_moe_mlp(hf_config, prefix: str):
    """The feed-forward of layer `prefix` (model.layers.N.mlp)."""
    index = int(prefix.split(".")[-2])
    if not is_sparse_layer(hf_config, index):
        return LlamaMLP(hf_config, prefix)
    return SparseMoeBlock(hf_config, prefix, num_experts=num_experts_of(hf_config),
                          intermediate_size=hf_config.moe_intermediate_size,
                          renormalize=bool(getattr(hf_config, "norm_topk_prob", False)),
                          shared_size=getattr(hf_config, "shared_expert_intermediate_size", 0)
                          or 0)
