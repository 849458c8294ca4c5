"""The IR's W8A8 int8 mixture-of-experts op, `kiln::fused_moe_int8`: fused_moe's routing and
weighted sum over experts whose weights are int8 with a float32 scale per expert and channel.

Each routed expert runs exactly the dense W8A8 MLP's ops (kiln/ir/quant.py's references):
per-token quantization, int8 GEMM, SiLU-and-mul, quantization, int8 GEMM; so its output equals
a dense int8 LlamaMLP's bit for bit. One opaque node in compiled graphs, as fused_moe.
"""
import torch

from kiln.ir import quant
from kiln.ir.layer_ops import _silu_and_mul_ref
from kiln.ir.moe import capturing, dense_sum, routed_sum
from kiln.ir.op import Implementation, define


def _int8_expert(w13_q, w13_scale, w2_q, w2_scale):
    """Expert e's MLP as the dense int8 path runs it: each GEMM's output rounded to x's dtype."""
    def mlp(expert: int, x: torch.Tensor) -> torch.Tensor:
        q, scale = quant._dynamic_int8_quant_ref(x)  # [n, H] int8, [n, 1]
        gate_up = quant._int8_scaled_mm_ref(q, scale, w13_q[expert], w13_scale[expert], None,
                                            x.dtype)  # [n, 2I]
        q, scale = quant._dynamic_int8_quant_ref(_silu_and_mul_ref(gate_up))  # [n, I]
        return quant._int8_scaled_mm_ref(q, scale, w2_q[expert], w2_scale[expert], None,
                                         x.dtype)  # [n, H]
    return mlp


def _fused_moe_int8_ref(x: torch.Tensor, router_logits: torch.Tensor, w13_q: torch.Tensor,
                        w13_scale: torch.Tensor, w2_q: torch.Tensor, w2_scale: torch.Tensor,
                        top_k: int, renormalize: bool, topk_weights: torch.Tensor | None = None,
                        topk_ids: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H]; router_logits [T, E]; w13_q int8 [E, 2I, H] with w13_scale float32 [E, 2I];
    w2_q int8 [E, H, I] with w2_scale float32 [E, H] -> [T, H] in x's dtype: sum over each
    token's top-k experts (kiln/ir/moe.py's route) of weight_e * the expert's W8A8 MLP
    (_int8_expert), in float32, rounded once. Under tensor parallelism: this rank's slice of I,
    its partial sum (each rank quantizes its own slice's activations, as a row-parallel layer).
    topk_weights / topk_ids: a routing given, as fused_moe's."""
    return routed_sum(x, router_logits, w13_q.shape[0], w2_q.shape[1],
                      _int8_expert(w13_q, w13_scale, w2_q, w2_scale), top_k, renormalize,
                      topk_weights, topk_ids)


def _fused_moe_int8_torch(x, router_logits, w13_q, w13_scale, w2_q, w2_scale, top_k,
                          renormalize, topk_weights=None, topk_ids=None):
    """The reference, or while a CUDA graph is recorded every expert on every token (dense_sum:
    per-token quantization and exact int32 sums treat each row alone, so the result is equal)."""
    run = dense_sum if capturing() else routed_sum
    return run(x, router_logits, w13_q.shape[0], w2_q.shape[1],
               _int8_expert(w13_q, w13_scale, w2_q, w2_scale), top_k, renormalize, topk_weights,
               topk_ids)


def _fused_moe_int8_fake(x, router_logits, w13_q, w13_scale, w2_q, w2_scale, top_k,
                         renormalize, topk_weights=None, topk_ids=None):
    return x.new_empty((x.shape[0], w2_q.shape[1]))


def _examples(dtype: torch.dtype, device: str):
    def q(*shape):
        return torch.randint(-127, 128, shape, dtype=torch.int8, device=device)

    def s(*shape):
        return torch.rand(*shape, device=device) / 64
    return (torch.randn(2, 64, device=device).to(dtype), torch.randn(2, 4, device=device).to(dtype),
            q(4, 64, 64), s(4, 64), q(4, 64, 32), s(4, 64), 2, True)


fused_moe_int8 = define(
    "fused_moe_int8", "(Tensor x, Tensor router_logits, Tensor w13_q, Tensor w13_scale, "
    "Tensor w2_q, Tensor w2_scale, int top_k, bool renormalize, Tensor? topk_weights=None, "
    "Tensor? topk_ids=None) -> Tensor",
    _fused_moe_int8_ref, _fused_moe_int8_fake, _examples)
# kept whole in graphs (its shapes inside depend on the routing), as fused_moe
fused_moe_int8.register(Implementation("torch", _fused_moe_int8_torch,
                                       graph_op=fused_moe_int8.packet))
