"""Phi-3: the Llama layout with the q/k/v and gate/up projections fused in the checkpoint.

The fused tensors (`qkv_proj`, `gate_up_proj`, and any `weight_scale` / bias beside them) are
split into their HF-style parts on load, so the merged layers' per-shard loaders place (and
shard under tensor parallelism) each part as they do for Llama. Phi-3's rope is neox-style over
the whole head (`longrope`, the 128k checkpoints': kiln/model/layers/longrope.py); a partial
rotary factor other than 1 is refused here.
"""
from collections.abc import Iterable, Iterator

import torch

from kiln.attention.kv_cache_scales import kv_scale_target
from kiln.compilation.decorator import support_torch_compile
from kiln.config.rope import partial_rotary_factor_of
from kiln.errors import ConfigError
from kiln.model.layers.quantization import int4_formats
from kiln.model.llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaStyleForCausalLM,
    LlamaStyleModel,
    head_dim_of,
)


def _check_phi3_config(hf_config) -> None:
    factor = partial_rotary_factor_of(hf_config)
    if factor != 1.0:
        raise ConfigError(f"partial_rotary_factor {factor} is not supported for Phi3ForCausalLM "
                          "(Kiln rotates the whole head); only 1.0")


class Phi3Attention(LlamaAttention):
    def __init__(self, hf_config, prefix: str):
        _check_phi3_config(hf_config)
        super().__init__(hf_config, prefix)

    def qkv_bias(self, hf_config) -> bool:
        return False  # HF's Phi-3 has no attention biases

    def o_proj_bias(self, hf_config) -> bool:
        return False


class Phi3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Phi3Attention


@support_torch_compile
class Phi3Model(LlamaStyleModel):
    layer_cls = Phi3DecoderLayer


def split_fused(name: str, tensor: torch.Tensor, hf_config) -> list[tuple[str, torch.Tensor]]:
    """A fused Phi-3 tensor as its HF-style parts: qkv_proj.* rows -> q_proj / k_proj /
    v_proj, gate_up_proj.* rows -> gate_proj / up_proj (gate first, as HF's chunk). Any other
    tensor is returned as it is."""
    if kv_scale_target(name) is not None:  # qkv_proj.k_scale: an fp8 KV cache's, whole
        return [(name, tensor)]
    if ".qkv_proj." in name:
        hd = head_dim_of(hf_config)
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        sizes = [heads * hd, kv_heads * hd, kv_heads * hd]
        parts = (".q_proj.", ".k_proj.", ".v_proj."), ".qkv_proj."
    elif ".gate_up_proj." in name:
        inter = hf_config.intermediate_size
        sizes = [inter, inter]
        parts = (".gate_proj.", ".up_proj."), ".gate_up_proj."
    else:
        return [(name, tensor)]
    names = [name.replace(parts[1], part) for part in parts[0]]
    # a 4-bit checkpoint's tensors keep the rows elsewhere (GPTQ / AWQ: columns, packed)
    pieces = int4_formats.split_rows(hf_config, name.rpartition(".")[2], tensor, sum(sizes),
                                     lambda t: t.split(sizes, dim=0))
    if pieces is not None:
        return list(zip(names, pieces))
    if tensor.dim() == 0 or tensor.shape[0] != sum(sizes):
        raise ConfigError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected "
                          f"{sum(sizes)} rows ({' + '.join(map(str, sizes))}); the checkpoint "
                          "does not match its config (sizes, head counts, head_dim)")
    return list(zip(names, tensor.split(sizes, dim=0)))


class Phi3ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Phi3Model
    # the checkpoint's own module names: what a compressed-tensors ignore / targets list names
    fused_checkpoint_modules = ("qkv_proj", "gate_up_proj")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def unfused() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                yield from split_fused(name, tensor, self.config)
        return super().load_weights(unfused())
