"""Writes 4-bit weight-only checkpoints from a float HF checkpoint directory, each as its tool saves
one: compressed-tensors pack-quantized (llm-compressor; packed with the installed package's own
pack_to_int32), GPTQ (AutoGPTQ's v1 packing: qweight along K, qzeros - 1 along N) and AWQ
(AutoAWQ's GEMM packing, nibble order 0 2 4 6 1 3 5 7), and beside it a float checkpoint holding
the dequantized weights: what HF transformers runs as the oracle.

Imported by tests as `int4_checkpoint` (pytest puts tests/ on sys.path).
"""
import json
import shutil
from pathlib import Path

import torch

LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_groups(w: torch.Tensor, group: int, symmetric: bool, scale_dtype,
                    min_zero: int = 0):
    """w [N, K] -> (u unsigned 4-bit [N, K], scale [N, K / g] in scale_dtype, zero unsigned
    [N, K / g]) by min-max per group (g = K for group -1); w ~ (u - zero) * scale."""
    n, k = w.shape
    g = k if group == -1 else group
    wg = w.float().reshape(n, k // g, g)
    if symmetric:
        scale = wg.abs().amax(-1) / 7.5
        zero = torch.full_like(scale, 8)
    else:
        lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
        scale = (hi - lo) / 15
        zero = torch.round(-lo / scale).clamp(min_zero, 15)
    scale = scale.clamp_min(1e-8).to(scale_dtype)
    u = torch.round(wg / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(0, 15)
    return u.reshape(n, k).to(torch.int32), scale, zero.to(torch.int32)


def dequantize(u, scale, zero, group: int) -> torch.Tensor:
    g = u.shape[1] if group == -1 else group
    return ((u - zero.repeat_interleave(g, 1)).float()
            * scale.float().repeat_interleave(g, 1))


def _as_int32(v64: torch.Tensor) -> torch.Tensor:
    return torch.where(v64 >= 2**31, v64 - 2**32, v64).to(torch.int32)


def _gptq(u, scale, zero):
    qweight = torch.zeros(u.shape[1] // 8, u.shape[0], dtype=torch.int64)
    ut = u.t().to(torch.int64)  # [K, N]
    for j in range(8):
        qweight |= ut[j::8] << (4 * j)
    z = (zero.t() - 1).to(torch.int64)  # [K / g, N]: AutoGPTQ stores zero - 1
    qzeros = torch.zeros(z.shape[0], z.shape[1] // 8, dtype=torch.int64)
    for j in range(8):
        qzeros |= z[:, j::8] << (4 * j)
    return {"qweight": _as_int32(qweight), "qzeros": _as_int32(qzeros),
            "scales": scale.t().contiguous()}


def _awq_pack(v: torch.Tensor) -> torch.Tensor:
    """unsigned 4-bit [R, C] -> int32 [R, C / 8], nibble i of word c = column 8c + AWQ_ORDER[i]."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(AWQ_ORDER):
        out |= v[:, col::8].to(torch.int64) << (4 * i)
    return _as_int32(out)


def _awq(u, scale, zero):
    return {"qweight": _awq_pack(u.t()), "qzeros": _awq_pack(zero.t()),
            "scales": scale.t().contiguous()}


def _compressed(u, scale, zero, symmetric: bool):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    out = {"weight_packed": pack_to_int32((u - 8).to(torch.int8), 4),
           "weight_scale": scale, "weight_shape": torch.tensor(list(u.shape))}
    if not symmetric:
        out["weight_zero_point"] = pack_to_int32((zero - 8).to(torch.int8), 4, packed_dim=0)
    return out


def quantization_config(fmt: str, group: int, symmetric: bool) -> dict:
    if fmt == "compressed-tensors":
        strategy = {"strategy": "channel", "group_size": None} if group == -1 else {
            "strategy": "group", "group_size": group}
        return {"quant_method": "compressed-tensors", "format": "pack-quantized",
                "quantization_status": "compressed", "ignore": ["lm_head"],
                "kv_cache_scheme": None, "config_groups": {"group_0": {
                    "targets": ["Linear"], "input_activations": None, "output_activations": None,
                    "weights": {"num_bits": 4, "type": "int", "symmetric": symmetric,
                                "dynamic": False, "observer": "minmax", **strategy}}}}
    if fmt == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                "sym": symmetric, "damp_percent": 0.01, "true_sequential": True,
                "static_groups": False, "checkpoint_format": "gptq"}
    return {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
            "version": "gemm", "modules_to_not_convert": None}


def write_int4_checkpoint(src: Path, dst: Path, oracle: Path, fmt: str, group: int,
                          symmetric: bool = False, keep_float: str | None = None,
                          linears: tuple[str, ...] = LINEAR_SUFFIXES) -> tuple[Path, Path]:
    """`dst`: `src` with every decoder linear stored 4-bit in `fmt` (but those whose module
    name contains `keep_float`, listed in AWQ's modules_to_not_convert); `oracle`: `src` with
    those weights replaced by their dequantized values (float32). AWQ is asymmetric only.
    `linears`: the family's linear module names (fused ones, GPT-NeoX's query_key_value, are
    quantized whole, as the tools do)."""
    import re

    from safetensors.torch import load_file, save_file

    for d in (dst, oracle):
        shutil.copytree(src, d, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out, floats = {}, {}
    scale_dtype = torch.bfloat16 if fmt == "compressed-tensors" else torch.float16
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if not (name.endswith(".weight") and module.rsplit(".", 1)[-1] in linears) or (
                keep_float and re.search(re.escape(keep_float), module)):
            out[name] = floats[name] = t
            continue
        u, scale, zero = quantize_groups(t, group, symmetric, scale_dtype,
                                         min_zero=1 if fmt == "gptq" else 0)
        floats[name] = dequantize(u, scale, zero, group)
        stored = (_compressed(u, scale, zero, symmetric) if fmt == "compressed-tensors" else
                  _gptq(u, scale, zero) if fmt == "gptq" else _awq(u, scale, zero))
        if fmt == "gptq":
            k = u.shape[1]
            stored["g_idx"] = torch.arange(k, dtype=torch.int32) // (k if group == -1 else group)
        out.update({f"{module}.{k}": v for k, v in stored.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    save_file(floats, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config(fmt, group, symmetric)
    if keep_float:
        config["quantization_config"]["modules_to_not_convert"] = [keep_float]
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst, oracle
