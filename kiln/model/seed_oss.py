"""Seed-OSS (ByteDance): the Llama layout with the o_proj's bias switched by its own
attention_out_bias (q / k / v: attention_bias, on in the released 36B; the MLP: mlp_bias)."""
from kiln.compilation.decorator import support_torch_compile
from kiln.model.llama import LlamaAttention, LlamaDecoderLayer, LlamaStyleForCausalLM, LlamaStyleModel


class SeedOssAttention(LlamaAttention):
    def o_proj_bias(self, hf_config) -> bool:
        return bool(getattr(hf_config, "attention_out_bias", False))


class SeedOssDecoderLayer(LlamaDecoderLayer):
    attention_cls = SeedOssAttention


@support_torch_compile
class SeedOssModel(LlamaStyleModel):
    layer_cls = SeedOssDecoderLayer


class SeedOssForCausalLM(LlamaStyleForCausalLM):
    model_cls = SeedOssModel
