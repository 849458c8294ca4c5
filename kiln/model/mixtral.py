"""Mixtral: the Mistral layout with a sparse MoE block in place of the MLP (softmax routing over
num_local_experts, top num_experts_per_tok, always renormalized; no shared expert).

HF names the block `block_sparse_moe` and its experts' tensors w1 (gate), w3 (up), w2 (down).
"""
from collections.abc import Iterable

import torch

from kiln.compilation.decorator import support_torch_compile
from kiln.model.layers.fused_moe import SparseMoeBlock, num_experts_of
from kiln.model.llama import LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


def mixtral_moe(hf_config, prefix: str) -> SparseMoeBlock:
    return SparseMoeBlock(hf_config, prefix, num_experts=num_experts_of(hf_config),
                          intermediate_size=hf_config.intermediate_size, renormalize=True)


class MixtralDecoderLayer(LlamaDecoderLayer):
    mlp_cls = staticmethod(mixtral_moe)


@support_torch_compile
class MixtralModel(LlamaStyleModel):
    layer_cls = MixtralDecoderLayer


class MixtralForCausalLM(LlamaStyleForCausalLM):
    model_cls = MixtralModel
    expert_checkpoint_parts = ("w1", "w3", "w2")  # gate, up, down

    @staticmethod
    def checkpoint_module_name(name: str) -> str:
        """Kiln's module name as the checkpoint's (a quantization_config's ignore list names
        the router `block_sparse_moe.gate`)."""
        return name.replace(".mlp.", ".block_sparse_moe.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        # Kiln's layers hold the block as `mlp`, as every family's
        return super().load_weights((name.replace(".block_sparse_moe.", ".mlp."), tensor)
                                    for name, tensor in weights)
