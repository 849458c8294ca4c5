"""Loads a Hugging Face checkpoint directory (config.json + safetensors or .bin, single or
sharded)."""
from pathlib import Path

from torch import nn

from kiln.model.loader.weight_utils import checkpoint_files, iterate_checkpoint
from kiln.progress import progress


def load_hf_weights(model: nn.Module, model_dir: Path) -> None:
    if not model_dir.is_dir():
        raise FileNotFoundError(f"checkpoint directory {model_dir} does not exist")
    model.load_weights(progress(iterate_checkpoint(checkpoint_files(model_dir)),
                                desc="loading weights", unit=" tensors"))
