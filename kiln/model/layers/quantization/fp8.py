"""W8A8 fp8 linear layers, quantized on load (`--quantization fp8` / `ptpc_fp8`, vLLM's names):
e4m3 weights with a float32 scale per tensor (fp8) or per output channel (ptpc_fp8), activations
quantized per token at run time; the GEMM is the IR's fp8_scaled_mm (torch._scaled_mm on GPU).

Embeddings, the LM head and a classifier's score head stay in the model dtype, as under int8.
"""
from dataclasses import dataclass

import torch
from torch import nn

from kiln.ir import quant_fp8 as ir_fp8
from kiln.logger import init_logger
from kiln.model.layers.cpu_gemm import BUFFERS
from kiln.model.layers.linear import LinearBase

logger = init_logger(__name__)


class Fp8LinearMethod:
    """How a converted linear computes: quantize x per token, fp8 GEMM, scales, bias."""

    def apply(self, layer: LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        q, scale = ir_fp8.dynamic_fp8_quant(x)  # [T, K] e4m3, [T, 1] float32
        return ir_fp8.fp8_scaled_mm(q, scale, layer.weight, layer.weight_scale, bias, x.dtype)


def quantize_weight_fp8(w: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (e4m3 [N, K], scale float32 [N]): amax / 448 of each row (per channel)
    or of the whole tensor (one value, repeated per row so the GEMM takes either alike)."""
    if per_channel:
        q, scale = ir_fp8.dynamic_fp8_quant.reference(w)
        return q, scale.reshape(-1)
    q, scale = ir_fp8.dynamic_fp8_quant.reference(w.reshape(1, -1))
    return q.reshape(w.shape), scale.reshape(1).expand(w.shape[0]).contiguous()


@dataclass
class Fp8W8A8Config:
    per_channel: bool  # ptpc_fp8; fp8: one scale per weight tensor

    def prepare(self, model: nn.Module) -> int:
        return 0  # online only: the float checkpoint loads as it is

    @torch.no_grad()
    def quantize_loaded(self, model: nn.Module) -> int:
        """Each linear's loaded float weight -> e4m3 (the float copy, and any GGUF blocks
        attached to it, are freed)."""
        chosen = [m for m in model.modules()
                  if isinstance(m, LinearBase) and m.online_quantization]
        for layer in chosen:
            q, scale = quantize_weight_fp8(layer.weight.data, self.per_channel)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            layer.quant_method = Fp8LinearMethod()
            layer.supports_cpu_packing = False
            # The fp8 GEMM never reads a float weight's GGUF blocks or packed copy: they were
            # kept for nothing (the default model's linears held their Q4_1 blocks beside fp8).
            for name in BUFFERS:
                setattr(layer, name, None)
        if chosen and chosen[0].weight.device.type == "cpu":
            logger.warning("fp8 on CPU runs the IR's torch reference (the weights dequantized in "
                           "each GEMM): correct but slow; --quantization int8 is the CPU's")
        logger.info("W8A8 fp8 (%s weight scales): quantized %d linear layers on load",
                    "per-channel" if self.per_channel else "per-tensor", len(chosen))
        return len(chosen)
