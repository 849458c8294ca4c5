"""StarCoder2: the Mistral layout with LayerNorms (weight and bias), biases on every linear
(`use_bias`) and a non-gated GELU MLP (c_fc, c_proj), the head tied by default.

Its `sliding_window` limits every layer (kiln/config/sliding_window.py). The GELU MLP is
GPT-NeoX's too (gpt_neox.py).
"""
import torch
from torch import nn

from kiln.compilation.decorator import support_torch_compile
from kiln.errors import ConfigError
from kiln.model.layers.activation import GELU_APPROXIMATIONS, Gelu
from kiln.model.layers.layernorm import LayerNorm
from kiln.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class GeluMLP(nn.Module):
    """c_proj(gelu(c_fc(x))): column-parallel up (its bias sharded with the rows), row-parallel
    down (its bias added once, on rank 0: RowParallelLinear)."""
    bias_field = "use_bias"  # the config field switching both biases (GPT-NeoX: always on)

    def __init__(self, hf_config, prefix: str):
        super().__init__()
        act = getattr(hf_config, "hidden_act", "gelu")
        if act not in GELU_APPROXIMATIONS:
            raise ConfigError(f"{prefix}: hidden_act {act!r} is not supported; only "
                              f"{', '.join(map(repr, GELU_APPROXIMATIONS))}")
        bias = bool(getattr(hf_config, self.bias_field, True)) if self.bias_field else True
        hidden, inter = hf_config.hidden_size, hf_config.intermediate_size
        self.c_fc = ColumnParallelLinear(hidden, inter, bias)
        self.c_proj = RowParallelLinear(inter, hidden, bias)
        self.act = Gelu(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))  # [T, hidden] -> [T, inter] -> [T, hidden]


class Starcoder2Attention(LlamaAttention):
    def qkv_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "use_bias", True))

    def o_proj_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "use_bias", True))


class Starcoder2DecoderLayer(LlamaDecoderLayer):
    attention_cls = Starcoder2Attention
    mlp_cls = GeluMLP
    norm_cls = LayerNorm
    eps_field = "norm_epsilon"


@support_torch_compile
class Starcoder2Model(LlamaStyleModel):
    layer_cls = Starcoder2DecoderLayer


class Starcoder2ForCausalLM(LlamaStyleForCausalLM):
    model_cls = Starcoder2Model
