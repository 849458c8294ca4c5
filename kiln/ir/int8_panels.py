"""The int8 weight in VNNI panels, packed once at load for CPUs whose int8 GEMM reads it so
(csrc/int8_vnni_gemm.c), and the IR ops on that layout: int8_scaled_mm_panels (int8_scaled_mm)
and int8_scaled_mm_panels_silu_quant (the MLP's gate/up GEMM with the SiLU-and-mul and the
quantization after it, which kiln/compilation/passes/fuse_mm_act_quant.py puts in graphs).

Layout: uint8 [ceil(N / 64), K / 4, 64, 4]; panel p, group g, column c, byte b holds
w_q[64 p + c, 4 g + b] + 128 (VPDPBUSD multiplies unsigned by signed bytes), 0 past N. A decode
step then streams each panel once, with no offset or horizontal sum per call.
"""
import torch

from kiln.ir import quant
from kiln.ir.op import define

PANEL = 64  # output channels a panel
GROUP = 4  # bytes of K a channel has in each group (one VNNI dot product)


def pack_int8_panels(w_q: torch.Tensor) -> torch.Tensor:
    """w_q int8 [N, K] (K a multiple of 4) -> its panels, uint8 [ceil(N / 64), K / 4, 64, 4]."""
    n, k = w_q.shape
    if k % GROUP:
        raise ValueError(f"int8 panels need K a multiple of {GROUP}, got a weight {tuple(w_q.shape)}")
    panels = -(-n // PANEL)
    u8 = torch.zeros(panels * PANEL, k, dtype=torch.uint8, device=w_q.device)
    u8[:n] = (w_q.to(torch.int16) + 128).to(torch.uint8)
    return u8.reshape(panels, PANEL, k // GROUP, GROUP).permute(0, 2, 1, 3).contiguous()


def unpack_int8_panels(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_int8_panels: int8 [n, K]."""
    p, groups, _, _ = panels.shape
    u8 = panels.permute(0, 2, 1, 3).reshape(p * PANEL, groups * GROUP)[:n]
    return (u8.to(torch.int16) - 128).to(torch.int8)


def _int8_scaled_mm_panels_ref(q, scale, w_panels, w_scale, bias, out_dtype):
    """int8_scaled_mm with the weight in panels; N is w_scale's length."""
    w_q = unpack_int8_panels(w_panels, w_scale.numel())
    return quant._int8_scaled_mm_ref(q, scale, w_q, w_scale, bias, out_dtype)


def _panels_mm_fake(q, scale, w_panels, w_scale, bias, out_dtype):
    return q.new_empty((*q.shape[:-1], w_scale.shape[0]), dtype=out_dtype)


def _panels_mm_examples(dtype, device):
    q, scale, w_q, w_scale, bias, out_dtype = quant._mm_examples(dtype, device)
    return (q, scale, pack_int8_panels(w_q), w_scale, bias, out_dtype)


def _mm_silu_quant_ref(q, scale, w_panels, w_scale, bias, out_dtype):
    """dynamic_int8_quant(silu_and_mul(int8_scaled_mm_panels(...))) -> (q [M, N / 2], scale)."""
    return quant._silu_quant_ref(
        _int8_scaled_mm_panels_ref(q, scale, w_panels, w_scale, bias, out_dtype))


def _mm_silu_quant_fake(q, scale, w_panels, w_scale, bias, out_dtype):
    return quant._quant_fake_of((*q.shape[:-1], w_scale.shape[0] // 2), q)


int8_scaled_mm_panels = define(
    "int8_scaled_mm_panels", "(Tensor q, Tensor scale, Tensor w_panels, Tensor w_scale, "
    "Tensor? bias, ScalarType out_dtype) -> Tensor", _int8_scaled_mm_panels_ref, _panels_mm_fake,
    _panels_mm_examples)

int8_scaled_mm_panels_silu_quant = define(
    "int8_scaled_mm_panels_silu_quant", "(Tensor q, Tensor scale, Tensor w_panels, "
    "Tensor w_scale, Tensor? bias, ScalarType out_dtype) -> (Tensor, Tensor)",
    _mm_silu_quant_ref, _mm_silu_quant_fake, _panels_mm_examples)
