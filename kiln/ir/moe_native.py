"""The `native` provider of the MoE IR ops (fused_moe, fused_moe_int8, fused_moe_int8_panels). Float
experts: the routing here, then one C++ call per layer (csrc/moe_experts.cpp: tokens grouped by
expert once, each routed expert's gate_up -> SiLU-and-mul -> down on AMX-BF16 tiles, the multi-row
AVX-512 kernel (csrc/rows_gemm.c), the GEMV kernel or aten's GEMM over the weights as stored, the
float32 weighted sum). int8 experts, packed in panels or as stored: the same in one C++ call
(csrc/moe_experts_int8.cpp) on the dense int8 MLP's kernels.
In compiled graphs each op stays one opaque node, as the reference's.

Against the reference: float within the GEMMs' summation order (bfloat16: a rounding step of
the output), int8 bit for bit (tests/model/test_moe_native.py).
"""
import torch

from kiln.ir.moe import fused_moe, route
from kiln.ir.moe_int8 import fused_moe_int8
from kiln.ir.moe_int8_panels import fused_moe_int8_panels
from kiln.ir.op import Implementation
from kiln.native import build, int8_ops


def _fused_moe_native(x, router_logits, w13, w2, top_k, renormalize, topk_weights=None,
                      topk_ids=None):
    # one C++ call runs every routed expert on the weights as stored (csrc/moe_experts.cpp)
    weights, ids = route(router_logits, top_k, renormalize, topk_weights, topk_ids)  # [T, k]
    return torch.ops.kiln.fused_experts_native(x, weights, ids, w13, w2)


def _fused_moe_int8_native(x, router_logits, w13_q, w13_scale, w2_q, w2_scale, top_k,
                           renormalize, topk_weights=None, topk_ids=None):
    # one C++ call runs every routed expert on the dense int8 ops (csrc/moe_experts_int8.cpp)
    weights, ids = route(router_logits, top_k, renormalize, topk_weights, topk_ids)  # [T, k]
    return torch.ops.kiln.fused_experts_int8_native(x, weights, ids, w13_q, w13_scale, w2_q,
                                                    w2_scale, False)


def _fused_moe_int8_panels_native(x, router_logits, w13_panels, w13_scale, w2_panels, w2_scale,
                                  top_k, renormalize, topk_weights=None, topk_ids=None):
    # the same call over the experts packed at load: their gate_up GEMM, SiLU-and-mul and quant
    # in one kernel, the down GEMM, each on VNNI or AMX-INT8 tiles by its rows
    weights, ids = route(router_logits, top_k, renormalize, topk_weights, topk_ids)  # [T, k]
    return torch.ops.kiln.fused_experts_int8_native(x, weights, ids, w13_panels, w13_scale,
                                                    w2_panels, w2_scale, True)


def _routing_fits(x, router_logits, experts: int, topk_ids=None) -> bool:
    return (x.dim() == 2 and router_logits.dim() == 2 and router_logits.device.type == "cpu"
            and router_logits.shape == (x.shape[0], experts)
            and (topk_ids is None or topk_ids.device.type == "cpu"))


def _fused_moe_supported(x, router_logits, w13, w2, top_k, renormalize, topk_weights=None,
                         topk_ids=None) -> bool:
    return (x.dtype in build.DTYPES and x.device.type == "cpu" and w13.dtype == w2.dtype == x.dtype
            and w13.device.type == w2.device.type == "cpu" and w13.dim() == w2.dim() == 3
            and w13.shape[2] == x.shape[1] and w13.shape[1] == 2 * w2.shape[2]
            and _routing_fits(x, router_logits, w13.shape[0], topk_ids) and build.available())


def _fused_moe_int8_supported(x, router_logits, w13_q, w13_scale, w2_q, w2_scale, top_k,
                              renormalize, topk_weights=None, topk_ids=None) -> bool:
    return (int8_ops.quant_supported(x)
            and _routing_fits(x, router_logits, w13_q.shape[0], topk_ids)
            and w13_q.dim() == w2_q.dim() == 3 and w13_q.shape[1] % 2 == 0
            and int8_ops.gemm_supported(x.new_empty(0, w13_q.shape[2], dtype=torch.int8),
                                        w13_scale, w13_q[0], w13_scale[0], None, x.dtype)
            and int8_ops.gemm_supported(x.new_empty(0, w2_q.shape[2], dtype=torch.int8),
                                        w2_scale, w2_q[0], w2_scale[0], None, x.dtype))


def _fused_moe_int8_panels_supported(x, router_logits, w13_panels, w13_scale, w2_panels,
                                     w2_scale, top_k, renormalize, topk_weights=None,
                                     topk_ids=None) -> bool:
    def fits(panels, scale):
        return (panels.dim() == 5 and scale.dim() == 2 and panels.shape[0] == scale.shape[0]
                and int8_ops.panels_gemm_supported(
                    x.new_empty(0, 4 * panels.shape[2], dtype=torch.int8), scale, panels[0],
                    scale[0], None, x.dtype))
    return (int8_ops.quant_supported(x)
            and _routing_fits(x, router_logits, w13_panels.shape[0], topk_ids)
            and fits(w13_panels, w13_scale) and fits(w2_panels, w2_scale)
            and w13_scale.shape[1] % 2 == 0)


def register() -> None:
    # graph_op: the IR op itself, kept whole (its kernel runs the bound implementation)
    for op, fn, supported in ((fused_moe, _fused_moe_native, _fused_moe_supported),
                              (fused_moe_int8, _fused_moe_int8_native, _fused_moe_int8_supported),
                              (fused_moe_int8_panels, _fused_moe_int8_panels_native,
                               _fused_moe_int8_panels_supported)):
        op.register(Implementation("native", fn, supported, graph_op=op.packet))
