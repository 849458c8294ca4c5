"""Kiln's IR: layer ops with one meaning (a plain-torch reference) and implementations registered
by providers (`torch`, `native`, `cuda`), one chosen per op at start-up (selection.py).

Model code calls these ops only: `ir.rms_norm(x, weight, eps)`.
"""
from kiln.ir import (
                               fused,  # noqa: F401  (the fusion passes' ops)
                               int8_panels,
                               moe_native,
                               native,
                               quant,
                               quant_fp8,
                               quant_native,
)
from kiln.ir.attention import unified_attention
from kiln.ir.collectives import all_reduce
from kiln.ir.f32_scale_norm import fused_add_rms_norm_f32_scale, rms_norm_f32_scale
from kiln.ir.gguf import gguf_embedding, gguf_linear
from kiln.ir.int4 import int4_weight_linear
from kiln.ir.layer_norm import fused_add_layer_norm, layer_norm
from kiln.ir.layer_ops import (
                               fused_add_rms_norm,
                               gelu,
                               gelu_tanh_and_mul,
                               linear,
                               rms_norm,
                               rotary_embedding,
                               silu_and_mul,
)
from kiln.ir.lora import lora_add
from kiln.ir.moe import fused_moe
from kiln.ir.moe_int8 import fused_moe_int8
from kiln.ir.moe_int8_panels import fused_moe_int8_panels
from kiln.ir.op import PROVIDERS, REGISTRY, Implementation, IrOp
from kiln.ir.selection import (
                               Selection,
                               applied,
                               apply,
                               check_priority,
                               parse_cli,
                               resolve,
)

native.register()
quant_native.register()
quant_fp8.register()
moe_native.register()

__all__ = ["PROVIDERS", "REGISTRY", "Implementation", "IrOp", "Selection", "all_reduce",
           "applied", "apply", "check_priority", "fused_add_layer_norm", "fused_add_rms_norm",
           "fused_add_rms_norm_f32_scale", "fused_moe", "fused_moe_int8", "fused_moe_int8_panels",
           "gelu", "gelu_tanh_and_mul", "gguf_embedding", "gguf_linear", "int4_weight_linear",
           "layer_norm", "linear",
           "lora_add", "parse_cli", "resolve", "rms_norm",
           "rms_norm_f32_scale", "rotary_embedding", "silu_and_mul", "unified_attention", "quant",
           "int8_panels"]
