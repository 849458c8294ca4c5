"""Edits a float HF checkpoint directory into one that asks for an fp8 KV cache: a
quantization_config in its config.json (llm-compressor's KV-cache-only one by default).

Imported by tests as `kv_cache_checkpoint` (pytest puts tests/ on sys.path through the root conftest).
"""
import json
import shutil
from pathlib import Path

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
