"""The IR's W8A8 int8 ops: per-token dynamic quantization, the int8 GEMM with per-token x
per-channel scales, and the fused RMSNorm / add + RMSNorm / SiLU-and-mul + quantization that
kiln/compilation/passes/fuse_{norm,act}_quant.py put in compiled graphs.

Each fused op's reference is the composition of the unfused references, so a fusion under the
torch provider changes no bit; the native kernels equal these exactly where the math is integer.
Rounding: x32 * (127 / amax) rounded half-to-even, 127 / amax a true float32 division (not
`127.0 / t`, which torch computes as a reciprocal times 127: two roundings).
"""
import torch

from kiln.ir import layer_ops as ir
from kiln.ir.op import define
from kiln.native import int8_ops

QMAX = 127.0


def _dynamic_int8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q int8 [..., K], scale float32 [..., 1]) with x ~= q * scale per row;
    scale = amax / 127 (0 for an all-zero row, whose q is 0). Where 127 / amax overflows (a row
    below 4e-37) or amax is inf, x * (127 / amax) saturates and 0 * inf is 0."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    qmax = torch.full_like(amax, QMAX)
    inv = torch.where(amax > 0, qmax / amax, torch.zeros_like(amax))
    q = torch.round(x32 * inv).nan_to_num(0.0).clamp(-128, 127).to(torch.int8)
    return q, amax / qmax


def _int8_scaled_mm_ref(q: torch.Tensor, scale: torch.Tensor, w_q: torch.Tensor,
                        w_scale: torch.Tensor, bias: torch.Tensor | None,
                        out_dtype: torch.dtype) -> torch.Tensor:
    """q int8 [M, K], scale float32 [M, 1], w_q int8 [N, K], w_scale float32 [N] (or [N, 1]),
    bias [N] or None -> out_dtype [M, N] = dtype(float32(q @ w_q^T) * scale * w_scale + bias):
    int32 sums exact, then float32 in that order, one rounding to out_dtype."""
    if q.is_cuda:
        acc = _int_mm_padded(q, w_q)
    elif not int8_ops.cpu_int_mm_exact():
        # Products below 2^14, sums below 2^53 for any K a model has: float64 holds them all.
        acc = (q.to(torch.float64) @ w_q.to(torch.float64).t()).to(torch.int32)
    elif q.shape[-1] > 1:
        # contiguous: torch 2.13's CPU _int_mm sums wrong for rows that share memory (stride 0),
        # of either operand
        acc = torch._int_mm(q.contiguous(), w_q.contiguous().t())  # [M, N] int32, exact
    else:  # torch 2.13's CPU _int_mm returns wrong sums for K == 1
        acc = (q.to(torch.int32).unsqueeze(1) * w_q.to(torch.int32)).sum(-1, dtype=torch.int32)
    out = acc.to(torch.float32) * scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def cuda_int_mm_padding(m: int, k: int, n: int) -> tuple[int, int, int]:
    """Zero rows of q, zero k columns of both operands, zero rows of w (the channels) that make
    [m, k] x [k, n] a shape CUDA's _int_mm (cuBLASLt) takes: more than 16 rows, k and n
    multiples of 8. Zeros add nothing to the sums: the result's [m, n] corner is exact."""
    return max(0, 17 - m), -k % 8, -n % 8


def _int_mm_padded(q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """q int8 [M, K] @ w_q int8 [N, K]^T -> int32 [M, N], through operands padded with zeros
    to cuda_int_mm_padding's shape (a decode step has 16 rows or fewer). An operand that needs
    none is not copied: padding the weight would copy it on every call."""
    m, k = q.shape
    n = w_q.shape[0]
    pad_m, pad_k, pad_n = cuda_int_mm_padding(m, k, n)
    if pad_m or pad_k:
        q = torch.nn.functional.pad(q, (0, pad_k, 0, pad_m))
    if pad_k or pad_n:
        w_q = torch.nn.functional.pad(w_q, (0, pad_k, 0, pad_n))
    return torch._int_mm(q.contiguous(), w_q.contiguous().t())[:m, :n]


def _rms_norm_quant_ref(x, weight, eps):
    """dynamic_int8_quant(rms_norm(x, weight, eps)) -> (q, scale)."""
    return _dynamic_int8_quant_ref(ir._rms_norm_ref(x, weight, eps))


def _add_rms_norm_quant_ref(x, residual, weight, eps):
    """(q, scale) of rms_norm(x + residual), and x + residual (as fused_add_rms_norm)."""
    normed, total = ir._fused_add_rms_norm_ref(x, residual, weight, eps)
    q, scale = _dynamic_int8_quant_ref(normed)
    return q, scale, total


def _silu_quant_ref(x):
    """dynamic_int8_quant(silu_and_mul(x)) -> (q, scale)."""
    return _dynamic_int8_quant_ref(ir._silu_and_mul_ref(x))


def _quant_fake_of(shape, like):
    return (like.new_empty(shape, dtype=torch.int8),
            like.new_empty((*shape[:-1], 1), dtype=torch.float32))


def _quant_fake(x):
    return _quant_fake_of(x.shape, x)


def _mm_fake(q, scale, w_q, w_scale, bias, out_dtype):
    return q.new_empty((*q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


def _rms_norm_quant_fake(x, weight, eps):
    return _quant_fake_of(x.shape, x)


def _add_rms_norm_quant_fake(x, residual, weight, eps):
    return (*_quant_fake_of(x.shape, x), torch.empty_like(x))


def _silu_quant_fake(x):
    return _quant_fake_of((*x.shape[:-1], x.shape[-1] // 2), x)


def _t(dtype, device, *shape):
    return torch.randn(*shape, device=device).to(dtype)


def _mm_examples(dtype, device):
    q = torch.randint(-127, 128, (2, 64), dtype=torch.int8, device=device)
    w = torch.randint(-127, 128, (32, 64), dtype=torch.int8, device=device)
    return (q, torch.rand(2, 1, device=device), w, torch.rand(32, device=device), None, dtype)


dynamic_int8_quant = define(
    "dynamic_int8_quant", "(Tensor x) -> (Tensor, Tensor)", _dynamic_int8_quant_ref, _quant_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64),))

int8_scaled_mm = define(
    "int8_scaled_mm", "(Tensor q, Tensor scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor", _int8_scaled_mm_ref, _mm_fake, _mm_examples)

rms_norm_dynamic_int8_quant = define(
    "rms_norm_dynamic_int8_quant", "(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    _rms_norm_quant_ref, _rms_norm_quant_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 64), 1e-6))

fused_add_rms_norm_dynamic_int8_quant = define(
    "fused_add_rms_norm_dynamic_int8_quant", "(Tensor x, Tensor residual, Tensor weight, "
    "float eps) -> (Tensor, Tensor, Tensor)", _add_rms_norm_quant_ref, _add_rms_norm_quant_fake,
    lambda dtype, device: (_t(dtype, device, 2, 64), _t(dtype, device, 2, 64),
                           _t(dtype, device, 64), 1e-6))

silu_and_mul_dynamic_int8_quant = define(
    "silu_and_mul_dynamic_int8_quant", "(Tensor x) -> (Tensor, Tensor)", _silu_quant_ref,
    _silu_quant_fake, lambda dtype, device: (_t(dtype, device, 2, 64),))
