"""Finding and streaming checkpoint tensors: the safetensors (or, failing that, PyTorch .bin)
files of an HF directory. Yields (HF name, tensor) pairs one file at a time.
"""
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from kiln.errors import ConfigError

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"


def _indexed_files(model_dir: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{index} is not a checkpoint index (a JSON object with a "
                          f"'weight_map'): {type(e).__name__}: {e}") from None
    files = [model_dir / name for name in sorted(set(weight_map.values()))]
    for f in files:
        if not f.exists():
            raise FileNotFoundError(f"weight shard {f} (listed in {index}) does not exist")
    return files


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of an HF checkpoint directory: safetensors single-file or sharded,
    else PyTorch .bin single-file or sharded (as transformers and vLLM prefer them)."""
    for index, single, pattern in ((SAFETENSORS_INDEX, SAFETENSORS_SINGLE, "*.safetensors"),
                                   (BIN_INDEX, BIN_SINGLE, "pytorch_model*.bin")):
        if (model_dir / index).exists():
            return _indexed_files(model_dir, model_dir / index)
        if (model_dir / single).exists():
            return [model_dir / single]
        others = sorted(model_dir.glob(pattern))
        if others:
            return others
    raise FileNotFoundError(f"no weights found: expected {model_dir / SAFETENSORS_SINGLE}, "
                            f"{SAFETENSORS_INDEX} with its shards, or {BIN_SINGLE}")


def iterate_checkpoint(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of safetensors or .bin files, by HF name."""
    from safetensors import safe_open

    for path in files:
        if path.suffix == ".safetensors":
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors' own errors do not name the file
                raise ConfigError(f"could not read {path} as safetensors ({type(e).__name__}: "
                                  f"{e}); the file is damaged or incomplete: download it "
                                  "again") from None
            with handle as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
            continue
        # mapped where torch can: only its zip format (torch >= 1.6) maps; the legacy format
        # of older checkpoints, which HF and vLLM load, is read whole
        mmap = zipfile.is_zipfile(path)
        try:  # weights_only: a .bin is a pickle; never run code from it
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
        except Exception as e:
            # torch's first line says what failed (a cut archive, a non-tensor object); the
            # rest is advice to drop weights_only, which Kiln never does.
            first = next((line for line in str(e).splitlines() if line.strip()), "")
            raise ConfigError(f"could not read {path} as a state dict of tensors only "
                              f"({type(e).__name__}: {first.strip()}); the file is damaged or "
                              "incomplete (download it again), or holds more than tensors, "
                              "which Kiln never loads (torch.load(weights_only=True)): convert "
                              "it to safetensors") from None
        if not isinstance(state, dict):
            raise ConfigError(f"{path} holds a {type(state).__name__}, not a state dict of "
                              "tensors; convert it to safetensors")
        for name, tensor in state.items():
            if not isinstance(tensor, torch.Tensor):
                raise ConfigError(f"{path}: entry {name} is a {type(tensor).__name__}, not a "
                                  "tensor; convert the checkpoint to safetensors")
            yield name, tensor
        del state

