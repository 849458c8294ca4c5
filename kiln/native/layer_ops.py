"""Python entry points of csrc/layer_ops.c: fused RMSNorm, SiLU-and-mul and rotary for CPU, the
`native` implementations of those IR ops (kiln/ir/native.py says what each supports).
"""
import ctypes

import torch

from kiln.native import build

_P, _I64, _I32, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_float
SIGNATURES = (
    ("kiln_rms_norm", (_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I32, _F, _I32, _I32)),
    ("kiln_silu_and_mul", (_P, _I64, _P, _I64, _I32, _I32, _I32)),
    ("kiln_rotary", (_P, _P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, _I32, _I32, _I32, _I32,
                     _I32)),
)


def _lib() -> ctypes.CDLL | None:
    return build.load("layer_ops", SIGNATURES)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with contiguous columns (a view when it can be)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """norm(x) [..., hidden], or with residual (norm(x + residual), x + residual)."""
    rows = _rows(x)
    n, hidden = rows.shape
    # The kernel reads `hidden` weights and residual values a row: shorter ones it would
    # read past their end.
    if weight.numel() != hidden:
        raise ValueError(f"rms_norm: weight has {weight.numel()} values for hidden size {hidden}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"rms_norm: residual shape {tuple(residual.shape)} != x shape "
                         f"{tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype)
    res_rows = _rows(residual) if residual is not None else None
    res_out = torch.empty(x.shape, dtype=x.dtype) if residual is not None else None
    build.check(_lib().kiln_rms_norm(
        rows.data_ptr(), rows.stride(0),
        res_rows.data_ptr() if res_rows is not None else None,
        res_rows.stride(0) if res_rows is not None else 0,
        res_out.data_ptr() if res_out is not None else None,
        weight.contiguous().data_ptr(), out.data_ptr(), hidden, n, hidden, eps,
        build.DTYPES[x.dtype], torch.get_num_threads()), "kiln_rms_norm")
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] = [gate | up] -> silu(gate) * up [..., d]."""
    rows = _rows(x)
    n, width = rows.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: the last dimension ({width}) must be even [gate | up]")
    d = width // 2
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
    build.check(_lib().kiln_silu_and_mul(rows.data_ptr(), rows.stride(0), out.data_ptr(), n, d,
                                         build.DTYPES[x.dtype], torch.get_num_threads()),
                "kiln_silu_and_mul")
    return out


def rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
           cos_sin_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64; q [T, nq*hd], k [T, nk*hd] (rows may be strided) -> rotated copies."""
    q, k = _rows(q), _rows(k)
    positions = positions.to(torch.int64).contiguous()
    cache = cos_sin_cache.to(torch.float32).contiguous()
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype), torch.empty(k.shape, dtype=k.dtype)
    rc = _lib().kiln_rotary(
        positions.data_ptr(), q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0),
        q_out.data_ptr(), k_out.data_ptr(), cache.data_ptr(), cache.shape[0], q.shape[0],
        q.shape[1] // head_size, k.shape[1] // head_size, head_size, build.DTYPES[q.dtype],
        torch.get_num_threads())
    if rc == 1:
        raise IndexError(f"rotary: a position is outside [0, {cache.shape[0]}) (the rope cache's "
                         "max_position_embeddings)")
    if rc == 3:
        raise ValueError(f"rotary: head_size must be even, got {head_size}")
    build.check(rc, "kiln_rotary")
    return q_out, k_out
