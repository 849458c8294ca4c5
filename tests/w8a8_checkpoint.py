"""Writes a W8A8 int8 checkpoint in compressed-tensors' layout (as llm-compressor saves one) from
a float HF checkpoint directory: int8 `weight` + `weight_scale` [N, 1] per quantized linear.

Imported by tests as `w8a8_checkpoint` (pytest puts tests/ on sys.path through the root conftest).
"""
import json
import shutil
from pathlib import Path

import torch

# Phi-3's checkpoints hold q/k/v and gate/up fused: qkv_proj, gate_up_proj (one scale per row).
# Mixtral's experts: w1 / w3 / w2 (the MoE routers, `gate`, stay float: ignore them).
# StarCoder2's MLP: c_fc / c_proj; GPT-NeoX's: query_key_value (per head fused), dense,
# dense_h_to_4h / dense_4h_to_h.
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                   "qkv_proj", "gate_up_proj", "w1", "w2", "w3", "c_fc", "c_proj",
                   "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h", "fc1", "fc2")


def w8a8_quantization_config(**overrides) -> dict:
    """llm-compressor's W8A8 int8 preset, serialized; `overrides` replace top-level fields."""
    config = {
        "quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": ["lm_head"], "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "output_activations": None,
            "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                        "dynamic": False, "group_size": None, "observer": "minmax"},
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True, "group_size": None}}},
    }
    config.update(overrides)
    return config


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 as llm-compressor's minmax observer computes it (its own code,
    not Kiln's): scale = amax / 127, q = clamp(round(w / scale), -128, 127)."""
    w = w.to(torch.float32)
    scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127.0  # [N, 1]
    q = torch.clamp(torch.round(w / scale), -128, 127).to(torch.int8)
    return q, scale


def write_w8a8_checkpoint(src: Path, dst: Path, scale_dtype=torch.float32,
                          keep_float: str | None = None, **config_overrides) -> Path:
    """Copy `src` to `dst` with every decoder linear stored W8A8 int8, except those whose
    module name matches the regex `keep_float` (as an `ignore` list leaves them)."""
    import re

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rsplit(".", 1)[-1] in LINEAR_SUFFIXES and not (
                keep_float and re.fullmatch(keep_float, module)):
            q, scale = quantize_rows(t)
            out[name], out[module + ".weight_scale"] = q, scale.to(scale_dtype)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = w8a8_quantization_config(**config_overrides)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst
