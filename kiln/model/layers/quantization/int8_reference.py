"""Plain-torch references that define the W8A8 int8 ops: symmetric per-token dynamic activation
quantization, the int8 GEMM with per-token x per-channel scales, and the fused norm/act + quant.

Every native implementation is tested against these: int8 values, int32 sums and scales exactly.
Rounding: x32 * (127 / amax) rounded half-to-even, 127 / amax a true float32 division (not
`127.0 / t`, which torch computes as reciprocal times 127: two roundings).
"""
import torch
import torch.nn.functional as F

QMAX = 127.0


def dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q int8 [..., K], scale float32 [..., 1]) with x ~= q * scale per row;
    scale = amax / 127 (0 for an all-zero row, whose q is 0)."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    qmax = torch.full_like(amax, QMAX)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv).clamp_(-128, 127).to(torch.int8)
    return q, amax / qmax


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] float -> (int8 [N, K], scale float32 [N]): the same symmetric rounding per
    output channel (what online `quantization="int8"` stores)."""
    q, scale = dynamic_int8_quant(w)
    return q, scale.reshape(-1)


def int8_scaled_mm(q: torch.Tensor, scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
                   bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """q int8 [M, K], scale float32 [M, 1], w_q int8 [N, K], w_scale float32 [N] (or [N, 1]),
    bias [N] or None -> out_dtype [M, N] = dtype(float32(q @ w_q^T) * scale * w_scale + bias):
    int32 sums exact, then float32 in that order, one rounding to out_dtype."""
    if q.shape[0] > 0 and q.shape[1] > 1:
        acc = torch._int_mm(q, w_q.t())  # [M, N] int32, exact
    else:  # torch 2.13's CPU _int_mm returns wrong sums for K == 1
        acc = (q.to(torch.int32).unsqueeze(1) * w_q.to(torch.int32)).sum(-1, dtype=torch.int32)
    out = acc.to(torch.float32) * scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As the IR's rms_norm: normalise in float32, scale in the input dtype (Hugging Face's Llama).
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm_dynamic_int8_quant(x: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dynamic_int8_quant(rms_norm(x, weight, eps)): the normed activation rounded to its dtype
    first, exactly as the unfused sequence has it."""
    return dynamic_int8_quant(_rms_norm(x, weight, eps))


def fused_add_rms_norm_dynamic_int8_quant(
        x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, scale, x + residual): the residual add rounded to x's dtype, then as above."""
    total = x + residual
    q, scale = dynamic_int8_quant(_rms_norm(total, weight, eps))
    return q, scale, total


def silu_and_mul_dynamic_int8_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., 2d] = [gate | up] -> dynamic_int8_quant(dtype(silu(gate)) * up)."""
    d = x.shape[-1] // 2
    return dynamic_int8_quant(F.silu(x[..., :d]) * x[..., d:])
