"""Finding and streaming checkpoint tensors: safetensors files of an HF directory.

Yields (HF name, tensor) pairs one at a time so a model never holds two full copies.
"""
import json
from collections.abc import Iterator
from pathlib import Path

import torch

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF checkpoint directory, single-file or sharded."""
    index = model_dir / SAFETENSORS_INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise FileNotFoundError(f"weight shard {f} (listed in {index}) does not exist")
        return files
    single = model_dir / SAFETENSORS_SINGLE
    if single.exists():
        return [single]
    others = sorted(model_dir.glob("*.safetensors"))
    if others:
        return others
    raise FileNotFoundError(f"no weights found: expected {single} or {index}")


def iterate_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
