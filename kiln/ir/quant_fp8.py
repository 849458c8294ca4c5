"""The IR's W8A8 fp8 ops (e4m3): per-token dynamic quantization of activations and the scaled GEMM
over fp8 weights with a float32 scale per output channel, and their `cuda` implementation.

The references define the meaning in float32 and run anywhere (slowly: the GEMM dequantizes the
weight each call); the `cuda` provider runs the GEMM as one `torch._scaled_mm` with row-wise
scales on GPUs with fp8 tensor cores (compute capability 8.9+; row-wise scales need 9.0 there).
"""
import torch

from kiln.ir.op import Implementation, define

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def _dynamic_fp8_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float -> (q float8_e4m3fn [..., K], scale float32 [..., 1]) with x ~= q * scale
    per row; scale = amax / 448 (1 for an all-zero row, whose q is 0), q = e4m3(x / scale)
    rounded to nearest even and saturated at +-448. A row whose amax / 448 underflows to 0 (amax
    below 6e-43) also takes scale 1: x / 0 made NaN of its zeros, and of the row's GEMM output."""
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1, keepdim=True)  # [..., 1]
    scale = amax / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(amax))
    q = (x32 / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def _fp8_scaled_mm_ref(q: torch.Tensor, scale: torch.Tensor, w_q: torch.Tensor,
                       w_scale: torch.Tensor, bias: torch.Tensor | None,
                       out_dtype: torch.dtype) -> torch.Tensor:
    """q e4m3 [M, K], scale float32 [M, 1], w_q e4m3 [N, K], w_scale float32 [N] (or [N, 1]),
    bias [N] or None -> out_dtype [M, N] = dtype(float32(q) @ float32(w_q)^T * scale * w_scale +
    bias): products of e4m3 values are exact in float32; the sums are float32."""
    acc = q.to(torch.float32) @ w_q.to(torch.float32).t()  # [M, N]
    out = acc * scale.reshape(-1, 1) * w_scale.reshape(1, -1)
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _quant_fake(x):
    return (x.new_empty(x.shape, dtype=FP8),
            x.new_empty((*x.shape[:-1], 1), dtype=torch.float32))


def _mm_fake(q, scale, w_q, w_scale, bias, out_dtype):
    return q.new_empty((*q.shape[:-1], w_q.shape[0]), dtype=out_dtype)


def _quant_examples(dtype, device):
    return (torch.randn(2, 64, device=device).to(dtype),)


def _mm_examples(dtype, device):
    q = torch.randn(16, 64, device=device).to(FP8)
    w = torch.randn(32, 64, device=device).to(FP8)
    return (q, torch.rand(16, 1, device=device), w, torch.rand(32, device=device), None, dtype)


dynamic_fp8_quant = define(
    "dynamic_fp8_quant", "(Tensor x) -> (Tensor, Tensor)", _dynamic_fp8_quant_ref, _quant_fake,
    _quant_examples)

fp8_scaled_mm = define(
    "fp8_scaled_mm", "(Tensor q, Tensor scale, Tensor w_q, Tensor w_scale, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor", _fp8_scaled_mm_ref, _mm_fake, _mm_examples)


def scaled_mm_supported(q, scale, w_q, w_scale, bias, out_dtype) -> bool:
    """torch._scaled_mm with row-wise scales: a CUDA GPU of compute capability 9.0+, bfloat16
    out, 2-D fp8 operands with K and N multiples of 16 (its tensor-core tiles)."""
    if not (q.device.type == "cuda" and w_q.device == q.device and q.dtype == w_q.dtype == FP8
            and q.dim() == 2 and w_q.dim() == 2 and out_dtype == torch.bfloat16
            and q.shape[1] % 16 == 0 and w_q.shape[0] % 16 == 0):
        return False
    return torch.cuda.get_device_capability(q.device) >= (9, 0)


def _scaled_mm(q, scale, w_q, w_scale, bias, out_dtype):
    if q.shape[1] % 16 or w_q.shape[0] % 16:  # chosen once per op: a layer off its tiles
        return _fp8_scaled_mm_ref(q, scale, w_q, w_scale, bias, out_dtype)
    # w_q [N, K] row-major: its transpose is the column-major [K, N] operand _scaled_mm wants.
    # The bias is added after (not every torch takes one with row-wise scales, which also
    # output bfloat16 only): the sum is rounded twice, within one bfloat16 step of the
    # reference's single rounding (tests/gpu/test_w8a8_gpu.py bounds it).
    out = torch._scaled_mm(q.contiguous(), w_q.t(), scale_a=scale.reshape(-1, 1).float(),
                           scale_b=w_scale.reshape(1, -1).float(), out_dtype=out_dtype)
    return out if bias is None else out + bias.to(out_dtype)


def register() -> None:
    fp8_scaled_mm.register(Implementation("cuda", _scaled_mm, scaled_mm_supported))
