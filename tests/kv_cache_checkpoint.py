"""Edits a float HF checkpoint directory into one that asks for an fp8 KV cache: a
quantization_config in its config.json (llm-compressor's KV-cache-only one by default).

Imported by tests as `kv_cache_checkpoint` (pytest puts tests/ on sys.path through the root conftest).
"""
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# llm-compressor's fp8 KV cache scheme: static symmetric per-tensor e4m3 scales
KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False,
             "symmetric": True}


def kv_only_config(**overrides) -> dict:
    """llm-compressor's KV-cache-only quantization_config (no config_groups)."""
    return {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
            "quantization_status": "compressed", "ignore": [], "kv_cache_scheme": KV_SCHEME,
            **overrides}


def with_quantization_config(src: Path, dst: Path, quantization_config: dict | None = None):
    """A copy of `src` at `dst` with `quantization_config` (kv_only_config's by default) in its
    config.json."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config or kv_only_config()
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def with_kv_scales(model_dir: Path, scales) -> Path:
    """`model_dir`'s model.safetensors with each layer's self_attn.k_scale / v_scale:
    `scales(layer)` -> (k, v)."""
    config = json.loads((model_dir / "config.json").read_text())
    tensors = load_file(str(model_dir / "model.safetensors"))
    for i in range(config["num_hidden_layers"]):
        k, v = scales(i)
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k)
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v)
    save_file(tensors, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    return model_dir
