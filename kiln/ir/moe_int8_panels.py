"""The IR op `kiln::fused_moe_int8_panels`: fused_moe_int8 over experts whose int8 weights were
packed once at load into VNNI panels (kiln/ir/int8_panels.py's layout, one stack per weight), as
dense int8 weights are on CPUs whose GEMM reads them so. One opaque node in compiled graphs.
"""
import torch

from kiln.ir import int8_panels
from kiln.ir.moe_int8 import _fused_moe_int8_ref
from kiln.ir.op import Implementation, define


def pack_expert_panels(w_q: torch.Tensor) -> torch.Tensor:
    """int8 [E, N, K] (K a multiple of 4) -> uint8 [E, ceil(N / 64), K / 4, 64, 4], each
    expert's weight in panels (pack_int8_panels)."""
    return torch.stack([int8_panels.pack_int8_panels(w) for w in w_q])


def unpack_expert_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_expert_panels: int8 [E, n, K]."""
    return torch.stack([int8_panels.unpack_int8_panels(p, n) for p in panels])


def _fused_moe_int8_panels_ref(x, router_logits, w13_panels, w13_scale, w2_panels, w2_scale,
                               top_k, renormalize, topk_weights=None, topk_ids=None):
    """fused_moe_int8 with each weight in panels; N is its scale's second dimension."""
    return _fused_moe_int8_ref(x, router_logits,
                               unpack_expert_panels(w13_panels, w13_scale.shape[1]), w13_scale,
                               unpack_expert_panels(w2_panels, w2_scale.shape[1]), w2_scale,
                               top_k, renormalize, topk_weights, topk_ids)


def _fake(x, router_logits, w13_panels, w13_scale, w2_panels, w2_scale, top_k, renormalize,
          topk_weights=None, topk_ids=None):
    return x.new_empty((x.shape[0], w2_scale.shape[1]))


def _examples(dtype: torch.dtype, device: str):
    from kiln.ir.moe_int8 import _examples as int8_examples

    x, logits, w13_q, w13_scale, w2_q, w2_scale, top_k, renormalize = int8_examples(dtype, device)
    return (x, logits, pack_expert_panels(w13_q), w13_scale, pack_expert_panels(w2_q), w2_scale,
            top_k, renormalize)


fused_moe_int8_panels = define(
    "fused_moe_int8_panels", "(Tensor x, Tensor router_logits, Tensor w13_panels, "
    "Tensor w13_scale, Tensor w2_panels, Tensor w2_scale, int top_k, bool renormalize, "
    "Tensor? topk_weights=None, Tensor? topk_ids=None) -> Tensor",
    _fused_moe_int8_panels_ref, _fake, _examples)
# Kept whole in graphs (its shapes inside depend on the routing). Panels are packed only where the
# native kernel runs them (kiln/model/layers/moe_cpu.py), never on CUDA: no dense form to record.
fused_moe_int8_panels.register(Implementation("torch", _fused_moe_int8_panels_ref,
                                              graph_op=fused_moe_int8_panels.packet))
