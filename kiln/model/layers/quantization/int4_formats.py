"""The 4-bit weight-only checkpoint formats Kiln reads: compressed-tensors pack-quantized (W4A16),
GPTQ (AutoGPTQ's v1 layout, desc_act false) and AWQ (GEMM): each one's tensors by name and how
each becomes Kiln's canonical int4 layout (kiln/ir/int4.py), and GPTQ / AWQ config validation.
"""
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ConfigError
from kiln.ir.int4 import pack_int4, unpack_int4

# Nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8 (AutoAWQ's GEMM packing).
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


class UnsupportedInt4(ConfigError):
    """A 4-bit quantization_config Kiln does not run; the message names the field and value."""


def refuse(field: str, value: Any, want: str) -> None:
    raise UnsupportedInt4(f"quantization_config.{field}={value!r} is not supported: Kiln serves "
                          f"4-bit weight-only checkpoints (compressed-tensors pack-quantized, "
                          f"GPTQ with desc_act false, AWQ GEMM); {want}")


def _awq_unpack(t: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's order -> int32 [R, C] in column order."""
    nibbles = unpack_int4(t).view(t.shape[0], -1, 8)
    out = torch.empty_like(nibbles)
    out[..., list(AWQ_ORDER)] = nibbles
    return out.view(t.shape[0], -1)


def _int32(t: torch.Tensor, what: str) -> torch.Tensor:
    if t.dtype != torch.int32:
        raise ConfigError(f"checkpoint dtype {t.dtype} where int32 is expected ({what})")
    return t


# Each converter takes the checkpoint tensor and the shard's full output rows (for zero points
# packed along N, whose padding is cut off) and returns it in the canonical layout:
# packed int32 [N, K / 8], scales [N, K / G] float, zeros uint8 [N, K / G] unsigned.
def _ct_zeros(t, rows):
    return unpack_int4(_int32(t, "weight_zero_point"), 0)[:rows].to(torch.uint8)


def _gptq_packed(t, rows):
    return pack_int4(unpack_int4(_int32(t, "qweight"), 0).t())


def _gptq_zeros(t, rows):
    # AutoGPTQ stores zero - 1 (its v1 format); the kernels add the 1 back
    return (unpack_int4(_int32(t, "qzeros"))[:, :rows] + 1).t().to(torch.uint8)


def _awq_packed(t, rows):
    return pack_int4(_awq_unpack(_int32(t, "qweight")).t())


def _awq_zeros(t, rows):
    return _awq_unpack(_int32(t, "qzeros"))[:, :rows].t().to(torch.uint8)


def _same(t, rows):
    return t


def _transposed(t, rows):
    return t.t()


@dataclass(frozen=True)
class Int4Format:
    """A format's tensor names by canonical role (None: it has none), their converters, and the
    per-shard tensors only checked (weight_shape, g_idx)."""
    name: str
    packed: tuple[str, Any]
    scales: tuple[str, Any]
    zeros: tuple[str, Any] | None
    checked: str | None


FORMATS = {
    "compressed-tensors": Int4Format("compressed-tensors", ("weight_packed", _same),
                                     ("weight_scale", _same), ("weight_zero_point", _ct_zeros),
                                     "weight_shape"),
    "gptq": Int4Format("gptq", ("qweight", _gptq_packed), ("scales", _transposed),
                       ("qzeros", _gptq_zeros), "g_idx"),
    "awq": Int4Format("awq", ("qweight", _awq_packed), ("scales", _transposed),
                      ("qzeros", _awq_zeros), None),
}


def _get(raw: dict, *names, default=None):
    return next((raw[n] for n in names if n in raw), default)


def parse_gptq(raw: dict) -> tuple[int, bool]:
    """(group_size, symmetric) of a GPTQ quantization_config Kiln runs; others refused."""
    bits = raw.get("bits")
    if bits != 4:
        refuse("bits", bits, "needs bits 4 (8-bit and others are not built)")
    if raw.get("desc_act"):
        refuse("desc_act", raw["desc_act"], "act-order (desc_act true) reorders the groups by "
               "g_idx and is not supported; requantize with desc_act false")
    fmt = raw.get("checkpoint_format", "gptq")
    if fmt != "gptq":
        refuse("checkpoint_format", fmt, "needs AutoGPTQ's 'gptq' (v1) layout")
    if raw.get("lm_head"):
        refuse("lm_head", raw["lm_head"], "the LM head stays in the model dtype")
    for name in ("dynamic", "modules_in_block_to_quantize"):
        if raw.get(name):
            refuse(name, raw[name], "every decoder linear must be quantized alike")
    return _group_size(raw.get("group_size", -1), "group_size"), bool(raw.get("sym", True))


def parse_awq(raw: dict) -> tuple[int, list[str]]:
    """(group_size, modules_to_not_convert) of an AWQ quantization_config Kiln runs."""
    bits = _get(raw, "bits", "w_bit")
    if bits != 4:
        refuse("bits", bits, "needs bits 4")
    version = str(raw.get("version", "gemm")).lower()
    if version != "gemm":
        refuse("version", raw.get("version"), "needs the GEMM packing ('gemm')")
    if not raw.get("zero_point", True):
        refuse("zero_point", raw["zero_point"], "needs zero_point true (AutoAWQ's default)")
    group = _get(raw, "group_size", "q_group_size", default=-1)
    return _group_size(group, "group_size"), list(raw.get("modules_to_not_convert") or [])


def _group_size(value, field: str) -> int:
    if value is None or value == -1:
        return -1
    if not isinstance(value, int) or value <= 0 or value % 8:
        refuse(field, value, "needs -1 (per channel) or a positive multiple of 8")
    return value


def check_g_idx(g_idx: torch.Tensor, group_size: int) -> None:
    """desc_act false: input k is in group k // group_size; any other order is act-order."""
    k = g_idx.numel()
    want = torch.arange(k, device=g_idx.device) // (group_size if group_size > 0 else k)
    if not torch.equal(g_idx.to(torch.int64), want):
        refuse("desc_act", False, "the checkpoint's g_idx is not in order (act-order weights "
               "saved with desc_act false); requantize without act-order")


# Where each format's stored tensors keep a linear's output rows: (dim, packing along it:
# None, "int4" in order, "awq" in AWQ_ORDER). weight_shape and g_idx have no rows.
_ROWS = {"compressed-tensors": {"weight_packed": (0, None), "weight_scale": (0, None),
                                "weight_zero_point": (0, "int4")},
         "gptq": {"qweight": (1, None), "scales": (1, None), "qzeros": (1, "int4")},
         "awq": {"qweight": (1, "awq"), "scales": (1, None), "qzeros": (1, "awq")}}
_ROWLESS = ("weight_shape", "g_idx")


def checkpoint_format(hf_config) -> str | None:
    """The 4-bit format (a key of FORMATS) of a checkpoint's quantization_config; None: none."""
    from kiln.model.layers.quantization.compressed_tensors import is_weight_only_4bit

    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    raw = qc if isinstance(qc, dict) else qc.to_dict()
    method = raw.get("quant_method")
    if method in ("gptq", "awq"):
        return method
    return "compressed-tensors" if method == "compressed-tensors" and is_weight_only_4bit(
        raw) else None


def split_rows(hf_config, leaf: str, tensor: torch.Tensor, rows: int, split):
    """A fused linear's stored 4-bit tensor `leaf` (qweight, weight_zero_point, ...) as its
    parts', each in the stored layout; `split(t)` takes t rows first ([rows, ...]) and returns
    the parts' tensors rows first, as it does for a float weight. None: `leaf` is no 4-bit
    tensor of the checkpoint's format (the caller splits it as a float one)."""
    fmt = checkpoint_format(hf_config)
    if fmt is None:
        return None
    if leaf in _ROWLESS:  # every part keeps the input width (and g_idx, which is per input)
        parts = split(torch.arange(rows))
        if leaf == "g_idx":
            return [tensor] * len(parts)
        return [torch.tensor([len(p), int(tensor.reshape(-1)[-1])], dtype=tensor.dtype)
                for p in parts]
    if leaf not in _ROWS[fmt]:
        return None
    dim, packing = _ROWS[fmt][leaf]
    t = tensor
    if packing == "int4":
        t = unpack_int4(_int32(t, leaf), dim)
    elif packing == "awq":
        t = _awq_unpack(_int32(t, leaf))
    t = t.narrow(dim, 0, rows) if packing else t  # packing pads the rows to words of 8
    if t.shape[dim] != rows:
        raise ConfigError(f"checkpoint tensor {leaf} of a fused linear holds {t.shape[dim]} "
                          f"output rows where the config gives {rows}; the checkpoint does not "
                          "match its config")
    out = []
    for part in split(t.movedim(dim, 0)):
        part = part.movedim(0, dim)
        if packing:
            pad = -part.shape[dim] % PACK_ROWS
            part = torch.nn.functional.pad(part, (0, pad) if dim == part.dim() - 1 else
                                           (0, 0, 0, pad))
            part = _awq_pack(part) if packing == "awq" else pack_int4(part, dim)
        out.append(part.contiguous())
    return out


PACK_ROWS = 8  # values an int32 word holds


def _awq_pack(values: torch.Tensor) -> torch.Tensor:
    """_awq_unpack's inverse: int32 [R, C] in column order -> [R, C / 8] in AWQ's order."""
    v = values.reshape(values.shape[0], -1, 8)[..., list(AWQ_ORDER)]
    return pack_int4(v.reshape(values.shape[0], -1))
