"""The CPU kernels of the per-layer IR ops (csrc/ops_layer.cpp over layer_ops.c, rotary.c): fused
RMSNorm, SiLU-and-mul and rotary (neox, gpt-j), called as torch ops (kiln/ir/native.py says what
each supports).
"""
import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x) [..., hidden], or with residual (norm(x + residual), x + residual)."""
    if residual is None:
        return torch.ops.kiln.rms_norm_native(x, weight, eps)
    return torch.ops.kiln.fused_add_rms_norm_native(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up [..., d]."""
    return torch.ops.kiln.silu_and_mul_native(x)


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor, head_size: int,
           is_neox: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T]; q [T, nq*hd], k [T, nk*hd] (rows may be strided) -> rotated copies."""
    return torch.ops.kiln.rotary_embedding_native(positions, q, k, cos_sin_cache, head_size,
                                                  is_neox)
